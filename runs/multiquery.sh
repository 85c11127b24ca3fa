#!/usr/bin/env bash
# Single-query steps (R1-Router's format, --max_pairs 1) against multi-query steps (--max_pairs 2: RAG-R1's parallel
# queries; the mini-world's comparison questions become one step of two sub-questions), same budgets:
#   1. golden trajectories of the same 400 train questions, each way (synth.py; --max_pairs 1 is data/mini/traj);
#   2. SFT of SmolLM2-135M-Instruct on each, the main job's recipe and budgets (36 steps x 4), SFT seeds 0 and 1;
#   3. each scored routed, greedy, on the whole test split (500 questions) with its own --max_pairs, alone on the
#      machine (the wall clock is a result), then the paired bootstrap of multi - single per seed and question type.
# Run from the repo root after `make setup data/mini/traj/train.jsonl`, or as `make multiquery` (~1.7 h on 2 cores).
# A finished stage is skipped.
set -euo pipefail
PY=${PY:-.venv/bin/python}
DATA=data/mini
OUT=out/multiquery
SEEDS=${SEEDS:-0 1}
start=$(date +%s)
test -f $DATA/traj_k2/train.jsonl || $PY synth.py --data $DATA --out $DATA/traj_k2 --limit 400 --max_pairs 2
for seed in $SEEDS; do
  for k in 1 2; do
    traj=$([ $k = 1 ] && echo traj || echo traj_k2)
    test -e $OUT/s$seed/sft-k$k/final || $PY sft.py --data $DATA/$traj --train_steps 36 --grad_accum 4 --eval_every 0 \
      --save_every 0 --keep 1 --seed $seed --out $OUT/s$seed/sft-k$k
  done
  for k in 1 2; do
    test -f $OUT/s$seed/eval-k$k/results.json || $PY evaluate.py --model $OUT/s$seed/sft-k$k/final --name k$k@s$seed \
      --methods routed --max_pairs $k --data $DATA --split test --out $OUT/s$seed/eval-k$k
  done
done
for seed in $SEEDS; do
  $PY evaluate.py --paired $OUT/s$seed/eval-k1/trajectories-routed.jsonl $OUT/s$seed/eval-k2/trajectories-routed.jsonl
done
$PY evaluate.py --combine $(for seed in $SEEDS; do echo $OUT/s$seed/eval-k{1,2}/results.json; done) --data $DATA \
  --split test --out $OUT/table
echo "multiquery: $(( ($(date +%s) - start) / 60 )) min"
