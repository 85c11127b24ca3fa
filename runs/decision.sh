#!/usr/bin/env bash
# Does the SFT router read the question? The golden routing <think> that names the KB before the sub-question is
# written (kb_first) against one that names none, so the KB is chosen at <ret> right after the
# sub-question (kb_last), same budgets:
#   1. golden trajectories of the same 400 train questions each way (kb_last, the default, is data/mini/traj);
#   2. SFT of SmolLM2-135M-Instruct on each at the main job's budgets (36 steps x 4), SFT seeds 0 and 1;
#   3. each scored routed, greedy, on the first 200 dev questions (choices are made on dev): balanced routing accuracy,
#      that of the first decision, I(gold; chosen)/H(gold) at the first decision, F1-Recall; paired kb_last - kb_first.
# Run from the repo root after `make setup data/mini/traj/train.jsonl`, or as `make decision` (~1 h on 2 cores).
# A finished stage is skipped.
set -euo pipefail
PY=${PY:-.venv/bin/python}
DATA=data/mini
OUT=out/decision
SEEDS=${SEEDS:-0 1}
N=${N:-200}
start=$(date +%s)
test -f $DATA/traj_kbfirst/train.jsonl || $PY synth.py --data $DATA --out $DATA/traj_kbfirst --limit 400 --gold_think kb_first
for seed in $SEEDS; do
  for think in kb_first kb_last; do
    traj=$([ $think = kb_first ] && echo traj_kbfirst || echo traj)
    test -e $OUT/s$seed/sft-$think/final || $PY sft.py --data $DATA/$traj --train_steps 36 --grad_accum 4 \
      --eval_every 0 --save_every 0 --keep 1 --seed $seed --out $OUT/s$seed/sft-$think
    test -f $OUT/s$seed/dev-$think/results.json || $PY evaluate.py --model $OUT/s$seed/sft-$think/final \
      --name $think@s$seed --methods routed --gold_think $think --data $DATA --split dev --n_questions $N \
      --out $OUT/s$seed/dev-$think
  done
  $PY evaluate.py --paired $OUT/s$seed/dev-kb_first/trajectories-routed.jsonl $OUT/s$seed/dev-kb_last/trajectories-routed.jsonl
done
$PY evaluate.py --combine $(for seed in $SEEDS; do echo $OUT/s$seed/dev-kb_{first,last}/results.json; done) --data $DATA \
  --split dev --out $OUT/table
echo "decision: $(( ($(date +%s) - start) / 60 )) min"
