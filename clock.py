"""
clock.py: where a script's wall time goes. The seconds from the process's start to its first line
of work are its imports (the interpreter's start-up included); each named phase sums the seconds
of its `with CLOCK("engine"):` blocks; what is left is "other". CLOCK.done(print0) prints one line
and, where runs/stage.sh sets STAGE_TIMES, appends it there as a JSON line
{"stage": STAGE_NAME, "imports": s, ...}: the main job's table of its stages' minutes.
Phases the scripts name: imports, inputs (data, index, tokenizer), model (weights into the
trainer), engine (an inference engine's start-up, a checkpoint's weights swapped in), compute
(the work itself: training steps, rollouts, the update, the sync, generation), checkpoint (saves).
The line also gives the process's peak resident memory (its in-process engine's included).
"""
import json
import os
import resource
import time
from contextlib import contextmanager

import psutil

PHASES = ("imports", "inputs", "model", "engine", "compute", "checkpoint", "other")  # table order

class Clock:
    def __init__(self):
        self.t0 = psutil.Process().create_time()  # the process's start (seconds since the epoch)
        self.main = None
        self.phases = {}

    def started(self):
        """The script's first line of work: what came before it is its imports (a second main()
        in one process starts the phases anew)."""
        self.main, self.phases = self.main or time.time(), {}

    @contextmanager
    def __call__(self, phase):
        t = time.time()
        try:
            yield
        finally:
            self.phases[phase] = self.phases.get(phase, 0.0) + time.time() - t

    def done(self, print0=print, rank=0):
        """{phase: seconds} since the process started, printed in one line with the process's peak
        resident memory, and (rank 0) appended to $STAGE_TIMES with it as peak_gib."""
        now = time.time()
        parts = {"imports": (self.main or now) - self.t0}
        parts.update({k: v + parts.get(k, 0.0) for k, v in self.phases.items()})
        parts["other"] = max(0.0, now - self.t0 - sum(parts.values()))
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux -> GiB
        print0("time: " + ", ".join(f"{k} {v:.1f} s" for k, v in parts.items()) +
               f" (total {now - self.t0:.1f} s; peak {peak:.1f} GiB resident)")
        path = os.environ.get("STAGE_TIMES")
        if path and rank == 0:
            with open(path, "a") as f:
                f.write(json.dumps({"stage": os.environ.get("STAGE_NAME", ""), **parts,
                                    "peak_gib": round(peak, 2)}) + "\n")
        return parts

CLOCK = Clock()
