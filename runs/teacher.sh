#!/usr/bin/env bash
# The teacher condition (README "Results"; docs/LOG.md): R1-Router's data procedure at this scale (the teacher and
# its filtered trajectories: runs/teacher_data.sh), then SFT, SFT-continued and Step-GRPO with R1-Router's step
# rewards, every arm trained only on what the teacher kept.
#   per seed, from the prompt-only policy:
#     sft              SFT on the kept trajectories, SFT_STEPS x 4
#     sft-cont         that SFT run resumed on the same trajectories, MORE steps (about a Step-GRPO arm's wall clock:
#                      64 SFT steps ~16 min, 4 Step-GRPO steps ~20 min here)
#     grpo-teacher     Step-GRPO from sft, groups at the kept trajectories' prefixes, every step kind, R1-Router's
#                      rewards (against the teacher's sub-question, KB and intermediate answer; the gold final answer)
#   each arm's checkpoint picked on the first DEV_N dev questions (the mean of F1-Recall and routing accuracy, greedy;
#   the start is not a candidate) -> the first TEST_N test questions, greedy and --protocol released (R1-Router's
#   sampled evaluation), sft with the ceilings -> paired intervals of each Step-GRPO arm against sft-cont and sft.
# Resumable: a finished stage is skipped, an interrupted training stage continues from its last checkpoint.
#   bash runs/teacher.sh                      # or: make teacher SEEDS="0 1"
#   DEV_ONLY=1 bash runs/teacher.sh           # a dev screen: every arm trained and dev-picked, no test row
#   HOLDOUT=3hop bash runs/teacher.sh         # the same in a world whose train and dev hold no 3-hop chain (corpus.py
#                                             # --holdout; its test split is the default world's): out/teacher-no3hop
#   FROM=sft-cont bash runs/teacher.sh        # every Step-GRPO arm and a new SFT-continued control start from
#                                             # sft-cont's dev pick, not from sft: <seed>/from-sft-cont, rows cont-*
#   EXTRA="--lr 5e-6" TAG=-lr5e-6 bash runs/teacher.sh  # a variant of the Step-GRPO arm: stepgrpo.py flags after
#                                             # the arm's own (the later one wins), its folder grpo-teacher-lr5e-6
set -euo pipefail
PY=${PY:-.venv/bin/python}
SEEDS=${SEEDS:-0}
SFT_STEPS=${SFT_STEPS:-96} MORE=${MORE:-64} EVERY=${EVERY:-16} GRPO_STEPS=${GRPO_STEPS:-4}
GRPO="--batch_questions 16 --lr 2e-5 --train_steps $GRPO_STEPS --save_every 2"
DEV_N=${DEV_N:-100} TEST_N=${TEST_N:-500}
FROM=${FROM:-sft}
EXTRA=${EXTRA:-} TAG=${TAG:-}
GARMS=grpo-teacher$TAG  # the Step-GRPO arm's folder name
test -z "$EXTRA" || test -n "$TAG" || { echo "error: EXTRA=\"$EXTRA\" needs TAG, its arms' folder suffix"; exit 2; }
DATA=data/mini${HOLDOUT:+-no$HOLDOUT}
TRAJ=$DATA/traj-teacher
OUT=out/teacher${HOLDOUT:+-no$HOLDOUT}
start=$(date +%s)
arms() { test $FROM = sft && echo $1 || echo $1/from-$FROM; }  # where a seed's Step-GRPO arms and their control go
source runs/common.sh  # dev, pick, continue_sft (the SFT-continued control, dev-picked -> <out>/best)

test -f $DATA/world.json || $PY corpus.py --world mini --out $DATA ${HOLDOUT:+--holdout $HOLDOUT}
test -f $DATA/index/meta.json || $PY retrievers.py build --data $DATA
PY=$PY bash runs/teacher_data.sh $DATA $OUT
for s in $SEEDS; do
  d=$OUT/s$s
  test -e $d/sft/final || $PY sft.py --data $TRAJ --seed $s --train_steps $SFT_STEPS --grad_accum 4 --eval_every 0 \
    --save_every $EVERY --keep 1 --out $d/sft --resume auto
  continue_sft $d/sft/final $d/sft-cont --data $TRAJ --grad_accum 4 --seed $s
  a=$(arms $d) from=$d/sft/final
  if test $FROM = sft-cont; then
    from=$d/sft-cont/best
    continue_sft $from $a/sft-cont --data $TRAJ --grad_accum 4 --seed $s
  fi
  test -e $a/$GARMS/final || $PY stepgrpo.py --data $DATA --model $from --seed $s --prefixes $TRAJ --teacher_spans all \
    $GRPO $EXTRA --eval_questions $DEV_N --out $a/$GARMS --resume auto
  test -z "${DEV_ONLY:-}" || continue
  for row in "$d/sft:final:routed oracle gold_steps" $a/sft-cont:best:routed $(printf "$a/%s:best:routed " $GARMS); do
    IFS=: read run ck methods <<< "$row"
    at=$(dirname $run) name=$(basename $run)
    tag=$(test $at = $d || echo cont-)$name@s$s
    test -f $at/test-$name/results.json || $PY evaluate.py --model $run/$ck --name $tag --methods $methods \
      --data $DATA --split test --n_questions $TEST_N --out $at/test-$name
    test -f $at/sampled-$name/results.json || $PY evaluate.py --model $run/$ck --name $tag --methods routed \
      --protocol released --data $DATA --split test --n_questions $TEST_N --out $at/sampled-$name
  done
  for g in $GARMS; do
    for p in test sampled; do
      for base in $a/$p-sft-cont $d/$p-sft; do
        echo "$p, $a/$g - $base:"
        $PY evaluate.py --paired $base/trajectories-routed.jsonl $a/$p-$g/trajectories-routed.jsonl
      done
    done
  done
done
test -z "${DEV_ONLY:-}" || { echo "teacher condition, dev screen: $(( ($(date +%s) - start) / 60 )) min"; exit 0; }
tables=()
for s in $SEEDS; do
  a=$(arms $OUT/s$s)
  tables+=($OUT/s$s/{test,sampled}-sft/results.json)
  for name in sft-cont $GARMS; do tables+=($a/{test,sampled}-$name/results.json); done
done
$PY evaluate.py --combine "${tables[@]}" --data $DATA --split test --out $OUT/table${FROM#sft}$TAG
for g in $GARMS; do  # over the seeds: one pair a seed, averaged, questions resampled together
  for p in test sampled; do
    for base in sft-cont sft; do
      pairs=()
      for s in $SEEDS; do
        a=$(arms $OUT/s$s)
        pairs+=($(test $base = sft && echo $OUT/s$s || echo $a)/$p-$base/trajectories-routed.jsonl $a/$p-$g/trajectories-routed.jsonl)
      done
      echo "$p, $g - $base, seeds $SEEDS (from $FROM):"
      $PY evaluate.py --paired "${pairs[@]}"
    done
  done
done
echo "teacher condition: $(( ($(date +%s) - start) / 60 )) min"
