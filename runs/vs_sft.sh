#!/usr/bin/env bash
# The recipe against SFT, one training seed at a time (README "Results"; ~2.3 h a seed on 2 CPU cores):
#   SFT (sft.py defaults) -> Step-GRPO (stepgrpo.py defaults, checkpoint picked on 100 dev questions: <run>/best)
#   -> both scored routed on the whole test split (500 questions) -> paired bootstrap of the difference.
# Run from the repo root after `make setup data/mini/traj/train.jsonl`, or as `make vs-sft SEEDS="1 2 3"`.
# Resumable: a finished stage is skipped, an interrupted training stage continues from its last checkpoint.
set -euo pipefail
PY=${PY:-.venv/bin/python}
SEEDS=${SEEDS:-"1 2 3"}
DATA=data/mini
OUT=out/vs-sft
start=$(date +%s)
for s in $SEEDS; do
  d=$OUT/s$s
  resume() { test -f "$1/latest" && echo --resume || true; }
  test -e $d/sft/final || $PY sft.py --data $DATA/traj --seed $s --out $d/sft $(resume $d/sft)
  test -e $d/grpo/final || $PY stepgrpo.py --data $DATA --model $d/sft/final --seed $s --out $d/grpo $(resume $d/grpo)
  test -f $d/eval-sft/results.json || $PY evaluate.py --model $d/sft/final --name sft@s$s --methods routed \
    --data $DATA --split test --out $d/eval-sft
  test -f $d/eval-grpo/results.json || $PY evaluate.py --model $d/grpo/best --name step-grpo@s$s --methods routed \
    --data $DATA --split test --out $d/eval-grpo
  $PY evaluate.py --paired $d/eval-sft/trajectories-routed.jsonl $d/eval-grpo/trajectories-routed.jsonl
done
tables=()
for s in $SEEDS; do tables+=($OUT/s$s/eval-sft/results.json $OUT/s$s/eval-grpo/results.json); done
$PY evaluate.py --combine "${tables[@]}" --data $DATA --split test --out $OUT/table
echo "vs-sft: $(( ($(date +%s) - start) / 60 )) min"
