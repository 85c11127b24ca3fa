#!/usr/bin/env bash
# H5, a composition held out of training, first stage: is the shift winnable? The world with PAIRS 2-hop relation
# pairs composed in no train or dev chain (corpus.py --holdout_pairs; each relation still in other training pairs)
# and N test questions of them (questions/test_heldout.jsonl); golden trajectories of 400 training questions with one
# passage a search; SFT at the main job's budget; then, from that SFT, the routed policy beside its two ceilings (gold
# KBs: oracle; gold steps, the model writing the final answer only: gold_steps), greedy, on the held-out questions
# and on DEV_N in-distribution dev questions. Resumable: a stage whose output exists is skipped.
#   bash runs/heldout.sh                 # PAIRS=4 N=300 DEV_N=100 DATA=data/mini-pairs OUT=out/heldout (make heldout)
set -euo pipefail
PY=${PY:-.venv/bin/python} MODEL=${MODEL:-models/SmolLM2-135M-Instruct} DATA=${DATA:-data/mini-pairs} OUT=${OUT:-out/heldout}
PAIRS=${PAIRS:-4} N=${N:-300} DEV_N=${DEV_N:-100}
test -f $DATA/world.json || $PY corpus.py --world mini --out $DATA --holdout_pairs $PAIRS --n_test_heldout $N
test -f $DATA/index/meta.json || $PY retrievers.py build --data $DATA
test -f $DATA/traj-top1/train.jsonl || $PY synth.py --data $DATA --out $DATA/traj-top1 --limit 400 --topk 1
if ! test -f $OUT/sft/final/config.json; then
  rm -rf $OUT/sft  # interrupted: sft.py refuses a folder that holds a run
  $PY sft.py --model $MODEL --data $DATA/traj-top1 --train_steps 96 --grad_accum 2 --lr 4e-4 \
    --eval_every 0 --save_every 0 --keep 1 --out $OUT/sft
fi
for split in test_heldout:$N dev:$DEV_N; do
  test -f $OUT/eval/sft-${split%:*}/results.json || $PY evaluate.py --model $OUT/sft/final --name sft --data $DATA \
    --split ${split%:*} --n_questions ${split#*:} --topk 1 --methods routed oracle gold_steps --out $OUT/eval/sft-${split%:*}
done
