#!/usr/bin/env bash
# The main job's last stage (Makefile, "The main job"): the three arms' table, Step-GRPO's paired intervals against
# SFT and SFT-continued, one test question's trajectories beside its gold steps, and what a table of one seed on
# EVAL_N questions can show.
#   bash runs/demo_report.sh PY DATA OUT EVAL_N
set -euo pipefail
PY=$1 DATA=$2 OUT=$3 N=$4
T=trajectories-routed.jsonl
$PY corpus.py --check $DATA
$PY evaluate.py --combine $OUT/eval/{sft,sft-cont,stepgrpo}/results.json --data $DATA --split test --out $OUT/results
for base in sft sft-cont; do
  echo; echo "Step-GRPO - $base:"
  $PY evaluate.py --paired $OUT/eval/$base/$T $OUT/eval/stepgrpo/$T | tee $OUT/results/paired-$base.txt
done
echo; echo "One test question, routed by SFT and by Step-GRPO (ok / x: the gold step's KB or not):"
$PY report.py --show $OUT/eval/{sft,stepgrpo}/$T --data $DATA
w=$(awk '/^  f1_recall:/ { for (i = 1; i < NF; i++) if ($i == "interval") { print $(i + 3) - $(i + 1); exit } }' \
  $OUT/results/paired-sft-cont.txt)  # the question-level interval: hi - lo
echo; echo "Where the main job's minutes went (this CPU; a stage made earlier and skipped is not in it):"
$PY report.py --stages $OUT/stages.log
cat <<TXT

What this table can show: the whole procedure, run end to end, and what each arm does on these $N test questions.
What it cannot: which arm is better. It is one seed on $N questions with final checkpoints and no dev pick; the
paired 95% interval of Step-GRPO - SFT-continued is $w F1-Recall points wide: a smaller difference between them is
noise here. That comparison, every arm dev-picked, over seeds on all 500 test questions beside the ceilings, is README
"Results" (\`make vs-sft\`, \`make teacher\`). Curves of the Step-GRPO run: $OUT/stepgrpo/curves.png.
TXT
