#!/usr/bin/env bash
# Screening Step-GRPO variants on dev against the SFT-continued control, from one SFT checkpoint (START):
#   sft-cont   the SFT run of START resumed in its own folder (its optimizer state, the data order going on to the
#              next golden trajectories) for 36 more steps x 4 at a constant lr 2e-5, the first stage's final lr:
#              about the wall clock of one Step-GRPO arm
#   split      stepgrpo.py's defaults at the screening budget (6 steps x 8 questions x 8 samples): the route
#              decision's credit on its own tokens (--route_credit split), no std division (--no-adv_std, Dr. GRPO)
#   whole      the same with R1-Router's one advantage on the whole step, std-divided (--route_credit whole --adv_std)
# Every arm is scored routed, greedy, on the first N dev questions; a Step-GRPO arm's checkpoint is the one its dev
# score picked (<out>/best, the mean of F1-Recall and routing accuracy), SFT-continued's its final one: a screen that
# leans toward Step-GRPO (the scores of its picks are on the questions that picked them).
# Run from the repo root: START=out/decision/s0/sft-kb_last/final THINK=kb_last bash runs/screen.sh (~40 min here).
# A finished stage is skipped; an interrupted Step-GRPO arm continues from its last checkpoint.
set -euo pipefail
PY=${PY:-.venv/bin/python}
DATA=data/mini
START=${START:?START=<an SFT checkpoint>}
THINK=${THINK:-kb_last}
TRAJ=${TRAJ:-$DATA/traj}
OUT=${OUT:-out/screen}
N=${N:-100}
start=$(date +%s)
PY=$PY bash runs/sft_continue.sh $START $OUT/sft-cont 36 --data $TRAJ --grad_accum 4 --eval_every 0 --save_every 0 \
  --keep 1
grpo=(--model $START --data $DATA --gold_think $THINK --train_steps 6 --batch_questions 8 --save_every 3 --keep 2
      --eval_questions $N)
test -e $OUT/split/final || $PY stepgrpo.py "${grpo[@]}" --out $OUT/split --resume auto
test -e $OUT/whole/final || $PY stepgrpo.py "${grpo[@]}" --route_credit whole --adv_std --out $OUT/whole \
  --resume auto
for arm in sft-cont split whole; do
  ckpt=$OUT/$arm/$([ $arm = sft-cont ] && echo final || echo best)
  test -f $OUT/dev-$arm/results.json || $PY evaluate.py --model $ckpt --name $arm --methods routed --gold_think $THINK \
    --data $DATA --split dev --n_questions $N --out $OUT/dev-$arm
done
echo "screen: $(( ($(date +%s) - start) / 60 )) min"
