#!/usr/bin/env bash
# Real data (docs/realdata.md): prompt-only SmolLM2, the main job's SFT and Step-GRPO checkpoints (trained on the
# mini-world only), and both continued on the real MuSiQue training split (golden trajectories from its
# decompositions); scored on held-out MuSiQue, HotpotQA and WikiTableQuestions, one table per split.
# Run from the repo root after `make demo` and `make real REAL_SRC=...`, or as `make real-eval`. Resumable.
set -euo pipefail
PY=${PY:-.venv/bin/python}
REAL=data/real
DEMO=out/demo
OUT=out/real
N=${REAL_N:-50}
start=$(date +%s)
test -f $REAL/traj/musique_train.jsonl || $PY synth.py --data $REAL --out $REAL/traj --splits musique_train
test -e $OUT/sft/final || $PY sft.py --model $DEMO/sft/final --data $REAL/traj --train_splits musique_train \
  --train_steps 6 --lr 1e-4 --warmup_steps 1 --eval_every 0 --save_every 0 --keep 1 --out $OUT/sft
test -e $OUT/stepgrpo/final || $PY stepgrpo.py --model $OUT/sft/final --data $REAL --split musique_train \
  --train_steps 2 --batch_questions 4 --eval_questions 0 --save_every 0 --out $OUT/stepgrpo
for split in musique hotpotqa wtq; do
  e=$OUT/eval-$split
  test -f $e/prompt-only/results.json || $PY evaluate.py --model models/SmolLM2-135M-Instruct --name prompt-only \
    --methods no_retrieval single_rag --data $REAL --split $split --n_questions $N --out $e/prompt-only
  for m in sft:$DEMO/sft step-grpo:$DEMO/stepgrpo real-sft:$OUT/sft real-step-grpo:$OUT/stepgrpo; do
    name=${m%%:*}
    test -f $e/$name/results.json || $PY evaluate.py --model ${m#*:}/final --name $name --methods routed \
      --data $REAL --split $split --n_questions $N --max_active 32 --out $e/$name
  done
  $PY evaluate.py --combine $e/*/results.json --data $REAL --split $split --out $OUT/table-$split
done
echo "real-eval: $(( ($(date +%s) - start) / 60 )) min"
