"""Several runs of the repo's training scripts on the same torchrun ranks: each rank pays its start once (importing
torch, transformers and vLLM is ~8 s of CPU a process here, most of a tiny run), then runs each script's main(argv)
in turn, as the script's command line would, each in a process group of its own. A run's weights are bit for bit
those of its own `torchrun script.py` launch (docs/LOG.md). The launcher's own command lines stay tested where the
launch is the point: the killed rank's restart (tests/test_ppo.py), the refused --max-restarts, SFT with actions.

    from one_launch import launch
    launch([("stepgrpo", argv), ("copy", (run, 1, dest)), ("stepgrpo", [*argv2, "--resume"])])

("module:function", argv): that function of a test module instead of a script's main (it takes argv too).
("copy", (run, step, dest)): conftest.interrupted_copy on rank 0 (a run killed after that checkpoint), the ranks
waiting for it: a resume within the same launch.
"""
import importlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

def launch(runs, nproc=2, env=None, timeout=600):
    """The runs ((script module or "module:function", argv) or ("copy", (run folder, step, dest))) on `nproc` gloo
    ranks, one thread each, in one torchrun launch under `timeout` seconds (a hang fails, and every process of the
    launch is killed); env: the launch's environment (the tests' by default). Asserts that every run finished;
    returns the launch's stdout."""
    runs = [(script, [str(a) for a in args]) for script, args in runs]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), __file__,
           json.dumps(runs)]
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True, env={**(env or os.environ), "OMP_NUM_THREADS": "1"})
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        raise AssertionError(f"{[s for s, _ in runs]} on {nproc} ranks still running after {timeout} s")
    assert p.returncode == 0, err[-3000:]
    return out

def main(runs):
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    import torch.distributed as dist

    import engines
    from conftest import interrupted_copy
    for i, (script, args) in enumerate(runs):
        store, rank, world = next(dist.rendezvous("env://"))
        # the run's group under a key prefix of its own: a group made again under the same names reads the last
        # one's stale addresses from torchrun's store
        dist.init_process_group("gloo", store=dist.PrefixStore(f"run{i}", store), rank=rank, world_size=world)
        if script == "copy":
            if rank == 0:
                interrupted_copy(args[0], int(args[1]), args[2])
            dist.barrier()
        else:
            module, _, function = script.partition(":")
            getattr(importlib.import_module(module), function or "main")(args)
        if dist.is_initialized():  # a vLLM engine's close takes it down itself
            dist.destroy_process_group()
    engines.exit_now()

if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
