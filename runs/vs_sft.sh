#!/usr/bin/env bash
# The recipe against SFT and against SFT-continued, one training seed at a time (README "Results"):
#   SFT (sft.py defaults) -> from its final checkpoint, two arms of about the same wall clock:
#     Step-GRPO      stepgrpo.py defaults (its dev curve is logged; the arm is scored at its final checkpoint)
#     SFT-continued  the SFT run resumed in its own folder (optimizer state, the data order going on) for CONT_STEPS
#                    more steps at the first stage's final LR (2e-5)
#   -> the three scored routed on the whole test split (500 questions), each at its final checkpoint (one criterion
#   for every arm) -> paired bootstrap of Step-GRPO - SFT and Step-GRPO - SFT-continued.
# Run from the repo root after `make setup data/mini/traj/train.jsonl`, or as `make vs-sft SEEDS="1 2 3"`.
# Resumable: a finished stage is skipped, an interrupted training stage continues from its last checkpoint.
set -euo pipefail
PY=${PY:-.venv/bin/python}
SEEDS=${SEEDS:-"1 2 3"}
CONT_STEPS=${CONT_STEPS:-96}
DATA=data/mini
OUT=out/vs-sft
start=$(date +%s)
resume() { test -f "$1/latest" && echo --resume || true; }
for s in $SEEDS; do
  d=$OUT/s$s
  test -e $d/sft/final || $PY sft.py --data $DATA/traj --seed $s --out $d/sft $(resume $d/sft)
  PY=$PY bash runs/sft_continue.sh $d/sft/final $d/sft-cont $CONT_STEPS --data $DATA/traj --seed $s
  test -e $d/grpo/final || $PY stepgrpo.py --data $DATA --model $d/sft/final --seed $s --out $d/grpo $(resume $d/grpo)
  for arm in sft sft-cont grpo; do
    test -f $d/eval-$arm/results.json || $PY evaluate.py --model $d/$arm/final --name $arm@s$s --methods routed \
      --data $DATA --split test --out $d/eval-$arm
  done
  $PY evaluate.py --paired $d/eval-sft/trajectories-routed.jsonl $d/eval-grpo/trajectories-routed.jsonl
  $PY evaluate.py --paired $d/eval-sft-cont/trajectories-routed.jsonl $d/eval-grpo/trajectories-routed.jsonl
done
tables=()
for s in $SEEDS; do tables+=($OUT/s$s/eval-{sft,sft-cont,grpo}/results.json); done
$PY evaluate.py --combine "${tables[@]}" --data $DATA --split test --out $OUT/table
echo "vs-sft: $(( ($(date +%s) - start) / 60 )) min"
