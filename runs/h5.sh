#!/usr/bin/env bash
# H5, a held-out phrasing (docs/LOG.md): does RL decompose a question worded as no training question is better than
# more SFT does? The world of runs/reworded.sh (the default world plus 300 new 2-hop questions, test_worded as in
# training and test_reworded in a second wording). From one SFT (the main job's recipe: the golden top-1 trajectories
# of 400 training questions, 96 x 2 at 4e-4), per seed, three arms (each run's FLOPs: bench_flops.py --runs):
#   sft-cont       the SFT run resumed on the same trajectories at 4e-5 (where its cosine ended), MORE steps: 110,
#                  the FLOPs of the costlier RL run (on-policy's 6 steps, rollouts included: ~82 TFLOP)
#   grpo-teacher   Step-GRPO at those trajectories' golden prefixes, every step kind, R1-Router's step rewards
#   grpo-onpolicy  on-policy Step-GRPO over the same 400 questions (--pool), label step rewards, the outcome on the
#                  final answer alone (--outcome_on final)
#   both RL arms 6 steps x 4 questions x 8 samples at 5e-6 (the dev screen's pick over 2e-5, docs/LOG.md)
# each checkpoint picked on the first DEV_N in-distribution dev questions (the mean of F1-Recall and routing accuracy,
# greedy; the start is not a candidate) -> routed, greedy, --topk 1 on every question of SPLITS, the SFT with the
# ceilings -> each RL arm against sft-cont and sft, paired, over the seeds (two levels) -> the table and each run's
# compute. Resumable: a finished stage is skipped, an interrupted training stage continues from its last checkpoint.
#   bash runs/h5.sh                          # or: make h5 H5_SEEDS="0 1 2"
#   DEV_ONLY=1 bash runs/h5.sh               # a dev screen: every arm trained and dev-picked, no test row
#   EXTRA="--lr 2e-5" TAG=-lr2e-5 bash runs/h5.sh  # a variant of every Step-GRPO arm: stepgrpo.py flags after the
#                                            # arm's own (the later one wins), its folders grpo-<arm>-lr2e-5
set -euo pipefail
PY=${PY:-.venv/bin/python}
SEEDS=${SEEDS:-"0 1 2"} SPLITS=${SPLITS:-"test_reworded test_worded"} ARMS=${ARMS:-"teacher onpolicy"}
DATA=${DATA:-data/mini-rw} OUT=${OUT:-out/h5} N=${N:-300}
DEV_N=${DEV_N:-100} DEV_FLAGS="--topk 1" MORE=${MORE:-110} EVERY=${EVERY:-32}
GRPO="--topk 1 --batch_questions 4 --lr 5e-6 --train_steps 6 --save_every 3 --keep 2 --eval_questions $DEV_N"
EXTRA=${EXTRA:-} TAG=${TAG:-}
test -z "$EXTRA" || test -n "$TAG" || { echo "error: EXTRA=\"$EXTRA\" needs TAG, its arms' folder suffix"; exit 2; }
TRAJ=$DATA/traj-top1 SFT=$OUT/sft
start=$(date +%s)
source runs/common.sh  # dev, pick, continue_sft (the SFT-continued control, dev-picked -> <out>/best)

test -f $DATA/world.json || $PY corpus.py --world mini --out $DATA --reworded $N
test -f $DATA/index/meta.json || $PY retrievers.py build --data $DATA
test -f $TRAJ/train.jsonl || $PY synth.py --data $DATA --out $TRAJ --limit 400 --topk 1
test -e $SFT/final || $PY sft.py --data $TRAJ --train_steps 96 --grad_accum 2 --lr 4e-4 --eval_every 0 --save_every 0 \
  --keep 1 --out $SFT --resume auto
score() {  # RUN CHECKPOINT NAME METHODS: METHODS on every question of each of SPLITS -> <dir of RUN>/<split>-<RUN's name>
  for split in $SPLITS; do
    local out=$(dirname $1)/$split-$(basename $1)
    test -f $out/results.json || $PY evaluate.py --model $1/$2 --name $3 --methods $4 --data $DATA --split $split \
      --n_questions $N --topk 1 --out $out
  done
}
score $SFT final sft "routed oracle gold_steps"
for s in $SEEDS; do
  d=$OUT/s$s
  LR=4e-5 continue_sft $SFT/final $d/sft-cont --data $TRAJ --grad_accum 2 --seed $s
  for arm in $ARMS; do
    case $arm in
      teacher) how="--prefixes $TRAJ --teacher_spans all --step_reward teacher" ;;
      onpolicy) how="--rollout onpolicy --pool $TRAJ --step_reward labels --outcome_on final" ;;
      *) echo "error: ARMS=$ARMS: teacher or onpolicy"; exit 2 ;;
    esac
    test -e $d/grpo-$arm$TAG/final || $PY stepgrpo.py --data $DATA --model $SFT/final --seed $s $how $GRPO $EXTRA \
      --out $d/grpo-$arm$TAG --resume auto
  done
  test -z "${DEV_ONLY:-}" || continue
  for run in sft-cont $(printf "grpo-%s$TAG " $ARMS); do score $d/$run best $run@s$s routed; done
done
test -z "${DEV_ONLY:-}" || { echo "h5 dev screen: $(( ($(date +%s) - start) / 60 )) min"; exit 0; }
for split in $SPLITS; do
  tables=($OUT/$split-sft/results.json)
  for s in $SEEDS; do tables+=($(printf "$OUT/s$s/$split-%s/results.json " sft-cont $(printf "grpo-%s$TAG " $ARMS))); done
  $PY evaluate.py --combine "${tables[@]}" --data $DATA --split $split --out $OUT/table-$split$TAG
  for arm in $ARMS; do
    for base in sft-cont sft; do
      pairs=()
      for s in $SEEDS; do
        b=$(test $base = sft && echo $OUT/$split-sft || echo $OUT/s$s/$split-$base)
        pairs+=($b/trajectories-routed.jsonl $OUT/s$s/$split-grpo-$arm$TAG/trajectories-routed.jsonl)
      done
      echo "$split, grpo-$arm$TAG - $base, seeds $SEEDS:"
      $PY evaluate.py --paired "${pairs[@]}"
    done
  done
done
$PY bench_flops.py --runs $(printf "$OUT/s%s/sft-cont " $SEEDS) $(for s in $SEEDS; do printf "$OUT/s$s/grpo-%s$TAG " $ARMS; done)
echo "h5: $(( ($(date +%s) - start) / 60 )) min"
