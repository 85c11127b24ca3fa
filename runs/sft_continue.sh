#!/usr/bin/env bash
# SFT-continued, the control beside every Step-GRPO result: the SFT run whose checkpoint is CKPT, resumed in its own
# folder OUT (its optimizer state; the data order goes on to the next golden trajectories) for MORE steps at a
# constant LR (LR, default 2e-5: the recipe's final one). Give the SFT run's own --grad_accum and --seed, or the data
# order does not continue (sft.py warns); its own --data continues its order, a larger set (the recipe's control on
# every training question) goes on at the same step of that set's order. The checkpoint is hard-linked, not copied.
# Resumable.
#   bash runs/sft_continue.sh out/sft/final out/sft-cont 40 --data data/mini/traj --grad_accum 4 --save_every 0
set -euo pipefail
PY=${PY:-.venv/bin/python}
CKPT=$1 OUT=$2 MORE=$3
shift 3
test -e $OUT/final && exit 0
ck=$(basename "$(readlink -f $CKPT)")  # step_N: the folder holds the trainer state sft.py --resume reads
test -f $OUT/latest || { mkdir -p $OUT && cp -al "$(dirname $CKPT)/$ck" $OUT/ && echo $ck > $OUT/latest; }
$PY sft.py --model $CKPT --resume --train_steps $(( ${ck#step_} + MORE )) --lr ${LR:-2e-5} --warmup_steps 0 \
  --min_lr_ratio 1 --out $OUT "$@"
