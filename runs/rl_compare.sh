#!/usr/bin/env bash
# Where the credit goes and the field's standard RL, from the main job's SFT (make demo), one seed, about the same
# generated rollout tokens a step (~2.6-3k; each arm's total is in the table):
#   stepgrpo        the recipe: R1-Router's step rewards at the golden prefixes, 3 questions x 8 a step
#   stepgrpo-dapo   the same with DAPO's three: --clip_high 0.28, --dynamic_sampling, --overlong penalty
#   branch          Step-GRPO at the policy's own states: 3 questions, one sampled trajectory each, 8 branches at
#                   --branch_steps 1 of its steps, each continued to the end (--rollout branch)
#   branch-dapo     the same with DAPO's three
#   grpo-dapo       plain outcome GRPO over whole sampled trajectories with DAPO's three, 2 questions x 8
#   sft-cont        the SFT resumed for MORE steps on its own data, dev-picked every EVERY (the more-SFT control)
# each RL arm STEPS steps at lr 5e-6, a checkpoint every 2, picked on the first DEV_N dev questions (<out>/best: the
# mean of F1-Recall and routing accuracy); the picks and the SFT scored routed, greedy, on the first TEST_N test
# questions by one process; paired intervals against the SFT; each RL arm's TFLOP to its pick, generated tokens, seconds
# a step, the refilled fraction and the clip fractions. A comparison, not a claim (one seed, few updates).
#   bash runs/rl_compare.sh    # START=out/demo/sft/final OUT=out/rl-compare STEPS=8 DEV_N=50 TEST_N=200 (make rl-compare)
set -euo pipefail
PY=${PY:-.venv/bin/python} START=${START:-out/demo/sft/final} DATA=${DATA:-data/mini} OUT=${OUT:-out/rl-compare}
STEPS=${STEPS:-8} DEV_N=${DEV_N:-50} TEST_N=${TEST_N:-200} MORE=${MORE:-24} EVERY=${EVERY:-8}
start=$(date +%s)
common="--model $START --data $DATA --topk 1 --train_steps $STEPS --save_every 2 --eval_questions $DEV_N --lr 5e-6"
dapo="--clip_high 0.28 --dynamic_sampling --overlong penalty"
branch="--rollout branch --branch_steps 1 --batch_questions 3 -n 8"
source runs/common.sh
rl_arm stepgrpo --batch_questions 3 -n 8
rl_arm stepgrpo-dapo --batch_questions 3 -n 8 $dapo
rl_arm branch $branch
rl_arm branch-dapo $branch $dapo
rl_arm grpo-dapo --rollout onpolicy --reward outcome --batch_questions 2 -n 8 $dapo
LR=4e-5 DEV_FLAGS="--topk 1" continue_sft $START $OUT/sft-cont --data $DATA/traj-top1 --grad_accum 2  # make demo's SFT, its LR where its cosine ended
RL="stepgrpo stepgrpo-dapo branch branch-dapo grpo-dapo"
score_arms $START $OUT "$RL sft-cont" "$RL"
echo "runs/rl_compare.sh: $(( ($(date +%s) - start) / 60 )) min"
