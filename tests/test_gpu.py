"""GPU tests: skipped without CUDA; on a GPU machine with requirements-gpu.txt installed, `make test-gpu` runs them (the
2-GPU ones need 2 GPUs). They check what the CPU suite cannot: each rank's vLLM engine on its own device, sleep mode,
the bf16 weight sync, an in-process judge beside the sleeping policy engine, NCCL equality of 1 and 2 ranks, Step-GRPO
steps and sharded resume on GPUs, the memory budget's update and sync check phases against torch's measured peaks,
FlexAttention beside the KL reference compiled once, faiss on GPU. Each vLLM engine is built in a process of its own
(in_own_process says why)."""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import engines
import prepare
import vision

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not installed")
two_gpus = pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2, reason="needs 2 GPUs")
ROOT = Path(__file__).resolve().parents[1]

def torchrun(script, args, nproc):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), str(script)]
    r = subprocess.run(cmd + args, capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    return r

def test_faiss_on_gpu_returns_what_cpu_faiss_returns():
    faiss = pytest.importorskip("faiss")
    import retrievers
    if not hasattr(faiss, "StandardGpuResources"):
        pytest.skip("faiss-gpu not installed (requirements-gpu.txt installs faiss-cpu)")
    rng = np.random.default_rng(0)
    docs, queries = rng.standard_normal((5000, 384)).astype(np.float32), rng.standard_normal((64, 384)).astype(np.float32)
    cpu = retrievers.faiss_index(docs)
    gpu = retrievers.to_gpu(retrievers.faiss_index(docs))
    assert type(gpu) is not type(cpu)  # moved
    (dc, ic), (dg, ig) = cpu.search(queries, 10), gpu.search(queries, 10)
    assert (ic == ig).mean() > 0.99 and np.allclose(dc, dg, atol=1e-3)

def test_ivfpq_index_loads_onto_the_gpu_and_searches_like_cpu(tmp_path):
    # `build --index ivfpq` on a GPU machine: load_dense memory-maps the file, then to_gpu copies it over with its nprobe
    faiss = pytest.importorskip("faiss")
    from bench import index as bench_index
    import retrievers
    if not hasattr(faiss, "StandardGpuResources"):
        pytest.skip("faiss-gpu not installed (requirements-gpu.txt installs faiss-cpu)")
    x = bench_index.clustered(12_064, 384, 1.0, np.random.default_rng(0))
    docs, queries = x[:12_000], x[12_000:]  # [12000, 384], [64, 384]
    index, params = retrievers.dense_index(docs, "ivfpq")
    faiss.write_index(index, str(tmp_path / "text.faiss"))
    gpu = retrievers.load_dense(tmp_path / "text.faiss", params)
    assert type(gpu) is not type(index) and gpu.nprobe == retrievers.DEPTH["ivfpq"]
    index.nprobe = retrievers.DEPTH["ivfpq"]
    (dc, ic), (dg, ig) = index.search(queries, 10), gpu.search(queries, 10)
    assert np.mean([len(set(a) & set(b)) / 10 for a, b in zip(ic, ig)]) > 0.95 and np.allclose(dc, dg, atol=1e-2)

def in_own_process(fn, *args):
    """Run fn(*args), a function of this module, in a fresh Python. vLLM's sleep mode allows one engine a process: an
    engine loads its weights into the process's one CuMemAllocator (vllm/device_allocator/cumem.py, get_instance: "a
    singleton") after `assert allocator.get_current_usage() == 0, "CuMem allocator can only be used for one instance
    per process."` (vllm/v1/worker/gpu_worker.py, _maybe_get_memory_pool_context), so a second engine in the pytest
    process would fail there. One engine a child process, as stepgrpo.py has one a rank."""
    code = (f"import sys; sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'tests')!r}]; import test_gpu; "
            f"test_gpu.{fn.__name__}(*sys.argv[1:])")
    r = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]

def engine_sleeps_and_follows_a_bf16_sync(model_dir):
    """sleep gives the KV cache's memory back; after a sync the engine scores like the new weights at bf16 tolerance"""
    from transformers import AutoModelForCausalLM
    engine = engines.VLLMEngine(model_dir, gpu_memory_utilization=0.3, sleep=True)
    ids = engine.tok.encode("The mayor of Felo is Ly Normi, and the capital is Uldoria.")
    old = torch.tensor(engine.prompt_logprobs(ids))
    free_awake = torch.cuda.mem_get_info()[0]
    engine.sleep()
    assert torch.cuda.mem_get_info()[0] - free_awake > 0.2 * torch.cuda.mem_get_info()[1]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda()
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
        lp = model(torch.tensor([ids], device="cuda")).logits[0, :-1].float().log_softmax(-1)  # [T-1, V]
    want = lp.gather(-1, torch.tensor(ids[1:], device="cuda")[:, None])[:, 0].cpu()
    engine.sync_weights({k: v.detach() for k, v in model.named_parameters()})
    new = torch.tensor(engine.prompt_logprobs(ids))
    assert (new - want).abs().max() < 0.1 and (new - old).abs().max() > 0.5
    engine.close()

@needs_vllm
def test_flex_attention_trains_packed_groups_as_the_dense_tree_mask(tiny_model_dir):
    # --flex_attention: a packed micro-batch's logprobs and gradients through FlexAttention's compiled kernels (their
    # backward runs on CUDA only) against SDPA's under the dense tree mask, both the trainer's bf16 FSDP2 model: apart
    # by at most twice what bf16 moves the dense ones from fp32 (a mask that let branches see each other: order 1)
    import torch.distributed as dist

    import grpo
    import trainutil
    cuda = torch.device("cuda", 0)
    g = torch.Generator().manual_seed(0)
    rand = lambda n: torch.randint(3, 100, (n,), generator=g).tolist()
    rows = [grpo.pack_group(rand(40), [(rand(150 + 9 * i), [-1.0] * (150 + 9 * i)) for i in range(3)], [1.0, -1.0, 0.5])]
    own = trainutil.init_group(1, device=cuda)
    try:
        got = {}
        for name, bf16, flex in (("fp32", False, False), ("dense", True, False), ("flex", True, True)):
            model = trainutil.load_sharded(tiny_model_dir, cuda, 1, bf16=bf16, tree_mask=True, flex=flex)
            ids, attn, pos, sel, _, adv = grpo.collate(rows, 0, cuda, flex=flex)
            logp = grpo.token_logprobs(model, ids, attn, sel, pos)[0]
            (logp * adv).sum().backward()
            got[name] = logp.detach(), torch.cat([trainutil.full(p.grad).flatten() for p in model.parameters()])
    finally:
        if own:
            dist.destroy_process_group()
    (lp32, g32), (lpd, gd), (lpf, gf) = got["fp32"], got["dense"], got["flex"]
    assert (lpf - lpd).abs().max() <= 2 * (lpd - lp32).abs().max()
    assert (gf - gd).norm() <= 2 * (gd - g32).norm()

def test_engine_sleeps_and_follows_a_bf16_sync(tiny_model_dir):
    in_own_process(engine_sleeps_and_follows_a_bf16_sync, tiny_model_dir)

def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "runs" / "gpu_check.py")
    gc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gc)
    return gc

def judge_beside_the_sleeping_policy_engine(model_dir):
    """the policy's engine (sleep mode) and an in-process judge's (without it) in one CUDA process: both start, the
    policy sleeps and wakes around a sync, the judge answers throughout"""
    import judge
    policy = engines.VLLMEngine(model_dir, gpu_memory_utilization=0.3, sleep=True)
    rater = judge.Judge.load(model_dir)
    ids = policy.tok.encode("The mayor of Felo is")
    policy.sleep()
    assert len(rater.engine.generate([ids], 4, temperature=0.0)[0][0]) > 0
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    policy.sync_weights({k: v.detach() for k, v in model.named_parameters()})
    assert len(policy.generate([ids], 4, temperature=0.0)[0][0]) > 0
    rater.engine.close()
    policy.close()

@needs_vllm
def test_an_in_process_judge_beside_the_sleeping_policy_engine(tiny_model_dir):
    in_own_process(judge_beside_the_sleeping_policy_engine, tiny_model_dir)

def engine_sleep_gives_back_what_it_took(model_dir):
    """sleep frees the weights and KV cache and offloads the CUDA graphs' pool and buffers: what stays on the GPU is
    under 5% of what the engine took"""
    took, freed, _ = gpu_check().sleep_frees(model_dir)
    assert freed > 0.95 * took, (took / 2**20, freed / 2**20)

@needs_vllm
def test_engine_sleep_gives_back_what_it_took(tiny_model_dir):
    in_own_process(engine_sleep_gives_back_what_it_took, tiny_model_dir)

def test_the_sync_checks_peak_is_the_budgets_sync_check_phase(wide_model_dir):
    # runs/gpu_check.py's sync-mem check: a 4096-token row after an update, bf16, at SmolLM2's vocabulary
    measured, predicted = gpu_check().sync_check_peak(wide_model_dir, torch.device("cuda", 0), True)
    assert abs(measured - predicted) < 0.1 * predicted, (measured / 2**20, predicted / 2**20)

def test_flex_attention_beside_the_reference_compiles_once(tiny_model_dir):
    # the policy (forward and backward) and its KL reference (no-grad) through FlexAttention in turn, more times than
    # Dynamo's recompile limit: one compiled function
    import grpo
    import trainutil
    gc, cuda = gpu_check(), torch.device("cuda", 0)
    own = trainutil.init_group(1, device=cuda)
    try:
        policy = trainutil.load_sharded(tiny_model_dir, cuda, 1, tree_mask=True, flex=True)
        ref = trainutil.load_sharded(tiny_model_dir, cuda, 1, train=False, tree_mask=True, flex=True)
        rows = [grpo.pack_group(list(range(5, 40)), [(list(range(50, 90)), [0.0] * 40)] * 2, [1.0, -1.0])]
        ids, attn, pos, sel, _, _ = grpo.collate(rows, 0, cuda, flex=True)
        with gc.FlexCompiles() as f:
            for _ in range(gc.RECOMPILES):
                with torch.no_grad():
                    grpo.token_logprobs(ref, ids, attn, sel, pos)
                grpo.token_logprobs(policy, ids, attn, sel, pos)[0].sum().backward()
        assert len(f.seen) == 1
    finally:
        if own:
            torch.distributed.destroy_process_group()

def test_the_budgets_update_phase_is_the_measured_peak(wide_model_dir):
    # runs/gpu_check.py's budget check (update_peak says what is measured and compared) on the tiny test model at
    # SmolLM2's vocabulary, whose 49152 tokens make the loss's fp32 copies (~1 GB) dominate. Tolerance 10%: the budget
    # counts the activations and the gradients whole (~13 MB), which fill in during the backward; one copy more or
    # less is 19%.
    measured, predicted = gpu_check().update_peak(wide_model_dir, torch.device("cuda", 0))
    assert abs(measured - predicted) < 0.1 * predicted, (measured / 2**20, predicted / 2**20)

PROBE = """
import os, torch, torch.distributed as dist
import engines, trainutil
rank, world, device, _ = trainutil.env_rank()
trainutil.init_group(world)
engine = engines.VLLMEngine(os.environ["PROBE_MODEL"], gpu_memory_utilization=0.3)
free, total = torch.cuda.mem_get_info(device)
used = torch.tensor([(total - free) / total], device=device)
everyone = [torch.zeros_like(used) for _ in range(world)]
dist.all_gather(everyone, used)
print("USED", [round(u.item(), 3) for u in everyone], flush=True)
engine.close()
"""

@two_gpus
@needs_vllm
def test_each_rank_engine_is_on_its_own_gpu(tmp_path, tiny_model_dir, monkeypatch):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    monkeypatch.setenv("PROBE_MODEL", str(tiny_model_dir))
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    r = torchrun(script, [], 2)
    used = json.loads(r.stdout.split("USED", 1)[1].splitlines()[0])
    assert all(u > 0.2 for u in used), used  # both GPUs hold an engine (its KV cache is 30% of the device)

@two_gpus
def test_two_gpu_sft_equals_one_gpu(tmp_path, tiny_model_dir, tiny_index):
    import dataio
    import retrievers
    import rollout
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    qs = dataio.load_questions(tiny_index, "train")[:16]
    trajs = rollout.rollout(rollout.GoldPolicy(tok, qs), retrievers.Retriever(tiny_index, "bm25"), qs)
    for split in ("train", "dev"):
        dataio.write_jsonl(tmp_path / "traj" / f"{split}.jsonl", [dict(ids=x["ids"], mask=x["mask"]) for x in trajs])
    common = ["--model", str(tiny_model_dir), "--data", str(tmp_path / "traj"), "--optim", "sgd", "--lr", "0.5",
              "--train_steps", "2", "--eval_every", "0", "--save_every", "0", "--dtype", "fp32"]
    torchrun(ROOT / "sft.py", common + ["--grad_accum", "4", "--out", str(tmp_path / "one")], 1)
    torchrun(ROOT / "sft.py", common + ["--grad_accum", "2", "--out", str(tmp_path / "two")], 2)
    a, b = (load_file(tmp_path / d / "final" / "model.safetensors") for d in ("one", "two"))
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5

def grpo_args(model, data, out):
    return ["--model", str(model), "--data", str(data), "--out", str(out), "--batch_questions", "2", "-n", "2",
            "--retriever", "bm25", "--eval_questions", "0", "--lr", "1e-2", "--entropy_coef", "0.1", "--kl_coef", "0.1",
            "--save_every", "1", "--train_steps", "2"]  # a checkpoint a step: every sync checked

@two_gpus
@pytest.mark.parametrize("mode", ["teacher_prefix", "onpolicy"])
def test_two_gpu_stepgrpo_steps_keep_the_engine_in_sync(tmp_path, tiny_model_dir, tiny_index, mode):
    out = tmp_path / "run"
    torchrun(ROOT / "stepgrpo.py", grpo_args(tiny_model_dir, tiny_index, out) + ["--rollout", mode], 2)
    recs = [json.loads(l) for l in open(out / "log.jsonl")]
    assert [r["step"] for r in recs] == [1, 2] and all(r["sync_max_diff"] < 0.1 for r in recs)  # bf16 engine

@two_gpus
def test_two_gpu_resume_from_a_sharded_checkpoint(tmp_path, tiny_model_dir, tiny_index):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    args = lambda out, steps: grpo_args(tiny_model_dir, tiny_index, out) + ["--train_steps", steps, "--dtype", "fp32"]
    torchrun(ROOT / "stepgrpo.py", args(straight, "2"), 2)
    torchrun(ROOT / "stepgrpo.py", args(resumed, "1"), 2)
    torchrun(ROOT / "stepgrpo.py", args(resumed, "2") + ["--resume"], 2)
    assert (resumed / "step_1" / "trainer" / ".metadata").exists()  # the sharded trainer state was resumed from
    a, b = (load_file(d / "final" / "model.safetensors") for d in (straight, resumed))
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5

def offloaded_shards_stay_on_the_host(model_dir):
    """load_sharded(offload=True) on this GPU: every shard in pinned host memory, the buffers on the GPU, compute on
    the GPU (trainutil.compute_device), and torch's CUDA allocation far below the fp32 weights'."""
    import trainutil
    trainutil.init_group(1, device=torch.device("cuda", 0))
    model = trainutil.load_sharded(model_dir, torch.device("cuda", 0), 1, bf16=True, offload=True)
    shards = [p.to_local() for p in model.parameters()]
    assert all(t.device.type == "cpu" and t.is_pinned() for t in shards)
    assert all(b.device.type == "cuda" for b in model.buffers())
    assert trainutil.compute_device(model) == torch.device("cuda", 0)
    shard_bytes = sum(t.numel() * t.element_size() for t in shards)
    assert torch.cuda.memory_allocated(0) < shard_bytes / 4, (torch.cuda.memory_allocated(0), shard_bytes)

@needs_vllm
def test_offload_keeps_the_shards_on_the_host_and_trains_as_without(tmp_path, tiny_model_dir, tiny_index):
    in_own_process(offloaded_shards_stay_on_the_host, tiny_model_dir)
    # PPO from the same start with and without --offload (policy, critic, reference in host memory): the same
    # updates, each engine synced (checked at every checkpoint), within bf16's reduction noise
    ppo = ["--rollout", "onpolicy", "--adv_estimator", "gae", "-n", "1", "--critic_warmup", "0", "--dtype", "fp32"]
    for out, extra in (("plain", []), ("offload", ["--offload"])):
        torchrun(ROOT / "stepgrpo.py", grpo_args(tiny_model_dir, tiny_index, tmp_path / out) + ppo + extra, 1)
    recs = [json.loads(l) for l in open(tmp_path / "offload" / "log.jsonl")]
    assert [r["step"] for r in recs] == [1, 2] and all(r["sync_max_diff"] < 0.1 for r in recs)
    a, b = (load_file(tmp_path / d / "final" / "model.safetensors") for d in ("plain", "offload"))
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5

def offloaded_steps_keep_their_state_on_the_host(model_dir):
    """load_sharded(offload=True) on this GPU, then bf16 AdamW steps: every FSDP unit with the
    pinned CPUOffloadPolicy; each forward's logits on the GPU; after each backward every gradient in
    host memory; after each step every shard in pinned host memory, the Adam moments in host memory,
    the buffers on the GPU, and the weights changed."""
    import trainutil
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule
    cuda = torch.device("cuda", 0)
    trainutil.init_group(1, device=cuda)
    model = trainutil.load_sharded(model_dir, cuda, 1, bf16=True, offload=True)
    found = [m._get_fsdp_state()._fsdp_param_group for m in model.modules()
             if isinstance(m, FSDPModule)]
    assert len(found) == len(trainutil.blocks(model)) + 1
    assert all(g.offload_policy == CPUOffloadPolicy(pin_memory=True) for g in found)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(5, 4000, (2, 24), generator=torch.Generator().manual_seed(0)).to(cuda)
    before = {n: p.to_local().clone() for n, p in model.named_parameters()}  # a world of one
    for _ in range(2):
        out = model(ids, labels=ids)
        assert out.logits.device == cuda
        out.loss.backward()
        assert all(p.grad.to_local().device.type == "cpu" for p in model.parameters())
        opt.step()
        opt.zero_grad()
        shards = [p.to_local() for p in model.parameters()]
        assert all(t.device.type == "cpu" and t.is_pinned() for t in shards)
        adam = [v for st in opt.state.values() for k, v in st.items()
                if k in ("exp_avg", "exp_avg_sq")]
        assert len(adam) == 2 * len(shards) and all(v.to_local().device.type == "cpu" for v in adam)
        assert all(b.device == cuda for b in model.buffers())
        assert trainutil.compute_device(model) == cuda
    assert all(not torch.equal(before[n], p.to_local()) for n, p in model.named_parameters())

def test_offloaded_steps_keep_the_shards_and_adam_state_in_host_memory(tiny_model_dir):
    in_own_process(offloaded_steps_keep_their_state_on_the_host, tiny_model_dir)

def vl_engine_sleeps_and_syncs(model_dir, index_dir, vl):
    """a bf16 VL engine with images asleep and woken around a sync, scoring a prompt with pictures like the new
    weights (vision tower included) at bf16 tolerance; the VL policy is made at `vl`"""
    import dataio
    import retrievers
    import rollout
    vl = prepare.prepare_vl(Path(vl), text_model=Path(model_dir))
    vis = vision.VisionIO.load(vl)
    qs = dataio.load_questions(Path(index_dir), "visual_train")[:2]
    _, prefixes = rollout.golden_prefixes(vis.tok, retrievers.Retriever(Path(index_dir), "bm25"), qs, vis=vis)
    ids, images = next((p, im) for _, _, p, im in prefixes if len(im) > 1)
    engine = engines.VLLMEngine(vl, gpu_memory_utilization=0.3, sleep=True)
    old = torch.tensor(engine.prompt_logprobs(ids, images))
    engine.sleep()
    model = engines.auto_model(vl).from_pretrained(vl, dtype=torch.float32).cuda()
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "vision_model" in name or "layers.0." in name:
                p.add_(0.05 * torch.randn_like(p))
        x = torch.tensor([ids], device="cuda")
        lp = model(input_ids=x, **vis.pixels([images], "cuda", x)).logits[0, :-1].float().log_softmax(-1)
    want = lp.gather(-1, x[0, 1:, None])[:, 0].cpu()
    engine.sync_weights({k: v.detach() for k, v in model.named_parameters()})
    new = torch.tensor(engine.prompt_logprobs(ids, images))
    assert (new - want).abs().max() < 0.1 and (new - old).abs().max() > 0.1
    engine.close()

@needs_vllm
def test_vl_engine_on_gpu_sleeps_syncs_and_trains(tmp_path, tiny_model_dir, tiny_index):
    # the VL path on CUDA: the engine's sync (in a process of its own); then VL Step-GRPO on 2 GPUs, every sync checked
    vl = tmp_path / "vl"
    in_own_process(vl_engine_sleeps_and_syncs, tiny_model_dir, tiny_index, vl)
    if torch.cuda.device_count() >= 2:
        out = tmp_path / "grpo"
        torchrun(ROOT / "stepgrpo.py", ["--model", str(vl), "--data", str(tiny_index), "--split", "visual_train", "--out",
                                        str(out), "--batch_questions", "2", "-n", "2", "--retriever", "bm25",
                                        "--eval_questions", "0", "--train_steps", "2", "--kl_coef", "0.1",
                                        "--entropy_coef", "0.1", "--lr", "1e-2", "--save_every", "1"], 2)
        recs = [json.loads(line) for line in open(out / "log.jsonl")]
        assert [r["step"] for r in recs] == [1, 2] and all(r["sync_max_diff"] < 0.1 for r in recs)

@two_gpus
@pytest.mark.parametrize("quant", ["none", "nf4", "int8"])
def test_two_gpu_lora_and_qlora_keep_the_engine_in_sync_and_resume(tmp_path, tiny_model_dir, tiny_index, quant):
    # LoRA adapters sharded by FSDP2 over NCCL (a quantised base held whole on each GPU), merged into the bf16 engine
    # after each step; the reference is the base with adapters off; resume continues the adapters exactly
    pytest.importorskip("bitsandbytes")
    args = lambda out, steps: grpo_args(tiny_model_dir, tiny_index, out) + [
        "--train_steps", steps, "--lora_r", "4", "--quant", quant, "--entropy_coef", "0.5"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    torchrun(ROOT / "stepgrpo.py", args(straight, "2"), 2)
    recs = [json.loads(l) for l in open(straight / "log.jsonl")]
    assert [r["step"] for r in recs] == [1, 2] and all(r["sync_max_diff"] < 0.1 for r in recs) and recs[1]["kl"] > 0
    torchrun(ROOT / "stepgrpo.py", args(resumed, "1"), 2)
    torchrun(ROOT / "stepgrpo.py", args(resumed, "2") + ["--resume"], 2)
    a, b = (load_file(d / "step_2" / "adapter" / "adapter_model.safetensors") for d in (straight, resumed))
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5
