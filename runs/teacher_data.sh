#!/usr/bin/env bash
# The teacher condition's data (README "Results"; docs/results.md), R1-Router's procedure at this scale, for
# runs/teacher.sh (`make teacher`):
#   the teacher   the prompt-only policy after SFT on the golden trajectories of the first 48 training questions
#                 (36 steps x 4; imperfect the way a sampled LLM teacher is)   -> OUT/teacher/final
#   its data      one trajectory a question (R1-Router: temperature 1, top-k 20, a step that does not parse tried
#                 twice) on the next N training questions, real retrieval, kept when the final answer's token recall
#                 is 1 (R1-Router's data_filter.py; the steps are never checked)   -> DATA/traj-teacher, with its
#                 filter counts and the kept steps' mistakes against the world's gold in train.errors.json
# Resumable: a finished stage is skipped.
#   bash runs/teacher_data.sh data/mini out/teacher [N=1000]
set -euo pipefail
PY=${PY:-.venv/bin/python}
DATA=$1 OUT=$2 N=${3:-1000}
test -f $DATA/traj-seed48/train.jsonl || $PY synth.py --data $DATA --out $DATA/traj-seed48 --splits train --limit 48
test -e $OUT/teacher/final || $PY sft.py --data $DATA/traj-seed48 --train_steps 36 --grad_accum 4 --eval_every 0 \
  --save_every 0 --keep 1 --out $OUT/teacher
test -f $DATA/traj-teacher/train.jsonl || $PY synth.py --data $DATA --out $DATA/traj-teacher \
  --teacher $OUT/teacher/final -n 1 --splits train --offset 48 --limit $N
