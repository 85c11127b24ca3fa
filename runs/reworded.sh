#!/usr/bin/env bash
# H5 with a held-out phrasing: does the SFT router decompose a question worded as no training question is? The
# default world plus N new 2-hop questions twice (corpus.py --reworded): worded as every training question
# (test_worded) and with each noun phrase in a second wording (test_reworded), the same chains, steps and answers.
# The main job's SFT (SFT, trained on the default world's golden top-1 trajectories: `make demo`) routed on both,
# the ceilings (oracle KBs, gold steps) on the reworded ones, greedy, then the paired difference reworded - worded.
# Resumable: a stage whose output exists is skipped.
#   bash runs/reworded.sh                # SFT=out/demo/sft/final N=300 DATA=data/mini-rw OUT=out/reworded
set -euo pipefail
PY=${PY:-.venv/bin/python} SFT=${SFT:-out/demo/sft/final} DATA=${DATA:-data/mini-rw} OUT=${OUT:-out/reworded} N=${N:-300}
test -f $DATA/world.json || $PY corpus.py --world mini --out $DATA --reworded $N
test -f $DATA/index/meta.json || $PY retrievers.py build --data $DATA
for run in test_worded:routed test_reworded:"routed oracle gold_steps"; do
  split=${run%%:*}
  test -f $OUT/$split/results.json || $PY evaluate.py --model $SFT --name sft --data $DATA --split $split \
    --n_questions $N --topk 1 --methods ${run#*:} --out $OUT/$split
done
$PY evaluate.py --paired $OUT/test_worded/trajectories-routed.jsonl $OUT/test_reworded/trajectories-routed.jsonl \
  | tee $OUT/paired.txt
