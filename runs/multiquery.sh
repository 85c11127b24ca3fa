#!/usr/bin/env bash
# Single-query steps (R1-Router's format, --max_pairs 1) against multi-query steps (--max_pairs 2: RAG-R1's parallel
# queries; the mini-world's comparison questions become one step of two sub-questions), same budgets:
#   1. golden trajectories of the same 400 train questions, each way (synth.py; --max_pairs 1 is data/mini/traj);
#   2. SFT of SmolLM2-135M-Instruct on each, the main job's recipe and budgets (36 steps x 4);
#   3. each scored routed, greedy, on the whole test split (500 questions) with its own --max_pairs, twice (the second
#      run for the spread of the wall clock), then the paired bootstrap of multi - single, per question type.
# Run from the repo root after `make setup data/mini/traj/train.jsonl`, or as `make multiquery`. A finished stage is skipped.
set -euo pipefail
PY=${PY:-.venv/bin/python}
DATA=data/mini
OUT=out/multiquery
start=$(date +%s)
test -f $DATA/traj_k2/train.jsonl || $PY synth.py --data $DATA --out $DATA/traj_k2 --limit 400 --max_pairs 2
for k in 1 2; do
  traj=$([ $k = 1 ] && echo traj || echo traj_k2)
  test -e $OUT/sft-k$k/final || $PY sft.py --data $DATA/$traj --train_steps 36 --grad_accum 4 --eval_every 0 \
    --save_every 0 --keep 1 --out $OUT/sft-k$k
done
for run in 1 2; do
  for k in 1 2; do
    test -f $OUT/eval$run-k$k/results.json || $PY evaluate.py --model $OUT/sft-k$k/final --name k$k-run$run \
      --methods routed --max_pairs $k --data $DATA --split test --out $OUT/eval$run-k$k
  done
done
$PY evaluate.py --combine $OUT/eval{1,2}-k1/results.json $OUT/eval{1,2}-k2/results.json --data $DATA --split test \
  --out $OUT/table
$PY evaluate.py --paired $OUT/eval1-k1/trajectories-routed.jsonl $OUT/eval1-k2/trajectories-routed.jsonl
echo "multiquery: $(( ($(date +%s) - start) / 60 )) min"
