# Sourced by runs/teacher.sh, runs/vs_sft.sh, runs/ppo.sh and runs/rl_compare.sh: the dev evaluation, the dev pick,
# the SFT-continued control and the RL arms' test table. They read PY, DATA (the world), DEV_N (dev questions scored), DEV_FLAGS (more evaluate.py flags, e.g. the
# runs' --topk), MORE and EVERY (SFT-continued's extra steps and its checkpoint interval).
dev() {  # MODEL OUT [MODEL OUT ...]: routed, greedy, on the first DEV_N dev questions, by one process (one engine, the
  # checkpoints' weights swapped in); a pair whose OUT holds its results is skipped
  local models=() outs=()
  while (( $# )); do
    test -f $2/results.json || { models+=($1); outs+=($2); }
    shift 2
  done
  (( ${#models[@]} )) || return 0
  $PY evaluate.py --model ${models[@]} --methods routed --data $DATA --split dev --n_questions $DEV_N \
    --out ${outs[@]} ${DEV_FLAGS:-}
}
pick() {  # "STEPS" RESULTS...: the step whose dev results.json has the best mean of F1-Recall and routing accuracy
  $PY -c "import json, sys; r = [next(iter(json.load(open(f)).values())) for f in sys.argv[2:]]
s = [(x['f1_recall'] + x['routing_acc']) / 2 for x in r]; i = s.index(max(s)); print(sys.argv[1].split()[i], s[i])" "$@"
}  # the earliest of equal scores, as stepgrpo.py's <out>/best
continue_sft() {  # START OUT [sft.py flags]: the SFT run resumed for MORE steps (runs/sft_continue.sh), a checkpoint
  # every EVERY steps, each scored on dev (<dir of OUT>/dev-<name of OUT>-<step>) -> OUT/best, the dev pick
  local start=$1 out=$2 k0 k files=() pairs=() cands dev_at=$(dirname $2)/dev-$(basename $2)
  shift 2
  k0=$(basename "$(readlink -f $start)"); k0=${k0#step_}
  cands="$(seq $(( (k0 / EVERY + 1) * EVERY )) $EVERY $(( k0 + MORE - 1 )) | xargs) $(( k0 + MORE ))"  # what it saves
  PY=$PY bash runs/sft_continue.sh $start $out $MORE "$@" --eval_every 0 --save_every $EVERY \
    --keep $(wc -w <<< "$cands")
  test -e $out/best && return
  for k in $cands; do
    pairs+=($out/step_$k $dev_at-$k)
    files+=($dev_at-$k/results.json)
  done
  dev ${pairs[@]}
  read k top <<< "$(pick "$cands" "${files[@]}")"
  ln -sfn step_$k $out/best && echo "SFT-continued dev-picked: $out step $k ($top)"
}
rl_arm() {  # NAME FLAGS...: one resumable stepgrpo.py run at OUT/NAME with the script's $common flags
  local name=$1
  shift
  test -e $OUT/$name/final || $PY stepgrpo.py $common "$@" --out $OUT/$name --resume auto
}
score_arms() {  # START OUT "ARMS" "RL": START (the row sft) and each arm's dev pick (OUT/<arm>/best) scored routed,
  # greedy, on the first TEST_N test questions by one process (OUT/test-<arm>), the table, each arm's paired intervals
  # against the SFT; for the RL arms (stepgrpo.py runs) their TFLOP (bench/flops.py), generated tokens, dev pick and
  # seconds a step
  local START=$1 OUT=$2 ARMS=$3 RL=$4 models=() outs=() names=()
  for a in sft $ARMS; do  # the SFT and the picks not scored yet, in one process: one engine, each swapped in
    test -f $OUT/test-$a/results.json && continue
    models+=($(test $a = sft && echo $START || echo $OUT/$a/best)) outs+=($OUT/test-$a) names+=($a)
  done
  if (( ${#models[@]} )); then
    $PY evaluate.py --model ${models[@]} --name ${names[@]} --methods routed --data $DATA --split test \
      --n_questions $TEST_N --topk 1 --out ${outs[@]}
  fi
  $PY evaluate.py --combine $OUT/test-sft/results.json $(printf "$OUT/test-%s/results.json " $ARMS) --data $DATA \
    --split test --out $OUT/table
  for a in $ARMS; do
    echo "$a - sft:"
    $PY evaluate.py --paired $OUT/test-sft/trajectories-routed.jsonl $OUT/test-$a/trajectories-routed.jsonl | grep -A1 "f1_recall:\|routing_acc:"
  done
  $PY -m bench.flops --runs $(printf "$OUT/%s " $RL)
  $PY - $OUT $RL <<'EOF'
import json, sys
from pathlib import Path
out, arms = Path(sys.argv[1]), sys.argv[2:]
keys = ("rollout_s", "update_s", "critic_s", "sync_s", "dev_s")
extra = ("refilled", "clip_low_frac", "clip_high_frac", "explained_var")
print("| arm | generated tokens | pick (dev score) | " + " | ".join(f"{k} a step" for k in keys) + " | " +
      " | ".join(f"mean {k}" for k in extra) + " |")
print("|---|---|---|" + "---|" * (len(keys) + len(extra)))
for a in arms:
    recs = [json.loads(l) for l in open(out / a / "log.jsonl") if "loss" in json.loads(l)]
    dev = {json.loads(l)["step"]: json.loads(l)["dev_score"] for l in open(out / a / "log.jsonl") if "dev_score" in json.loads(l)}
    best = max((s for s in dev if s), key=lambda s: (dev[s], -s))
    mean = lambda k: sum(r.get(k) or 0.0 for r in recs) / len(recs)
    logged = lambda k: f"{mean(k):.3f}" if any(r.get(k) is not None for r in recs) else "-"
    print(f"| {a} | {sum(r['rollout_generated'] * r['world'] for r in recs):.0f} | step {best} ({dev[best]:.1f}; start "
          f"{dev[0]:.1f}) | " + " | ".join(f"{mean(k):.1f}" for k in keys) + " | " + " | ".join(map(logged, extra)) + " |")
EOF
}
