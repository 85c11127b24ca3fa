#!/usr/bin/env bash
# A router with and without Agentic RAG-R1's actions (backtrack, summary), the main job's budgets, one seed:
#   1. golden trajectories of the main job's 400 train questions with actions (synth.py --actions --topk 1: a quarter
#      of them take a wrong KB first and backtrack, three-hop questions summarise before the third hop);
#   2. SFT on them with the main job's recipe (96 steps x 2, lr 4e-4); the arm without actions is the main job's SFT;
#   3. both scored routed, greedy, on the first DEV_N dev questions, each in its own format, by one process each;
#      the paired interval of actions - plain. A comparison on dev, not a claim (one seed, one SFT budget).
#   bash runs/actions.sh   # START=out/demo/sft/final OUT=out/actions DEV_N=200 (make actions, after make demo)
set -euo pipefail
PY=${PY:-.venv/bin/python} START=${START:-out/demo/sft/final} DATA=${DATA:-data/mini} OUT=${OUT:-out/actions}
DEV_N=${DEV_N:-200}
start=$(date +%s)
test -f $DATA/traj-act/train.jsonl || $PY synth.py --data $DATA --out $DATA/traj-act --limit 400 --topk 1 --actions
test -e $OUT/sft/final || $PY sft.py --data $DATA/traj-act --train_steps 96 --grad_accum 2 --lr 4e-4 --eval_every 0 \
  --save_every 0 --keep 1 --out $OUT/sft
eval="--methods routed --data $DATA --split dev --n_questions $DEV_N --topk 1"
test -f $OUT/eval-plain/results.json || $PY evaluate.py --model $START --name plain $eval --out $OUT/eval-plain
test -f $OUT/eval-actions/results.json || $PY evaluate.py --model $OUT/sft/final --name actions $eval --actions \
  --out $OUT/eval-actions
$PY evaluate.py --paired $OUT/eval-plain/trajectories-routed.jsonl $OUT/eval-actions/trajectories-routed.jsonl
$PY evaluate.py --combine $OUT/eval-plain/results.json $OUT/eval-actions/results.json --data $DATA --split dev \
  --out $OUT/table
echo "runs/actions.sh: $(( ($(date +%s) - start) / 60 )) min"
