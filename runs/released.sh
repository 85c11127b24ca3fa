#!/usr/bin/env bash
# R1-Router's released choices against this repo's recipe on golden trajectories, from one SFT checkpoint (SFT 36
# steps x 4 on data/mini/traj; docs/released.md; ~1.5 h on 2 CPU cores):
#   1. the released reward and loss (--teacher_spans all --no-balance_kb --w_format 0 --entropy_coef 1e-3
#      --old_logprobs trainer --route_credit whole --adv_std) against the recipe: Step-GRPO from that SFT checkpoint,
#      same questions, seed and budget;
#   2. the released evaluation protocol (evaluate.py --protocol released) against greedy strict, on the recipe's checkpoint;
#   3. the released step structure (a single-turn chat a step) against the transcript: synth -> SFT at the same
#      compute (as many tokens a step: 7 one-chat rows against 4 transcripts) -> rollout throughput of each structure
#      with its own SFT checkpoint (on real tables too, when `make real` built data/real) -> Step-GRPO at the same budget.
# Every score is routed on the whole test split (500 questions), and each comparison a paired bootstrap interval.
# Run as `make released` (it builds data/mini/traj first). Resumable: a finished stage is skipped.
set -euo pipefail
PY=${PY:-.venv/bin/python}
DATA=data/mini
OUT=out/released
GRPO="--train_steps 3 --batch_questions 8 --eval_questions 0 --save_every 0"
RELEASED="--teacher_spans all --no-balance_kb --w_format 0 --entropy_coef 1e-3 --old_logprobs trainer --route_credit whole --adv_std"
EVAL="--methods routed --data $DATA --split test"
start=$(date +%s)
score() {  # score MODEL NAME OUT [flags]: routed on the whole test split, once
  test -f $3/results.json || $PY evaluate.py --model $1 --name $2 $EVAL --out $3 "${@:4}"
}
bench() {  # bench MODEL STRUCTURE OUT [flags]: the routed loop's tokens and throughput against raw vLLM
  test -f $3 || $PY -m bench.rollout --model $1 --structure $2 --n_questions 32 -n 4 "${@:4}" > $3
  grep "^$2:" $3
}
test -f $OUT/sft/final/config.json || $PY sft.py --data $DATA/traj --train_steps 36 --grad_accum 4 --eval_every 0 \
  --save_every 0 --keep 1 --out $OUT/sft

# 1. the released reward and loss setting
test -f $OUT/recipe/final/config.json || $PY stepgrpo.py --model $OUT/sft/final --data $DATA $GRPO --out $OUT/recipe
test -f $OUT/setting/final/config.json || $PY stepgrpo.py --model $OUT/sft/final --data $DATA $GRPO $RELEASED --out $OUT/setting
score $OUT/recipe/final recipe $OUT/eval-recipe
score $OUT/setting/final released-setting $OUT/eval-setting
$PY evaluate.py --paired $OUT/eval-recipe/trajectories-routed.jsonl $OUT/eval-setting/trajectories-routed.jsonl

# 2. the released evaluation protocol (sampled, with retries) on the recipe's checkpoint
score $OUT/recipe/final recipe+released-protocol $OUT/eval-protocol --protocol released
$PY evaluate.py --paired $OUT/eval-recipe/trajectories-routed.jsonl $OUT/eval-protocol/trajectories-routed.jsonl

# 3. the released step structure: SFT, throughput, Step-GRPO, scores
S=$OUT/structure
test -f $DATA/traj-released/train.jsonl || $PY synth.py --data $DATA --out $DATA/traj-released --limit 400 --structure released
test -f $S/sft/final/config.json || $PY sft.py --data $DATA/traj-released --train_steps 36 --grad_accum 7 \
  --eval_every 0 --save_every 0 --keep 1 --out $S/sft
bench $OUT/sft/final transcript $OUT/bench-transcript.txt --data $DATA
bench $S/sft/final released $OUT/bench-released.txt --data $DATA
if test -f data/real/index/meta.json; then  # real tables: where the growing transcript overflows the context
  bench $OUT/sft/final transcript $OUT/bench-wtq-transcript.txt --data data/real --split wtq
  bench $S/sft/final released $OUT/bench-wtq-released.txt --data data/real --split wtq
fi
test -f $S/grpo/final/config.json || $PY stepgrpo.py --model $S/sft/final --data $DATA $GRPO --out $S/grpo
score $S/grpo/final recipe-released-structure $S/eval-grpo --structure released
$PY evaluate.py --paired $OUT/eval-recipe/trajectories-routed.jsonl $S/eval-grpo/trajectories-routed.jsonl
score $OUT/sft/final sft $OUT/eval-sft
score $S/sft/final sft-released-structure $S/eval-sft --structure released
$PY evaluate.py --paired $OUT/eval-sft/trajectories-routed.jsonl $S/eval-sft/trajectories-routed.jsonl

$PY evaluate.py --combine $OUT/eval-sft/results.json $OUT/eval-recipe/results.json $OUT/eval-setting/results.json \
  $OUT/eval-protocol/results.json $S/eval-sft/results.json $S/eval-grpo/results.json --data $DATA --split test --out $OUT/table
echo "released: $(( ($(date +%s) - start) / 60 )) min"
