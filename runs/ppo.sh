#!/usr/bin/env bash
# The siblings' RL beside Step-GRPO, from the main job's SFT (make demo), one seed, about the same generated rollout
# tokens a step (~2.6k: a teacher-prefix question's 8 route completions ~870 tokens, an on-policy trajectory ~170):
#   stepgrpo   the recipe: R1-Router's step rewards at the golden prefixes, 3 questions x 8 a step
#   grpo       plain outcome GRPO over whole sampled trajectories (Search-R1, ReSearch), 2 questions x 8
#   ppo        PPO with a critic, GAE, the outcome reward alone (Search-R1's, RAG-R1's RL), 16 questions x 1
#   step-ppo   the same with each step's reward on its last token (Step-PPO), 16 questions x 1
# each STEPS steps at lr 5e-6 (the critic 10x, as Search-R1's ratio), a checkpoint every 2, picked on the first DEV_N
# dev questions (<out>/best: the mean of F1-Recall and routing accuracy); the picks and the SFT scored routed, greedy,
# on the first TEST_N test questions by one process; paired intervals against the SFT; each arm's TFLOP to its pick,
# its generated tokens and each phase's seconds a step. A comparison, not a claim (one seed, few updates).
#   bash runs/ppo.sh                       # START=out/demo/sft/final OUT=out/ppo STEPS=8 DEV_N=50 TEST_N=200 (make ppo)
set -euo pipefail
PY=${PY:-.venv/bin/python} START=${START:-out/demo/sft/final} DATA=${DATA:-data/mini} OUT=${OUT:-out/ppo}
STEPS=${STEPS:-8} DEV_N=${DEV_N:-50} TEST_N=${TEST_N:-200}
start=$(date +%s)
common="--model $START --data $DATA --topk 1 --train_steps $STEPS --save_every 2 --eval_questions $DEV_N --lr 5e-6"
ppo="--rollout onpolicy --adv_estimator gae --batch_questions 16 -n 1 --critic_lr 5e-5"
arm() {  # NAME FLAGS...: one Step-GRPO run, resumable
  local name=$1
  shift
  test -e $OUT/$name/final || $PY stepgrpo.py $common "$@" --out $OUT/$name --resume auto
}
arm stepgrpo --batch_questions 3 -n 8
arm grpo --rollout onpolicy --reward outcome --batch_questions 2 -n 8
arm ppo $ppo --reward outcome
arm step-ppo $ppo --reward step
ARMS="stepgrpo grpo ppo step-ppo"
models=() outs=() names=()  # the SFT and the picks not scored yet, in one process: one engine, each swapped in
for a in sft $ARMS; do
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
$PY -m bench.flops --runs $(printf "$OUT/%s " $ARMS)
$PY - $OUT $ARMS <<'EOF'
import json, sys
from pathlib import Path
out, arms = Path(sys.argv[1]), sys.argv[2:]
keys = ("rollout_s", "update_s", "critic_s", "sync_s", "dev_s")
print("| arm | generated tokens | pick (dev score) | " + " | ".join(f"{k} a step" for k in keys) + " |")
print("|---|---|---|" + "---|" * len(keys))
for a in arms:
    recs = [json.loads(l) for l in open(out / a / "log.jsonl") if "loss" in json.loads(l)]
    dev = {json.loads(l)["step"]: json.loads(l)["dev_score"] for l in open(out / a / "log.jsonl") if "dev_score" in json.loads(l)}
    best = max((s for s in dev if s), key=lambda s: (dev[s], -s))
    mean = lambda k: sum(r.get(k) or 0.0 for r in recs) / len(recs)
    print(f"| {a} | {sum(r['rollout_generated'] * r['world'] for r in recs):.0f} | step {best} ({dev[best]:.1f}; start "
          f"{dev[0]:.1f}) | " + " | ".join(f"{mean(k):.1f}" for k in keys) + " |")
EOF
echo "runs/ppo.sh: $(( ($(date +%s) - start) / 60 )) min"
