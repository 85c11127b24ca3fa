#!/usr/bin/env bash
# The recipe against SFT and against SFT-continued, one training seed at a time (README "Results"):
#   SFT to its plateau: 216 steps x 4 rows, the cosine from 2e-4 ending at step 36, then a constant 2e-5
#   -> from its final checkpoint, two arms of about the same wall clock, each picked on dev by one criterion (the mean
#   of F1-Recall and routing accuracy on the first DEV_N dev questions; the start itself is not a candidate):
#     ARM=plateau (the default)
#       Step-GRPO      stepgrpo.py's loss defaults, 6 steps x 8 questions x 8 samples, checkpoints at 3 and 6
#       SFT-continued  the SFT run resumed in its own folder (optimizer state, the data order going on) for 36 more
#                      steps at 2e-5, checkpoints at 228, 240 and 252; DEV_N 100
#     ARM=wide
#       Step-GRPO      every step kind trained (--teacher_spans all), 6 steps x 48 questions x 8 samples at 2e-5,
#                      checkpoints at 2, 4 and 6
#       SFT-continued  180 more steps (the Step-GRPO stage's ~45 min), checkpoints at 240, 300, 360 and 396; DEV_N 200
#     ARM=wide2        the wide arms again from ARM=wide's SFT-continued pick, not the SFT (run first if missing):
#                      checkpoints at 2, 4, 6 and, from 396, at 420, 480, 540 and 576
#   -> scored once on the whole test split (500 questions, routed, greedy), SFT also with the oracle KB and the gold
#   steps (the ceilings) -> paired bootstrap of Step-GRPO against its start and against SFT-continued.
# A seed: ~2 h 15 min (plateau) on 2 cores; the wide arms add ~2 h 30 min to a seed whose SFT and its test are
# done, the wide2 arms ~2 h more. Run from the repo root after `make setup data/mini/traj/train.jsonl`, or as
# `make vs-sft SEEDS="1 2 3" [ARM=wide|wide2]`. Resumable: a finished stage is skipped, an interrupted training stage
# continues from its last checkpoint.
set -euo pipefail
PY=${PY:-.venv/bin/python}
SEEDS=${SEEDS:-"1 2 3"}
ARM=${ARM:-plateau}
DATA=data/mini
OUT=out/vs-sft
# G: Step-GRPO's flags; MORE, EVERY: SFT-continued's extra steps and checkpoint interval; X: the arms' folder suffix;
# START, BASE: the arms' start and the test folder of its row, under the seed's folder
wide="--teacher_spans all --batch_questions 48 --lr 2e-5 --save_every 2 --keep 3"
START=sft/final BASE=test-sft
case $ARM in
  plateau) G="--batch_questions 8 --save_every 3 --keep 2"; MORE=36; EVERY=12; DEV_N=100; X= ;;
  wide) G=$wide; MORE=180; EVERY=60; DEV_N=200; X=-wide ;;
  wide2) G=$wide; MORE=180; EVERY=60; DEV_N=200; X=-wide2; START=sft-cont-wide/best BASE=test-sft-cont-wide ;;
  *) echo "error: ARM=$ARM: expected plateau, wide or wide2" >&2; exit 2 ;;
esac
start=$(date +%s)
resume() { test -f "$1/latest" && echo --resume || true; }
dev() { test -f $2/results.json || $PY evaluate.py --model $1 --methods routed --split dev --n_questions $DEV_N --out $2; }
# the step whose dev results.json ($2 ...) has the best mean of F1-Recall and routing accuracy, the earliest of equals
pick() { $PY -c "import json, sys; r = [next(iter(json.load(open(f)).values())) for f in sys.argv[2:]]
s = [(x['f1_recall'] + x['routing_acc']) / 2 for x in r]; i = s.index(max(s)); print(sys.argv[1].split()[i], s[i])" "$@"; }
for s in $SEEDS; do
  d=$OUT/s$s
  test $ARM != wide2 || test -e $d/sft-cont-wide/best || SEEDS=$s ARM=wide PY=$PY bash "$0"
  test -e $d/sft/final || $PY sft.py --data $DATA/traj --seed $s --train_steps 216 --grad_accum 4 --decay_steps 36 \
    --eval_every 0 --save_every 36 --keep 2 --out $d/sft $(resume $d/sft)
  test -e $d/grpo$X/final || $PY stepgrpo.py --data $DATA --model $d/$START --seed $s --train_steps 6 $G \
    --eval_questions $DEV_N --out $d/grpo$X $(resume $d/grpo$X)
  k0=$(basename "$(readlink -f $d/$START)"); k0=${k0#step_}  # SFT-continued's candidates: every checkpoint it saves
  CANDS="$(seq $(( (k0 / EVERY + 1) * EVERY )) $EVERY $(( k0 + MORE - 1 )) | xargs) $(( k0 + MORE ))"
  PY=$PY bash runs/sft_continue.sh $d/$START $d/sft-cont$X $MORE --data $DATA/traj --grad_accum 4 --seed $s \
    --eval_every 0 --save_every $EVERY --keep $(wc -w <<< "$CANDS")
  if ! test -e $d/sft-cont$X/best; then  # the dev pick, the earliest of equal scores (as stepgrpo.py's <out>/best)
    files=()
    for k in $CANDS; do dev $d/sft-cont$X/step_$k $d/dev-sft-cont$X-$k; files+=($d/dev-sft-cont$X-$k/results.json); done
    read best top <<< "$(pick "$CANDS" "${files[@]}")"
    ln -sfn step_$best $d/sft-cont$X/best && echo "SFT-continued dev-picked: step $best ($top)"
  fi
  arms=(sft-cont$X:best:routed grpo$X:best:routed)
  test $ARM = wide2 || arms=("sft:final:routed oracle gold_steps" "${arms[@]}")
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
