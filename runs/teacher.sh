#!/usr/bin/env bash
# The teacher condition (README "Results"; docs/LOG.md): R1-Router's data procedure at this scale, then SFT,
# SFT-continued and Step-GRPO with R1-Router's step rewards and with label rewards, every arm trained only on what the
# teacher kept and on the questions' labels.
#   the teacher      the prompt-only policy after SFT on the golden trajectories of the first 48 training questions
#                    (36 steps x 4; imperfect the way a sampled LLM teacher is)
#   its data         one trajectory a question (R1-Router: temperature 1, top-k 20, a step that does not parse tried
#                    twice) on the next 1,000 training questions, real retrieval, kept when the final answer's token
#                    recall is 1 (R1-Router's data_filter.py; the steps are never checked): data/mini/traj-teacher,
#                    its filter counts and step mistakes against the world's gold in train.errors.json
#   per seed, from the prompt-only policy:
#     sft              SFT on the kept trajectories, SFT_STEPS x 4
#     sft-cont         that SFT run resumed on the same trajectories, MORE steps (about a Step-GRPO arm's wall clock:
#                      64 SFT steps ~16 min, 4 Step-GRPO steps ~20 min here)
#     grpo-teacher     Step-GRPO from sft, groups at the kept trajectories' prefixes, every step kind, R1-Router's
#                      rewards (against the teacher's sub-question, KB and intermediate answer; the gold final answer)
#     grpo-labels      the same with label rewards (a search that finds a new supporting document, a stop once all
#                      are found, intermediate answers against the hop answers; reward.label_*)
#     grpo-dropped     (ARMS="... dropped") on-policy Step-GRPO with label rewards on the questions the filter dropped
#                      (stepgrpo.py --dropped: what SFT on the kept trajectories never sees)
#   each arm's checkpoint picked on the first DEV_N dev questions (the mean of F1-Recall and routing accuracy, greedy;
#   the start is not a candidate) -> the first TEST_N test questions, greedy and --protocol released (R1-Router's
#   sampled evaluation), sft with the ceilings -> paired intervals of each Step-GRPO arm against sft-cont and sft.
# Resumable: a finished stage is skipped, an interrupted training stage continues from its last checkpoint.
#   bash runs/teacher.sh                      # or: make teacher SEEDS="0 1"
#   DEV_ONLY=1 bash runs/teacher.sh           # a dev screen: every arm trained and dev-picked, no test row
#   HOLDOUT=3hop bash runs/teacher.sh         # the same in a world whose train and dev hold no 3-hop chain (corpus.py
#                                             # --holdout; its test split is the default world's): out/teacher-no3hop
set -euo pipefail
PY=${PY:-.venv/bin/python}
SEEDS=${SEEDS:-0}
SFT_STEPS=${SFT_STEPS:-96} MORE=${MORE:-64} EVERY=${EVERY:-16} GRPO_STEPS=${GRPO_STEPS:-4}
GRPO="--batch_questions 16 --lr 2e-5 --train_steps $GRPO_STEPS --save_every 2 --keep 3"
DEV_N=${DEV_N:-100} TEST_N=${TEST_N:-500}
ARMS=${ARMS:-"teacher labels"}
DATA=data/mini${HOLDOUT:+-no$HOLDOUT}
TRAJ=$DATA/traj-teacher
OUT=out/teacher${HOLDOUT:+-no$HOLDOUT}
start=$(date +%s)
resume() { test -f "$1/latest" && echo --resume || true; }
dev() { test -f $2/results.json || $PY evaluate.py --model $1 --methods routed --data $DATA --split dev --n_questions $DEV_N \
  --out $2; }
pick() { $PY -c "import json, sys; r = [next(iter(json.load(open(f)).values())) for f in sys.argv[2:]]
s = [(x['f1_recall'] + x['routing_acc']) / 2 for x in r]; i = s.index(max(s)); print(sys.argv[1].split()[i], s[i])" "$@"; }

test -f $DATA/world.json || $PY corpus.py --world mini --out $DATA ${HOLDOUT:+--holdout $HOLDOUT}
test -f $DATA/index/meta.json || $PY retrievers.py build --data $DATA
test -f $DATA/traj-seed48/train.jsonl || $PY synth.py --data $DATA --out $DATA/traj-seed48 --splits train --limit 48
test -e $OUT/teacher/final || $PY sft.py --data $DATA/traj-seed48 --train_steps 36 --grad_accum 4 --eval_every 0 \
  --save_every 0 --keep 1 --out $OUT/teacher
test -f $TRAJ/train.jsonl || $PY synth.py --data $DATA --out $TRAJ --teacher $OUT/teacher/final -n 1 --splits train \
  --offset 48 --limit 1000
for s in $SEEDS; do
  d=$OUT/s$s
  test -e $d/sft/final || $PY sft.py --data $TRAJ --seed $s --train_steps $SFT_STEPS --grad_accum 4 --eval_every 0 \
    --save_every $EVERY --keep 1 --out $d/sft $(resume $d/sft)
  for arm in $ARMS; do
    case $arm in
      dropped) how="--rollout onpolicy --dropped $TRAJ --step_reward labels" ;;
      *) how="--prefixes $TRAJ --teacher_spans all --step_reward $arm" ;;
    esac
    test -e $d/grpo-$arm/final || $PY stepgrpo.py --data $DATA --model $d/sft/final --seed $s $how $GRPO \
      --eval_questions $DEV_N --out $d/grpo-$arm $(resume $d/grpo-$arm)
  done
  CANDS=$(seq $(( SFT_STEPS + EVERY )) $EVERY $(( SFT_STEPS + MORE )) | xargs)
  PY=$PY bash runs/sft_continue.sh $d/sft/final $d/sft-cont $MORE --data $TRAJ --grad_accum 4 --seed $s \
    --eval_every 0 --save_every $EVERY --keep $(wc -w <<< "$CANDS")
  if ! test -e $d/sft-cont/best; then  # the dev pick, the earliest of equal scores (as stepgrpo.py's <out>/best)
    files=()
    for k in $CANDS; do dev $d/sft-cont/step_$k $d/dev-sft-cont-$k; files+=($d/dev-sft-cont-$k/results.json); done
    read best top <<< "$(pick "$CANDS" "${files[@]}")"
    ln -sfn step_$best $d/sft-cont/best && echo "SFT-continued dev-picked: step $best ($top)"
  fi
  test -z "${DEV_ONLY:-}" || continue
  for arm in "sft:final:routed oracle gold_steps" sft-cont:best:routed $(printf "grpo-%s:best:routed " $ARMS); do
    IFS=: read name ck methods <<< "$arm"
    test -f $d/test-$name/results.json || $PY evaluate.py --model $d/$name/$ck --name $name@s$s --methods $methods \
      --data $DATA --split test --n_questions $TEST_N --out $d/test-$name
    test -f $d/sampled-$name/results.json || $PY evaluate.py --model $d/$name/$ck --name $name@s$s --methods routed \
      --protocol released --data $DATA --split test --n_questions $TEST_N --out $d/sampled-$name
  done
  for arm in $ARMS; do
    for p in test sampled; do
      for base in sft-cont sft; do
        echo "$p, grpo-$arm - $base:"
        $PY evaluate.py --paired $d/$p-$base/trajectories-routed.jsonl $d/$p-grpo-$arm/trajectories-routed.jsonl
      done
    done
  done
done
test -z "${DEV_ONLY:-}" || { echo "teacher condition, dev screen: $(( ($(date +%s) - start) / 60 )) min"; exit 0; }
tables=()
for s in $SEEDS; do
  for name in sft sft-cont $(printf "grpo-%s " $ARMS); do tables+=($OUT/s$s/{test,sampled}-$name/results.json); done
done
$PY evaluate.py --combine "${tables[@]}" --data $DATA --split test --out $OUT/table
for arm in $ARMS; do  # over the seeds: one pair a seed, averaged, questions resampled together
  for p in test sampled; do
    for base in sft-cont sft; do
      pairs=()
      for s in $SEEDS; do pairs+=($OUT/s$s/$p-{$base,grpo-$arm}/trajectories-routed.jsonl); done
      echo "$p, grpo-$arm - $base, seeds $SEEDS:"
      $PY evaluate.py --paired "${pairs[@]}"
    done
  done
done
echo "teacher condition: $(( ($(date +%s) - start) / 60 )) min"
