# Sourced by runs/teacher.sh, runs/vs_sft.sh and runs/h5.sh: the dev evaluation, the dev pick and the SFT-continued
# control. They read PY, DATA (the world), DEV_N (dev questions scored), DEV_FLAGS (more evaluate.py flags, e.g. the
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
