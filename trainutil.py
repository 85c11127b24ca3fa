"""
trainutil.py: the FSDP2 set-up, checkpoints and logging that sft.py and stepgrpo.py share (and nothing else).

Same code with or without torchrun: a single process is an FSDP2 world of one (a gloo/nccl group over an in-memory
store), so the sharding, mixed-precision, state-dict and clipping paths are the ones a multi-rank run takes.
GPU: NCCL, flash-attn 2 when installed. CPU: gloo. Both: bf16 compute with fp32 master weights and fp32 gradient
reduction (--dtype bf16), or fp32 throughout (--dtype fp32); --dtype auto (the default) picks bf16 where the
hardware computes it natively (CUDA, AVX512-BF16 CPUs) and fp32 elsewhere.

Checkpoint layout (in --out):
    step_<N>/          Hugging Face folder (config, safetensors, tokenizer) that transformers and vLLM load as is,
                       + trainer_state.pt (full optimizer state, step, RNG, and the script's own data position, args)
    latest             text file naming the newest checkpoint folder, replaced atomically
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

def init_group(world):
    """Join the process group (alone: a gloo/nccl group of one over an in-memory store). Returns whether we made it:
    a caller's existing group (e.g. one an in-process vLLM made) is reused and left to its owner."""
    own = not dist.is_initialized()
    if own:
        kw = {} if "RANK" in os.environ else dict(store=dist.HashStore(), rank=0, world_size=1)
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", **kw)
    if dist.get_world_size() != world:
        sys.exit(f"error: the process group has {dist.get_world_size()} ranks but WORLD_SIZE says {world}")
    return own

def resolve_start(model, out, resume):
    """The folder to load weights from: --model, or with --resume the newest checkpoint in --out. Exits on bad input."""
    out, start = Path(out), Path(model)
    if resume:
        if not (out / "latest").is_file():
            sys.exit(f"error: --resume: no checkpoint in {out} ({out / 'latest'} not found)")
        start = out / (out / "latest").read_text().strip()
        if not (start / "trainer_state.pt").is_file():
            sys.exit(f"error: --resume: {start}/trainer_state.pt not found")
    if not (start / "config.json").is_file():
        sys.exit(f"error: {start}: not a model folder (no config.json)")
    return start

def resolve_dtype(dtype, device):
    """--dtype auto -> "bf16" on CUDA and on CPUs with native bf16 (AVX512-BF16), else "fp32": where bf16 is emulated
    (an AVX2-only EPYC) a SmolLM2 forward+backward of 2 x 384 tokens took 150 s in bf16 against 6 s in fp32."""
    if dtype != "auto":
        return dtype
    return "bf16" if device.type == "cuda" or torch.cpu._is_avx512_bf16_supported() else "fp32"

def load_sharded(path, device, world, activation_checkpointing=False, train=True, bf16=True, tree_mask=False):
    """fp32 master weights; each decoder layer is one FSDP unit, the root holds embeddings, final norm and lm_head.
    bf16: FSDP2 mixed precision, i.e. bf16 forward/backward compute, fp32 gradient reduction and optimizer state, on
    CPU as on GPU (on an AVX512-BF16 CPU 1.5x faster than fp32 for SmolLM2, without it ~25x slower: resolve_dtype;
    logprobs within ~2e-3 mean, ~0.3 max).
    tree_mask: the model will get 4D attention masks (stepgrpo --share_prefix), which SDPA takes and flash-attn not."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForCausalLM
    attn = "sdpa"
    if device.type == "cuda" and not tree_mask:
        try:
            import flash_attn  # noqa: F401
            attn = "flash_attention_2"
        except ImportError:
            pass
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attn).to(device)
    if activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    mesh = init_device_mesh(device.type, (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    model.train(train)
    if not train:
        model.requires_grad_(False)
    return model

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

def selected_logits(model, ids, sel, attn=None, pos=None):
    """Logits [N, V] of only the N positions where sel [B, T-1] is True (position t predicts token t + 1).
    A forward hook on the final norm keeps just those hidden states, so lm_head (with a 49k vocabulary the costliest
    matmul) runs on them alone; it acts inside the root forward, where FSDP has gathered lm_head."""
    hook = model.model.norm.register_forward_hook(lambda mod, inp, h: h[:, :-1][sel][None])  # [B, T, H] -> [1, N, H]
    try:
        return model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=False).logits[0]  # [N, V]
    finally:
        hook.remove()

def save_checkpoint(model, opt, tok, out, step, state, rank, keep=2, protect=None):
    """Gather the full state (all ranks take part), then rank 0 writes step_<N>/ via a temp folder + rename, and
    removes all but the newest `keep` step folders and `protect` (a folder name, e.g. the best one's).
    `state`: the script's own resumable state (data position, args, ...), saved in trainer_state.pt."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
    from transformers import AutoModelForCausalLM
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)  # rank 0 gets CPU tensors, the others {}
    sd = get_model_state_dict(model, options=full)
    osd = get_optimizer_state_dict(model, opt, options=full)
    out = Path(out)
    if rank == 0:
        cpu_model = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32)  # fresh, unsharded, tied like the original
        cpu_model.load_state_dict(sd)  # strict: every key (lm_head too; when tied it is the same tensor)
        cpu_model.generation_config = model.generation_config
        tmp, dst = out / f".step_{step}.tmp", out / f"step_{step}"
        shutil.rmtree(tmp, ignore_errors=True)
        cpu_model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        rng = dict(torch=torch.get_rng_state(), python=random.getstate(),
                   cuda=torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)
        torch.save(dict(optimizer=osd, step=step, rng=rng, **state), tmp / "trainer_state.pt")
        if dst.exists():
            shutil.rmtree(dst)
        os.replace(tmp, dst)
        corpus.write_atomic(out / "latest", f"step_{step}\n")
        for p in sorted(out.glob("step_*"), key=lambda p: int(p.name.split("_")[1]))[:-keep]:
            if p.name != protect:
                shutil.rmtree(p)
    dist.barrier()

def load_trainer_state(model, opt, ckpt, args, print0):
    """Restore optimizer and RNG (the weights came from the checkpoint folder itself); returns the saved dict."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
    state = torch.load(Path(ckpt) / "trainer_state.pt", weights_only=False)
    set_optimizer_state_dict(model, opt, state["optimizer"], options=StateDictOptions(full_state_dict=True))
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    if torch.cuda.is_available() and state["rng"]["cuda"] is not None:
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])
    changed = {k: (v, getattr(args, k)) for k, v in state["args"].items() if k != "resume" and getattr(args, k, v) != v}
    print0(f"resuming from {ckpt} at step {state['step']}" + (f"; changed args (old, new): {changed}" if changed else ""))
    return state

def full_state_dict(model):
    """The whole model's state dict, gathered from the FSDP2 shards onto every rank (for the engine's weight sync)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))

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
