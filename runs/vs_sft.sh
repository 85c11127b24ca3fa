#!/usr/bin/env bash
# The recipe against SFT and against SFT-continued, one training seed at a time (README "Results"):
#   SFT to its plateau on the golden trajectories of 400 training questions (data/mini/traj): 216 steps x 4 rows, the
#   cosine from 2e-4 ending at step 36, then a constant 2e-5
#   -> from a START checkpoint, two arms of about the same wall clock, each picked on dev by one criterion (the mean
#   of F1-Recall and routing accuracy on the first DEV_N dev questions; the start itself is not a candidate):
#     Step-GRPO      teacher-prefix groups built for any of the 4,000 training questions
#     SFT-continued  the SFT run resumed in its own folder (optimizer state, the step count going on) on the golden
#                    trajectories of all 4,000 training questions (data/mini/traj-all): the questions Step-GRPO
#                    draws from, so a gain is the RL's and not the new questions' (docs/LOG.md, 2026-11-26)
#   ARM=plateau (the default)  START the SFT; Step-GRPO stepgrpo.py's loss defaults, 6 steps x 8 questions x 8
#                              samples, checkpoints at 3 and 6; SFT-continued 36 more steps, every 12; DEV_N 100
#   ARM=wide                   START the SFT; Step-GRPO trains every step kind (--teacher_spans all), 6 steps x 48
#                              questions x 8 samples at 2e-5, checkpoints at 2, 4 and 6; SFT-continued 180 more
#                              steps (the Step-GRPO stage's ~45 min), every 60; DEV_N 200
#   ARM=wide2                  the wide arms from a longer SFT: the SFT run continued on its 400 questions to 396
#                              steps (sft396), which more SFT on them no longer moves on dev
#   -> scored once on the whole test split (500 questions, routed, greedy), the SFT also with the oracle KB and the
#   gold steps (the ceilings) -> paired bootstrap of Step-GRPO against its start and against SFT-continued.
# A seed: ~2 h 15 min (plateau) on 2 cores; on a seed whose SFT and its test are done, the wide arms ~2 h 45 min more,
# the wide2 arms ~3 h 30 min more. Run from the repo root after `make setup data/mini/traj/train.jsonl
# data/mini/traj-all/train.jsonl`, or as `make vs-sft [SEEDS="0 1 2 3"] [ARM=wide|wide2]`. Resumable: a finished stage
# is skipped, an interrupted training stage continues from its last checkpoint.
set -euo pipefail
PY=${PY:-.venv/bin/python}
SEEDS=${SEEDS:-"0 1 2 3"}
ARM=${ARM:-plateau}
DATA=data/mini
OUT=out/vs-sft
# G: Step-GRPO's flags; MORE, EVERY: SFT-continued's extra steps and checkpoint interval; X: the arms' folder suffix;
# START: the arms' start under the seed's folder; BASE: the test folder of its row
wide="--teacher_spans all --batch_questions 48 --lr 2e-5 --save_every 2"
START=sft/final
case $ARM in
  plateau) G="--batch_questions 8 --save_every 3"; MORE=36; EVERY=12; DEV_N=100; X= ;;
  wide) G=$wide; MORE=180; EVERY=60; DEV_N=200; X=-wide ;;
  wide2) G=$wide; MORE=180; EVERY=60; DEV_N=200; X=-wide2; START=sft396/final ;;
  *) echo "error: ARM=$ARM: expected plateau, wide or wide2" >&2; exit 2 ;;
esac
BASE=test-${START%/*}
start=$(date +%s)
source runs/common.sh  # dev, pick, continue_sft (the SFT-continued control, dev-picked -> <out>/best)
for s in $SEEDS; do
  d=$OUT/s$s
  test -e $d/sft/final || $PY sft.py --data $DATA/traj --seed $s --train_steps 216 --grad_accum 4 --decay_steps 36 \
    --eval_every 0 --save_every 36 --keep 2 --out $d/sft --resume auto
  test $ARM != wide2 || PY=$PY bash runs/sft_continue.sh $d/sft/final $d/sft396 180 --data $DATA/traj --grad_accum 4 \
    --seed $s --eval_every 0 --save_every 36 --keep 1
  test -e $d/grpo$X/final || $PY stepgrpo.py --data $DATA --model $d/$START --seed $s --train_steps 6 $G \
    --eval_questions $DEV_N --out $d/grpo$X --resume auto
  continue_sft $d/$START $d/sft-cont$X --data $DATA/traj-all --grad_accum 4 --seed $s
  arms=(sft-cont$X:best:routed grpo$X:best:routed)
  case $ARM in
    wide2) arms=(sft396:final:routed "${arms[@]}") ;;
    *) arms=("sft:final:routed oracle gold_steps" "${arms[@]}") ;;
  esac
  for arm in "${arms[@]}"; do
    IFS=: read name ck methods <<< "$arm"
    test -f $d/test-$name/results.json || $PY evaluate.py --model $d/$name/$ck --name $name@s$s --methods $methods \
      --data $DATA --split test --out $d/test-$name
  done
  $PY evaluate.py --paired $d/$BASE/trajectories-routed.jsonl $d/test-grpo$X/trajectories-routed.jsonl
  $PY evaluate.py --paired $d/test-sft-cont$X/trajectories-routed.jsonl $d/test-grpo$X/trajectories-routed.jsonl
done
tables=()
for s in $SEEDS; do tables+=($OUT/s$s/{$BASE,test-sft-cont$X,test-grpo$X}/results.json); done
$PY evaluate.py --combine "${tables[@]}" --data $DATA --split test --out $OUT/table$X
echo "vs-sft ($ARM): $(( ($(date +%s) - start) / 60 )) min"
