#!/usr/bin/env bash
# Does a change leave Step-GRPO's behaviour as it was? Six flag sets (the defaults, R1-Router's released setting,
# on-policy with the field's tricks, outcome GRPO with dynamic sampling and GSPO, branch, PPO with a critic), 2 steps
# each, run from the code at REV (a git worktree) and from this checkout, from one short SFT so that rewards and
# advantages are not all 0; every log.jsonl field but the timings and the final weights compared, bit for bit.
# Needs data/mini (make's world, index and traj-top1 stages); REV's code is checked out at out/same_steps/code (`git
# worktree remove out/same_steps/code` when done). ~15 min for all six on 2 cores, alone.
#   bash runs/same_steps.sh 833f8d7            # all six
#   bash runs/same_steps.sh 833f8d7 1 3        # some, by number
set -euo pipefail
PY=${PY:-$PWD/.venv/bin/python}
REV=$1
shift
MODES=${*:-1 2 3 4 5 6}
WORK=${WORK:-out/same_steps}
DATA=$PWD/data/mini
mkdir -p $WORK
test -f $WORK/sft/final/config.json || $PY sft.py --model models/SmolLM2-135M-Instruct --data $DATA/traj-top1 \
  --train_steps 24 --grad_accum 2 --lr 4e-4 --eval_every 0 --save_every 0 --keep 1 --out $WORK/sft
test -d $WORK/code || git worktree add -q --detach $WORK/code $REV
declare -A F
F[1]=""
F[2]="--teacher_spans all --no-balance_kb --w_format 0 --entropy_coef 1e-3 --old_logprobs trainer --route_credit whole --adv_std"
F[3]="--rollout onpolicy --w_hit 0.5 --overlong penalty --minibatches 2 --tis_cap 2 --clip_high 0.28"
F[4]="--rollout onpolicy --reward outcome --dynamic_sampling --ratio sequence"
F[5]="--rollout branch --branch_steps 2 --overlong mask --kl_coef 0.01"
F[6]="--rollout onpolicy --adv_estimator gae --critic_warmup 0 -n 2 --kl_in_reward 0.001 --minibatches 2"
BASE="--model $PWD/$WORK/sft/final --data $DATA --topk 1 --train_steps 2 --batch_questions 2 -n 4 --eval_questions 0
  --save_every 0"
for m in $MODES; do
  for side in before after; do
    dir=$([ $side = before ] && echo $WORK/code || echo .)
    rm -rf $PWD/$WORK/$side-$m
    (cd $dir && $PY stepgrpo.py $BASE ${F[$m]} --out $OLDPWD/$WORK/$side-$m > $OLDPWD/$WORK/$side-$m.log 2>&1) \
      || { echo "flag set $m ($side): failed, see $WORK/$side-$m.log"; exit 1; }
  done
  $PY - $WORK/before-$m $WORK/after-$m "$m" <<'PY'
import hashlib, json, sys
from pathlib import Path
def run(out):  # its records without timings (and fields one side may not log), its final weights' hash
    recs = [{k: v for k, v in json.loads(line).items() if not k.endswith("_s") and k not in ("memory_gib", "nonfinite")}
            for line in open(Path(out) / "log.jsonl")]
    return recs, hashlib.sha256((Path(out) / "final" / "model.safetensors").read_bytes()).hexdigest()
(a, wa), (b, wb) = run(sys.argv[1]), run(sys.argv[2])
diff = [(i, k) for i, (x, y) in enumerate(zip(a, b)) for k in sorted(set(x) | set(y)) if x.get(k) != y.get(k)]
same = wa == wb and len(a) == len(b) and not diff
print(f"flag set {sys.argv[3]}: {'the same' if same else 'DIFFERENT'} ({len(a)} records, {len(a[0])} fields each; "
      f"weights {'equal' if wa == wb else 'differ'}{'; fields: ' + str(diff[:5]) if diff else ''})")
sys.exit(0 if same else 1)
PY
done
