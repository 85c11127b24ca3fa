"""
trainutil.py: the FSDP2 set-up, checkpoints and logging that sft.py and stepgrpo.py share (and nothing else).

Same code with or without torchrun: a single process is an FSDP2 world of one (a gloo/nccl group over an in-memory
store), so the sharding, mixed-precision, state-dict and clipping paths are the ones a multi-rank run takes.
GPU: NCCL, flash-attn 2 when installed. CPU: gloo. Both: bf16 compute with fp32 master weights and fp32 gradient
reduction (--dtype bf16), or fp32 throughout (--dtype fp32); --dtype auto (the default) picks bf16 where the
hardware computes it natively (CUDA, AVX512-BF16 CPUs) and fp32 elsewhere.

Checkpoint layout (in --out):
    step_<N>/          Hugging Face folder (config, safetensors, tokenizer) that transformers and vLLM load as is,
                       + trainer/ (sharded model and optimizer state, torch.distributed.checkpoint: one file a rank)
                       + trainer_state.pt (step, RNG, and the script's own data position, args)
    .step_<N>.tmp/     a checkpoint being written (renamed to step_<N> when whole; never resumed from)
    latest             text file naming the newest whole checkpoint folder, replaced atomically
    final -> step_<N>  symlink written at the end of training: `--model out/<run>/final`
    log.jsonl          one record per step (on --resume, records after the checkpoint are dropped)
"""
import json
import os
import random
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import corpus

os.environ.setdefault("HF_HUB_OFFLINE", "1")

def env_rank():
    """-> rank, world, device from torchrun's RANK/WORLD_SIZE/LOCAL_RANK (alone: a world of one), and print0."""
    cuda = torch.cuda.is_available()
    rank, world, local_rank = (int(os.environ.get(k, d)) for k, d in (("RANK", 0), ("WORLD_SIZE", 1), ("LOCAL_RANK", 0)))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    print0 = lambda *a, **k: print(*a, **k, flush=True) if rank == 0 else None
    return rank, world, device, print0

def init_group(world, timeout_min=30):
    """Join the process group (alone: a gloo/nccl group of one over an in-memory store). Returns whether we made it:
    a caller's existing group (e.g. one an in-process vLLM made) is reused and left to its owner. timeout_min: how long
    a collective may wait (NCCL's default is 10; rank 0 writing a 7B checkpoint's weights can take longer)."""
    import datetime
    own = not dist.is_initialized()
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0)):
        # torchrun's shared rendezvous store keeps the first attempt's keys: a restarted rank reads the dead ranks' gloo
        # or NCCL addresses and fails to connect (pytorch/pytorch#135712); without sharing, each attempt gets a new store
        sys.exit("error: torchrun --max-restarts needs TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torchrun's environment")
    if own:
        kw = {} if "RANK" in os.environ else dict(store=dist.HashStore(), rank=0, world_size=1)
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo",
                                timeout=datetime.timedelta(minutes=timeout_min), **kw)
    if dist.get_world_size() != world:
        sys.exit(f"error: the process group has {dist.get_world_size()} ranks but WORLD_SIZE says {world}")
    return own

def resolve_start(model, out, resume):
    """-> (the folder to load weights from, whether this run resumes): --model, or with --resume the newest whole
    checkpoint in --out (`latest` names a checkpoint only once it is complete, so an interrupted save is never the one
    resumed from). --resume auto resumes when there is a checkpoint and starts from --model otherwise: a job that
    is restarted after a failure picks up where it stopped. Exits on bad input."""
    out, start = Path(out), Path(model)
    resuming = resume == "yes" or (resume == "auto" and (out / "latest").is_file())
    if resuming:
        if not (out / "latest").is_file():
            sys.exit(f"error: --resume: no checkpoint in {out} ({out / 'latest'} not found)")
        start = out / (out / "latest").read_text().strip()
        if not (start / "trainer_state.pt").is_file():
            sys.exit(f"error: --resume: {start}/trainer_state.pt not found")
    if not (start / "config.json").is_file():
        sys.exit(f"error: {start}: not a model folder (no config.json)")
    return start, resuming

def resolve_dtype(dtype, device):
    """--dtype auto -> "bf16" on CUDA and on CPUs with native bf16 (AVX512-BF16), else "fp32": where bf16 is emulated
    (an AVX2-only EPYC) a SmolLM2 forward+backward of 2 x 384 tokens took 150 s in bf16 against 6 s in fp32."""
    if dtype != "auto":
        return dtype
    return "bf16" if device.type == "cuda" or torch.cpu._is_avx512_bf16_supported() else "fp32"

def blocks(model):
    """The repeated blocks of a model, each one FSDP unit: the elements of its outermost nn.ModuleLists (a causal LM's
    decoder layers; a VL model's vision-encoder layers too: Idefics3's encoder layers, Qwen2.5-VL's vision blocks)."""
    out, inside = [], set()
    for m in model.modules():
        if isinstance(m, torch.nn.ModuleList) and id(m) not in inside:
            out += list(m)
            inside.update(id(x) for b in m for x in b.modules())
    return out

def load_sharded(path, device, world, activation_checkpointing=False, train=True, bf16=True, tree_mask=False):
    """fp32 master weights; each block (blocks(): decoder layers, vision-encoder layers) is one FSDP unit, the root
    holds the rest (embeddings, final norm, lm_head; a VL model's patch embedding and connector).
    Only rank 0 reads the checkpoint into host memory (one full fp32 copy, 28 GiB at 7B, not one per rank); every rank
    builds the model on the meta device, shards it, allocates its shards on `device`, and receives them from rank 0
    (set_model_state_dict(broadcast_from_rank0=True)); buffers outside the state dict (RoPE's inv_freq) likewise.
    bf16: FSDP2 mixed precision, i.e. bf16 forward/backward compute, fp32 gradient reduction and optimizer state, on
    CPU as on GPU (resolve_dtype says where it is native).
    tree_mask: the model will get 4D attention masks (stepgrpo's packed groups), which SDPA takes and flash-attn not."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoConfig
    from rollout import auto_model
    auto, attn = auto_model(path), "sdpa"
    if device.type == "cuda" and not tree_mask:
        try:
            import flash_attn  # noqa: F401
            attn = "flash_attention_2"
        except ImportError:
            pass
    full, buffers = {}, {}
    if dist.get_rank() == 0:
        src = auto.from_pretrained(path, dtype=torch.float32, attn_implementation=attn)
        full, buffers = src.state_dict(), dict(src.named_buffers())
        generation_config = src.generation_config
    with torch.device("meta"):
        model = auto.from_config(AutoConfig.from_pretrained(path), dtype=torch.float32, attn_implementation=attn)
    if activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    mesh = init_device_mesh(device.type, (world,))
    for block in blocks(model):
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    model.to_empty(device=device)
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    for name, b in model.named_buffers():
        if dist.get_rank() == 0:
            b.copy_(buffers[name])
        dist.broadcast(b, src=0)
    if dist.get_rank() == 0:
        model.generation_config = generation_config
    model.train(train)
    if not train:
        model.requires_grad_(False)
    return model

def gpu_budget_error(total, allocated, shards, engine_fraction, device=0):
    """The one-line error when the rollout phase cannot fit on a device of `total` bytes, else None: the vLLM engine's
    share (weights + KV cache) beside what the trainer holds then, i.e. what is `allocated` at start-up (the policy's
    fp32 shards, a reference) plus the Adam state the first step adds (2 x the `shards` bytes). The update phase needs
    less: the engine sleeps through it."""
    engine, trainer = engine_fraction * total, allocated + 2 * shards
    if engine + trainer <= total:
        return None
    gib = lambda b: f"{b / 2**30:.1f} GiB"
    return (f"error: GPU {device} ({gib(total)}) cannot hold the vLLM engine ({engine_fraction:.0%}: {gib(engine)}) beside "
            f"the trainer ({gib(trainer)}: policy shards and reference {gib(allocated)} + Adam state {gib(2 * shards)}); "
            f"use more GPUs (the shards shrink with the world size)")

def check_gpu_budget(model, engine_fraction):
    """At start-up, before the engine exists: exit with gpu_budget_error's line if this rank's GPU is too small."""
    if torch.cuda.is_available():
        shards = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
        error = gpu_budget_error(torch.cuda.mem_get_info()[1], torch.cuda.memory_allocated(), shards, engine_fraction,
                                 torch.cuda.current_device())
        if error:
            sys.exit(error)

def clip_grad_norm(model, max_norm):
    """Global grad norm, then scale the grads to at most max_norm (0: no clipping). The grads are FSDP2 shards
    (DTensors): each element lives on exactly one rank. Sums in float64: torch's fp32 clip_grad_norm_ was off by
    ~3e-5 relative here, and by a different amount per world size, which alone breaks 1-vs-2-rank equality."""
    local = [p.grad.to_local() for p in model.parameters() if p.grad is not None]
    sq = torch.stack([g.double().pow(2).sum() for g in local]).sum()
    dist.all_reduce(sq)
    norm = sq.sqrt().item()
    if max_norm > 0 and norm > max_norm:
        for g in local:
            g.mul_(max_norm / (norm + 1e-6))
    return norm

def selected_logits(model, ids, sel, attn=None, pos=None, pixels=None):
    """Logits [N, V] of only the N positions where sel [B, T-1] is True (position t predicts token t + 1).
    A pre-hook on lm_head keeps just those hidden states, so lm_head (with a 49k vocabulary the costliest matmul) runs
    on them alone; it acts inside the root forward, where FSDP has gathered lm_head. pixels: a VL batch's image
    inputs (rollout.VisionIO.pixels)."""
    head = model.get_output_embeddings()
    hook = head.register_forward_pre_hook(lambda mod, args: (args[0][:, :-1][sel][None],))  # [B, T, H] -> [1, N, H]
    try:
        return model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=False, **(pixels or {})).logits[0]
    finally:
        hook.remove()

def save_checkpoint(model, opt, tok, out, step, state, rank, keep=2, protect=None):
    """step_<N>/ (every rank takes part): the HF folder of the full weights (gathered to rank 0's host memory; what
    transformers and vLLM load), trainer/ the sharded model and optimizer state (torch.distributed.checkpoint: each
    rank writes its own shards, so no rank holds the whole optimizer state), trainer_state.pt (step, RNG and the
    script's `state`: data position, args, ...). All of it goes to .step_<N>.tmp, renamed when whole; then `latest`
    names it, and all but the newest `keep` step folders and `protect` (e.g. the best one's) are removed. tok saves the
    tokenizer files beside the weights (a VL model's processor: tokenizer, chat template and image processor)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict
    from rollout import auto_model
    out = Path(out)
    tmp, dst = out / f".step_{step}.tmp", out / f"step_{step}"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    msd, osd = get_state_dict(model, opt)  # this rank's shards
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp / "trainer"))
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))  # rank 0 only
    if rank == 0:
        cpu_model = auto_model(model.config).from_config(model.config, dtype=torch.float32)  # fresh, unsharded, tied like the original
        cpu_model.load_state_dict(full)  # strict: every key (lm_head too; when tied it is the same tensor)
        cpu_model.generation_config = model.generation_config
        cpu_model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        rng = dict(torch=torch.get_rng_state(), python=random.getstate(),
                   cuda=torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)
        torch.save(dict(step=step, rng=rng, **state), tmp / "trainer_state.pt")
        if dst.exists():
            shutil.rmtree(dst)
        os.replace(tmp, dst)
        corpus.write_atomic(out / "latest", f"step_{step}\n")
        for p in sorted(out.glob("step_*"), key=lambda p: int(p.name.split("_")[1]))[:-keep]:
            if p.name != protect:
                shutil.rmtree(p)
    dist.barrier()

def load_trainer_state(model, opt, ckpt, args, print0):
    """Restore the sharded model and optimizer state (each rank reads its own shards) and the RNG; returns the saved
    dict. trainer_state.pt is read with weights_only: tensors and plain data, so loading runs no pickled code."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    state = torch.load(Path(ckpt) / "trainer_state.pt", weights_only=True)
    msd, osd = get_state_dict(model, opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=str(Path(ckpt) / "trainer"))
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    if torch.cuda.is_available() and state["rng"]["cuda"] is not None:
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])
    changed = {k: (v, getattr(args, k)) for k, v in state["args"].items() if k != "resume" and getattr(args, k, v) != v}
    print0(f"resuming from {ckpt} at step {state['step']}" + (f"; changed args (old, new): {changed}" if changed else ""))
    return state

def full_params(model):
    """(name, full tensor) of every parameter, each all-gathered from its FSDP2 shards only when the consumer asks
    for it (a collective: every rank must iterate, in the same order), for the engine's streamed weight sync."""
    for name, p in model.named_parameters():
        yield name, (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()

class PeakMemory:
    """`with peak("update"):` records the phase's peak memory in GiB, in self.gib[phase]: on CUDA the peak of
    torch's allocated bytes (reset when the phase starts); on CPU this process's peak resident memory sampled every
    10 ms by a thread (it includes the in-process vLLM engine, whose memory on CPU is this process's)."""
    def __init__(self):
        self.gib, self.phase = {}, None

    def __call__(self, phase):
        self.phase = phase
        return self

    def __enter__(self):
        import threading
        import psutil
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
            return self
        proc, self.peak, self.done = psutil.Process(), 0, threading.Event()
        def sample():
            while not self.done.is_set():
                self.peak = max(self.peak, proc.memory_info().rss)
                self.done.wait(0.01)
        self.thread = threading.Thread(target=sample, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        if torch.cuda.is_available():
            self.gib[self.phase] = torch.cuda.max_memory_allocated() / 2**30
        else:
            self.done.set()
            self.thread.join()
            self.gib[self.phase] = self.peak / 2**30

def progress(rank, total, initial, desc):
    """A tqdm bar on rank 0 (None elsewhere)."""
    if rank != 0:
        return None
    from tqdm import tqdm
    return tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True)

def link_step(out, step, name):
    """<out>/<name> -> step_<step>, atomically (final, best)."""
    link, tmp = Path(out) / name, Path(out) / f".{name}.tmp"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(f"step_{step}")
    os.replace(tmp, link)

class Log:
    """log.jsonl + wandb (offline unless told otherwise), on rank 0 only; on resume keeps records up to `step`."""
    def __init__(self, out, rank, step, resume, mode, config, project="r1router-nano"):
        self.f, self.run = None, None
        if rank != 0:
            return
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        old = [json.loads(l) for l in open(out / "log.jsonl")] if resume and (out / "log.jsonl").exists() else []
        corpus.write_atomic(out / "log.jsonl", "".join(json.dumps(r) + "\n" for r in old if r["step"] <= step))
        self.f = open(out / "log.jsonl", "a")
        if mode != "disabled":
            import wandb
            self.run = wandb.init(project=project, mode=mode, config=config, dir=str(out))

    def __call__(self, record):
        if self.f:
            self.f.write(json.dumps(record) + "\n")
            self.f.flush()
        if self.run:
            self.run.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    def close(self):
        if self.f:
            self.f.close()
        if self.run:
            self.run.finish()
