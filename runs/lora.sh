#!/usr/bin/env bash
# Full fine-tuning against LoRA (r 16, alpha 32, all linear layers) and QLoRA (nf4 base) on SmolLM2-135M, CPU:
#   1. speed, one run each: SFT 8 steps of the recipe's global batch (8 rows) from the pretrained model;
#      Step-GRPO 2 steps of the recipe (16 questions x 8) from the main job's SFT checkpoint (make demo);
#   2. quality at equal wall-clock time: the full fine-tuning run continues to 4 steps, the LoRA run (lr 5e-5, 10x the
#      recipe's) to as many steps as take the same time at the speed measured in 1; both scored routed on the whole
#      test split (500 questions), then the paired bootstrap of LoRA - full.
# Run from the repo root after `make demo` (its SFT checkpoint), or as `make lora`. A finished stage is skipped; training resumes.
set -euo pipefail
PY=${PY:-.venv/bin/python}
DATA=data/mini
START=${START:-out/demo/sft/final}
OUT=out/lora
LORA="--lora_r 16"  # alpha 2r: sft.py's default 32, stepgrpo.py's rule
start=$(date +%s)
for arm in full lora qlora; do
  flags=$([ $arm = full ] && echo "" || echo "$LORA")$([ $arm = qlora ] && echo " --quant nf4" || echo "")
  test -e $OUT/sft-$arm/final || $PY sft.py --data $DATA/traj --train_steps 8 --eval_every 0 --save_every 0 \
    --out $OUT/sft-$arm $flags
done
test -e $OUT/grpo-full/step_2 || $PY stepgrpo.py --data $DATA --model $START --train_steps 2 --save_every 2 \
  --eval_questions 0 --out $OUT/grpo-full --resume auto
test -e $OUT/grpo-lora/step_2 || $PY stepgrpo.py --data $DATA --model $START --train_steps 2 --save_every 2 \
  --eval_questions 0 --out $OUT/grpo-lora $LORA --lr 5e-5 --resume auto
# equal wall-clock time: the LoRA run's steps = 4 x (full step time / LoRA step time), from the first two steps
steps=$($PY -c "
import json
t = lambda d: sum(r['rollout_s'] + r['update_s'] + r['sync_s'] for r in map(json.loads, open(d + '/log.jsonl'))) / 2
print(round(4 * t('$OUT/grpo-full') / t('$OUT/grpo-lora')))")
echo "LoRA Step-GRPO steps in the time of 4 full fine-tuning steps: $steps"
test -e $OUT/grpo-full/step_4 || $PY stepgrpo.py --data $DATA --model $START --train_steps 4 --save_every 2 \
  --eval_questions 0 --out $OUT/grpo-full --resume
test -e $OUT/grpo-lora/step_$steps || $PY stepgrpo.py --data $DATA --model $START --train_steps $steps --save_every 2 \
  --eval_questions 0 --out $OUT/grpo-lora $LORA --lr 5e-5 --resume
for arm in full lora; do
  test -f $OUT/eval-$arm/results.json || $PY evaluate.py --model $OUT/grpo-$arm/final --name stepgrpo-$arm \
    --methods routed --data $DATA --split test --out $OUT/eval-$arm
done
$PY evaluate.py --combine $OUT/eval-full/results.json $OUT/eval-lora/results.json --data $DATA --split test --out $OUT/table
$PY evaluate.py --paired $OUT/eval-full/trajectories-routed.jsonl $OUT/eval-lora/trajectories-routed.jsonl
echo "lora: $(( ($(date +%s) - start) / 60 )) min"
