"""runs/gpu_check.sh (`make gpu-check`): its dry mode end to end on the CPU, its refusal without CUDA, and the numpy
stand-in it uses for faiss on machines without faiss."""
import importlib.util
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

def gpu_check(tmp_path, dry, *flags):
    env = dict(os.environ, PY=sys.executable, DRY="1" if dry else "")
    return subprocess.run(["bash", str(ROOT / "runs" / "gpu_check.sh"), "--out", str(tmp_path / "gc"), *flags], cwd=ROOT,
                          env=env, capture_output=True, text=True)

@pytest.mark.slow
def test_dry_mode_runs_every_check_on_the_cpu(tmp_path, tok_dir):
    r = gpu_check(tmp_path, True, "--tokenizer", str(tok_dir))  # the tests' tokenizer: its tiny models, faster
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "dry run: CPU, fp32; skipped (GPU only): the cuda and budget checks" in r.stdout
    table = r.stdout[r.stdout.index("\ngpu_check (dry, CPU;"):].strip().splitlines()
    assert table[1].split() == ["check", "result", "seconds", "peak", "GiB", "note"]
    results = {line.split()[0]: line.split()[1] for line in table[2:-1]}
    vllm, bnb = ("pass" if importlib.util.find_spec(m) else "skip" for m in ("vllm", "bitsandbytes"))
    assert results == {"cuda": "skip", "budget": "skip", "sft": "pass", "resume": "pass", "grpo-hf": "pass", "grpo-vllm": vllm,
                       "onpolicy": "pass", "judge": vllm, "sleep": vllm, "sync-mem": "pass", "offload": "pass",
                       "tokens": "pass", "flex": "pass", "lora": "pass", "qlora": bnb, "visual": "pass"}
    skips = (vllm, vllm, vllm, bnb).count("skip")
    assert table[-1] == f"{14 - skips} passed, 0 failed, {2 + skips} skipped"

@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_it_asks_for_the_dry_mode(tmp_path):
    r = gpu_check(tmp_path, dry=False)
    assert r.returncode == 1 and r.stderr.strip().endswith("error: torch sees no CUDA device (DRY=1 / --dry runs the "
                                                          "check on the CPU)")

def gpu_check_module():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "runs" / "gpu_check.py")
    gc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gc)
    return gc

def test_the_checks_train_with_the_documented_7b_commands_activation_checkpointing(tmp_path, monkeypatch):
    # docs/gpu.md's 7B sft.py and stepgrpo.py commands pass --activation_checkpointing: the resume and visual checks
    # run both scripts with it (their mains stubbed here: the argv recorded, the logs and weights the checks read written)
    import sft
    import stepgrpo
    from safetensors.torch import save_file
    runs = []
    def fake(script, argv):
        runs.append((script, argv))
        out, steps = Path(argv[argv.index("--out") + 1]), int(argv[argv.index("--train_steps") + 1])
        (out / "final").mkdir(parents=True, exist_ok=True)
        save_file({"w": torch.zeros(1)}, out / "final" / "model.safetensors")
        recs = [dict(step=k, loss=1.0, sync_mean_diff=0.0, sync_max_diff=0.0, rollout_s=0.0) for k in range(1, steps + 1)]
        (out / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    monkeypatch.setattr(sft, "main", lambda argv: fake("sft", argv))
    monkeypatch.setattr(stepgrpo, "main", lambda argv: fake("stepgrpo", argv))
    c = types.SimpleNamespace(dtype="fp32", device="cpu", work=tmp_path, text="t", vl="v", vl_name="Idefics3", data="d",
                              dry=True)
    checks = {name: fn for name, fn, _ in gpu_check_module().checks(c)}
    fake("sft", ["--out", str(tmp_path / "sft"), "--train_steps", "2"])  # the sft check's run, which resume compares with
    runs.clear()
    assert "activation checkpointing" in checks["resume"]() and "activation checkpointing" in checks["visual"]()
    assert [s for s, _ in runs] == ["sft", "sft", "sft", "stepgrpo"]
    assert all("--activation_checkpointing" in argv for _, argv in runs)

def test_the_numpy_stand_in_for_faiss_searches_and_saves_like_faiss(tmp_path, monkeypatch):
    faiss = pytest.importorskip("faiss")
    gc = gpu_check_module()
    rng = np.random.default_rng(0)
    x, q = rng.standard_normal((50, 8)).astype(np.float32), rng.standard_normal((5, 8)).astype(np.float32)
    real, ours = faiss.IndexFlatIP(8), gc.FlatIP(8)
    real.add(x)
    ours.add(x)
    (ds, ids), (ds2, ids2) = real.search(q, 4), ours.search(q, 4)
    assert np.array_equal(ids, ids2) and np.allclose(ds, ds2, atol=1e-5) and ours.ntotal == 50
    assert gc.stand_in_faiss() == "faiss"  # the real one, where it imports
    monkeypatch.setitem(sys.modules, "faiss", faiss)  # put back after the test
    monkeypatch.setattr(gc, "has", lambda name: name != "faiss")  # a machine without faiss
    assert gc.stand_in_faiss() == "numpy stand-in"
    stand_in = sys.modules["faiss"]
    stand_in.write_index(ours, str(tmp_path / "x.faiss"))
    back = stand_in.read_index(str(tmp_path / "x.faiss"))
    assert (back.ntotal, back.d) == (50, 8) and np.array_equal(back.search(q, 4)[1], ids)
