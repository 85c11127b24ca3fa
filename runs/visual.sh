#!/usr/bin/env bash
# The multimodal half end to end on the mini-world's visual questions (questions/visual_*.jsonl), once with the VL
# policy (Idefics3 around SmolLM2-135M-Instruct, its vision tower random: `python prepare.py --vl`) and once
# with the text policy (SmolLM2-135M-Instruct, which sees captions only), at the main job's budgets:
#   golden trajectories (train + visual_train) -> SFT -> Step-GRPO -> routed on test[:100] + visual_test (200), then
#   the paired difference VL - text on the same questions. `make visual` (~1 h on 2 CPU cores); a finished stage is skipped.
set -euo pipefail
PY=${PY:-.venv/bin/python}
DATA=data/mini
OUT=${OUT:-out/visual}
start=$(date +%s)
$PY prepare.py --vl
for policy in text vl; do
  model=models/SmolLM2-135M-Instruct; [ $policy = vl ] && model=models/Idefics3-SmolLM2-135M
  d=$OUT/$policy
  test -f $d/traj/visual_dev.jsonl || $PY synth.py --model $model --data $DATA --out $d/traj \
    --splits train visual_train visual_dev --limit 400
  test -e $d/sft/final || $PY sft.py --model $model --data $d/traj --train_splits train visual_train \
    --dev_split visual_dev --train_steps 36 --grad_accum 4 --eval_every 0 --save_every 0 --keep 1 --out $d/sft
  test -e $d/stepgrpo/final || $PY stepgrpo.py --model $d/sft/final --data $DATA --split train visual_train \
    --train_steps 3 --batch_questions 8 --eval_questions 0 --save_every 0 --out $d/stepgrpo
  for stage in sft stepgrpo; do
    test -f $d/eval-$stage/results.json || $PY evaluate.py --model $d/$stage/final --name $policy-$stage \
      --methods routed --data $DATA --split test visual_test --n_questions 200 --out $d/eval-$stage
  done
done
$PY evaluate.py --combine $OUT/{text,vl}/eval-{sft,stepgrpo}/results.json --data $DATA --split test visual_test --out $OUT/table
for stage in sft stepgrpo; do
  $PY evaluate.py --paired $OUT/text/eval-$stage/trajectories-routed.jsonl $OUT/vl/eval-$stage/trajectories-routed.jsonl
done
echo "visual: $(( ($(date +%s) - start) / 60 )) min"
