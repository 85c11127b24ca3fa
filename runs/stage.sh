#!/usr/bin/env bash
# The main job's stage clock (Makefile, "The main job"): runs one stage, then prints its time, the time since the
# job's first stage began, and what is left: the later stages' times on the reference CPU (below), scaled by this
# machine's pace on the stages it has run. A stage make skips (already built) is not run and not counted.
#   bash runs/stage.sh LOG NAME command...
set -euo pipefail
log=$1 name=$2
shift 2
# seconds each stage took on the reference CPU, a fresh clone (docs/LOG.md, 2026-11-29): 2-core Intel Xeon, AVX512F,
# no AVX512-BF16 (fp32 training)
ORDER=(world index data sft sft-cont stepgrpo eval report)
REF=(5 38 18 797 278 487 800 10)
mkdir -p "$(dirname $log)"
test -s $log || echo "start $(date +%s)" > $log
t=$(date +%s)
# the scripts' own clock (clock.py): each process's phases as a JSON line, for the report's table
# (a stage run again replaces its lines)
times=$(dirname $log)/times.jsonl
if test -f $times; then { grep -v "\"stage\": \"$name\"" $times || true; } > $times.tmp; mv $times.tmp $times; fi
STAGE_TIMES=$times STAGE_NAME=$name "$@"
now=$(date +%s)
echo "$name $(( now - t ))" >> $log
awk -v name=$name -v now=$now -v order="${ORDER[*]}" -v ref="${REF[*]}" '
  $1 == "start" { t0 = $2; next }
  { took[$1] = $2 }
  END {
    n = split(order, o); split(ref, r)
    for (i = 1; i <= n; i++) { if (o[i] == name) k = i; R[o[i]] = r[i] }
    for (s in took) if (s in R) { done += took[s]; done_ref += R[s] }
    for (i = k + 1; i <= n; i++) left += R[o[i]]
    pace = done_ref ? done / done_ref : 1
    printf "== %s: %dm%02ds  (main job so far %dm%02ds; ~%d min left at this machine'"'"'s pace, %.2fx the reference CPU'"'"'s time)\n",
      name, took[name] / 60, took[name] % 60, (now - t0) / 60, (now - t0) % 60, int(left * pace / 60 + 0.5), pace
  }' $log
