"""
trainutil.py: the FSDP2 set-up, checkpoints and logging that sft.py and stepgrpo.py share (and
nothing else).

Same code with or without torchrun: a single process is a world of one (a gloo/nccl group over an
in-memory store), so the mixed-precision, state-dict and clipping paths are the ones a multi-rank
run takes. Its model is FSDP2's too, except at world size 1 without --offload or --quant
(load_sharded: there FSDP2 would only copy the whole model at every gather and reduce; in fp32 the
numbers are the same bit for bit, bf16 computes by autocast: plain_autocast).
GPU: NCCL, flash-attn 2 when installed (bf16 compute only). CPU: gloo. Both: bf16 compute with fp32
master weights and fp32 gradient reduction (--dtype bf16), or fp32 throughout (--dtype fp32);
--dtype auto (the default) picks bf16 where the hardware computes it natively (CUDA, AVX512-BF16
CPUs) and fp32 elsewhere. --device cuda refuses the CPU.

Checkpoint layout (in --out):
    step_<N>/          Hugging Face folder (config, safetensors, tokenizer) that transformers and
                       vLLM load as is,
                       + trainer/ (sharded trainable weights and optimizer state,
                         torch.distributed.checkpoint)
                       + trainer_state.pt (step, RNG, and the script's own data position, args)
                       LoRA (--lora_r): adapter/ (peft's save_pretrained, naming the --model base:
                       PeftModel.from_pretrained(base, "step_<N>/adapter"), or AutoPeftModel's
                       from_pretrained alone) instead of the full weights, except in the final (and
                       stepgrpo's best) checkpoint, which has the merged weights too; trainer/ then
                       holds the adapters and their optimizer state only
    .step_<N>.tmp/     a checkpoint being written (renamed to step_<N> when whole; never resumed
                       from)
    latest             text file naming the newest whole checkpoint folder, replaced atomically
    final -> step_<N>  symlink written at the end of training: `--model out/<run>/final`
    log.jsonl          one record per step (on --resume, records after the checkpoint are dropped)
"""
import contextlib
import json
import logging
import os
import random
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

import dataio
import transcript
from engines import auto_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# bitsandbytes (imported by peft) asks the hub for a CPU kernel on AVX512-BF16 machines and warns
# when offline; its own kernel is used instead
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)

def env_rank(device="auto"):
    """-> rank, world, device from torchrun's RANK/WORLD_SIZE/LOCAL_RANK (alone: a world of one),
    and print0.
    device (--device): auto takes CUDA when torch sees it, else the CPU; cuda exits when CUDA is
    missing, since a GPU job on a machine with a broken driver would otherwise train on the CPU for
    days; cpu stays off the GPUs. A torchrun environment that cannot restart exits here, before any
    work."""
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("error: --device cuda: torch sees no CUDA device (check nvidia-smi, the NVIDIA "
                 "driver and torch's CUDA build; --device cpu to train on the CPU)")
    if (os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0))):
        # torchrun's shared rendezvous store keeps the first attempt's keys: a restarted rank reads
        # the dead ranks' gloo or NCCL addresses and fails to connect (pytorch/pytorch#135712);
        # without sharing, each attempt gets a new store
        sys.exit("error: torchrun --max-restarts needs TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in "
                 "torchrun's environment")
    cuda = device != "cpu" and torch.cuda.is_available()
    rank, world, local_rank = (int(os.environ.get(k, d))
                               for k, d in (("RANK", 0), ("WORLD_SIZE", 1), ("LOCAL_RANK", 0)))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    print0 = lambda *a, **k: print(*a, **k, flush=True) if rank == 0 else None
    return rank, world, device, print0

def init_group(world, timeout_min=30, device=None):
    """Join the process group (alone: a gloo/nccl group of one over an in-memory store). Returns
    whether we made it: a caller's existing group (e.g. one an in-process vLLM made) is reused and
    left to its owner. timeout_min: how long a collective may wait (NCCL's default is 10; rank 0
    writing a 7B checkpoint's weights can take longer). device: this rank's (env_rank's; None: CUDA
    when available), which picks NCCL or gloo."""
    import datetime
    own = not dist.is_initialized()
    if own:
        kw = {} if "RANK" in os.environ else dict(store=dist.HashStore(), rank=0, world_size=1)
        cuda = torch.cuda.is_available() if device is None else device.type == "cuda"
        dist.init_process_group("nccl" if cuda else "gloo",
                                timeout=datetime.timedelta(minutes=timeout_min), **kw)
    if dist.get_world_size() != world:
        sys.exit(f"error: the process group has {dist.get_world_size()} ranks but WORLD_SIZE says "
                 f"{world}")
    return own

def resolve_start(model, out, resume, lora=False):
    """-> (checkpoint folder, weights folder, whether this run resumes): --model, or with --resume
    the newest whole checkpoint in --out (`latest` names a checkpoint only once it is complete, so
    an interrupted save is never the one resumed from). --resume auto resumes when there is a
    checkpoint and starts from --model otherwise: a job that is restarted after a failure picks up
    where it stopped. The weights folder is the checkpoint, except for a LoRA run's, whose base is
    --model (the checkpoint's trainer state holds the adapters). Exits on bad input."""
    out, start = Path(out), Path(model)
    resuming = resume == "yes" or (resume == "auto" and (out / "latest").is_file())
    if resume is None and ((out / "latest").is_file() or (out / "log.jsonl").is_file()
                           or any(out.glob("step_*"))):
        sys.exit(f"error: {out} holds a run already: pass --resume to continue it, or remove the "
                 f"folder (or choose another --out) to start over")
    if resuming:
        if not (out / "latest").is_file():
            sys.exit(f"error: --resume: no checkpoint in {out} ({out / 'latest'} not found)")
        start = out / (out / "latest").read_text().strip()
        if not (start / "trainer_state.pt").is_file():
            sys.exit(f"error: --resume: {start}/trainer_state.pt not found")
        if (start / "adapter").is_dir() != lora:
            sys.exit(f"error: --resume: {start} is {'a LoRA' if not lora else 'not a LoRA'} "
                     f"checkpoint but --lora_r is {'0' if not lora else 'set'}; resume with the "
                     f"run's own flags")
    weights = Path(model) if resuming and lora else start
    # the scripts run offline (HF_HUB_OFFLINE): a Hub name (org/name) is not a folder
    if not weights.exists():
        hub = (len(weights.parts) == 2 and not weights.is_absolute()
               and not Path(weights.parts[0]).is_dir())
        sys.exit(f"error: {weights}: not a model folder (no such folder" + (
            f"; a Hub model must be downloaded first: hf download {weights} --local-dir "
            f"models/{weights.name}, then --model models/{weights.name}" if hub else "") + ")")
    if not (weights / "config.json").is_file():
        hint = (": LoRA adapters of an unfinished run (resume it, or start from its final "
                "checkpoint)" if (weights / "adapter").is_dir() else " (no config.json)")
        sys.exit(f"error: {weights}: not a model folder{hint}")
    return start, weights, resuming

def resolve_dtype(dtype, device):
    """--dtype auto -> "bf16" on CUDA and on CPUs with native bf16 (AVX512-BF16), else "fp32": where
    bf16 is emulated (an AVX2-only EPYC) a SmolLM2 forward+backward of 2 x 384 tokens took 150 s in
    bf16 against 6 s in fp32."""
    if dtype != "auto":
        return dtype
    return "bf16" if device.type == "cuda" or torch.cpu._is_avx512_bf16_supported() else "fp32"

def device_kind(device):
    """What a run computes on, for its first line and its timings: "cuda" (the GPU's name), or the
    CPU's vector unit, which sets the speed (an AVX512-BF16 CPU trains in bf16 about twice as fast
    as an AVX2-only one in fp32)."""
    if device.type == "cuda":
        return f"cuda, {torch.cuda.get_device_name(device)}"
    bf16 = "+BF16" if torch.cpu._is_avx512_bf16_supported() else ", no native bf16"
    return f"cpu, {torch.backends.cpu.get_cpu_capability()}{bf16}"

def blocks(model):
    """The repeated blocks of a model, each one FSDP unit: the elements of its outermost
    nn.ModuleLists (a causal LM's decoder layers; a VL model's vision-encoder layers too: Idefics3's
    encoder layers, Qwen2.5-VL's vision blocks)."""
    out, inside = [], set()
    for m in model.modules():
        if isinstance(m, torch.nn.ModuleList) and id(m) not in inside:
            out += list(m)
            inside.update(id(x) for b in m for x in b.modules())
    return out

@dataclass
class Lora:
    """LoRA adapters (peft) on a frozen base: rank r, scale alpha / r, dropout, target modules
    ("all-linear": every linear layer but the output head, in the decoder and, in a VL model, the
    vision tower and connector), and the base's storage: quant "none" (fp32 master), or bitsandbytes
    "nf4" / "int8" (QLoRA)."""
    r: int
    alpha: float = 32.0
    dropout: float = 0.0
    targets: tuple = ("all-linear",)
    quant: str = "none"

def lora_of(r, quant="none", alpha=None, dropout=0.0, targets=("all-linear",)):
    """A script's LoRA flags -> Lora, or None (--lora_r 0: full fine-tuning); alpha None: 2 r. Exits
    on flags that cannot work."""
    if r < 0:
        sys.exit(f"error: --lora_r {r}: a rank is a positive number (0: full fine-tuning)")
    if not r:
        if quant != "none":
            sys.exit(f"error: --quant {quant} quantises a frozen base: it needs LoRA adapters "
                     f"(--lora_r)")
        return None
    if quant != "none":
        try:
            import bitsandbytes  # noqa: F401
        except ImportError:
            sys.exit(f"error: --quant {quant} needs bitsandbytes (pip install bitsandbytes)")
    return Lora(r, 2.0 * r if alpha is None else alpha, dropout, tuple(targets), quant)

def add_lora(model, lora):
    """model -> peft model with fresh adapters (A seeded the same on every rank and on the meta
    device; B = 0, so the adapted model starts equal to the base). Only the adapters require
    gradients. lora: a Lora, or a peft LoraConfig as is (a fork's own options); one whose merge is
    not policy_params' is refused (refuse_unmergeable). peft names the base after the model's
    config: the folder it was read from, the run's --model."""
    from peft import LoraConfig, get_peft_model
    if isinstance(lora, LoraConfig):
        cfg, targets = lora, lora.target_modules
    else:
        targets = " ".join(lora.targets)
        cfg = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                         target_modules=targets if lora.targets == ("all-linear",)
                         else list(lora.targets))
    with torch.random.fork_rng(devices=[]):  # the adapters' init leaves training's RNG stream alone
        torch.manual_seed(0)
        try:
            model = get_peft_model(model, cfg)
        except ValueError as e:  # e.g. a target module name the model does not have
            sys.exit(f"error: --lora_targets {targets}: {str(e).splitlines()[0]}")
    refuse_unmergeable(model)
    return model

# The LoraConfig fields policy_params' merge W + scaling B A follows: which layers, their rank and
# scale (peft's scaling holds alpha / r, rsLoRA's alpha / sqrt(r), the patterns' per layer), the
# dropout (training only) and peft's bookkeeping. Any other field away from its default changes
# what a layer computes (DoRA's magnitude, lora_bias, fan_in_fan_out's transpose, modules_to_save's
# copies) or the base itself (PiSSA's init rewrites W: the adapter folder's base would not be it)
MERGEABLE = {"r", "lora_alpha", "lora_dropout", "target_modules", "exclude_modules", "use_rslora",
             "rank_pattern", "alpha_pattern", "layers_to_transform", "layers_pattern",
             "base_model_name_or_path", "revision", "task_type", "inference_mode", "peft_type",
             "peft_version", "auto_mapping"}

def refuse_unmergeable(model):
    """Exit with one line unless the peft model's adapters are plain LoRA, one adapter named
    "default" on Linear layers: policy_params merges each layer as W + scaling B A by hand across
    FSDP2's shards, and anything else (DoRA, lora_bias, LoRA on an embedding or a convolution)
    would reach the engine, and the merged export, as silently wrong weights."""
    import dataclasses
    from peft import PeftType
    from peft.tuners.lora import LoraLayer
    why = "unsupported: trainutil.policy_params merges plain LoRA only (W + scaling B A)"
    if set(model.peft_config) != {"default"}:
        sys.exit(f"error: LoRA adapters {sorted(model.peft_config)}: {why}, one adapter named "
                 f"'default'")
    cfg = model.peft_config["default"]
    if cfg.peft_type != PeftType.LORA:
        sys.exit(f"error: LoRA variant {cfg.peft_type.value}: {why}")
    for f in dataclasses.fields(cfg):
        default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
        if f.name not in MERGEABLE and getattr(cfg, f.name) != default:
            sys.exit(f"error: LoRA config {f.name}={getattr(cfg, f.name)!r}: {why}")
    for name, m in model.get_base_model().named_modules():
        base = m.get_base_layer() if isinstance(m, LoraLayer) else None
        if base is not None and not isinstance(base, torch.nn.Linear):
            sys.exit(f"error: LoRA on {name} ({type(base).__name__}): {why}, on Linear layers")

def is_quantized(p):
    """A bitsandbytes-quantised parameter (FSDP2 leaves these out: each rank holds them whole)."""
    return type(p).__name__ in ("Params4bit", "Int8Params")

def attention(device, bf16, tree_mask=False, flex=False):
    """The attention implementation: FlexAttention for tree masks given as block masks (flex);
    flash-attn 2 when installed, on CUDA with bf16 compute only (it has no fp32 kernels: --dtype
    fp32 would raise in the first forward) and without 4D masks (tree_mask); else SDPA."""
    if tree_mask and flex:
        return "flex_attention"
    if device.type != "cuda" or not bf16 or tree_mask:
        return "sdpa"
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return "sdpa"
    return "flash_attention_2"

def load_sharded(path, device, world, activation_checkpointing=False, train=True, bf16=True,
                 tree_mask=False, lora=None, value_head=False, offload=False, flex=False):
    """fp32 master weights; each block (blocks(): decoder layers, vision-encoder layers) is one FSDP
    unit, the root holds the rest (embeddings, final norm, lm_head; a VL model's patch embedding and
    connector).
    Only rank 0 reads the checkpoint into host memory (one full fp32 copy, 28 GiB at 7B, not one per
    rank); every rank builds the model on the meta device, shards it, allocates its shards on
    `device`, and receives them from rank 0 (set_model_state_dict(broadcast_from_rank0=True));
    buffers outside the state dict (RoPE's inv_freq) likewise.
    bf16: FSDP2 mixed precision, i.e. bf16 forward/backward compute, fp32 gradient reduction and
    optimizer state, on CPU as on GPU (resolve_dtype says where it is native).
    tree_mask: the model will get 4D attention masks (stepgrpo's packed groups), which SDPA takes
    and flash-attn not; with flex, as FlexAttention block masks (grpo.tree_block_mask).
    lora: a Lora, adapters on the frozen base (the same sharding; only the adapters get gradients
    and Adam state).
    value_head: PPO's critic, the model with its LM head swapped for a scalar head (to_critic;
    trained with LoRA too). With a quantised base every rank reads the checkpoint and quantises it
    itself (bitsandbytes quantises on load), and keeps the quantised weights whole (4.5 GiB at 7B in
    nf4); the rest is sharded as above.
    offload (--offload): FSDP2's CPUOffloadPolicy (offload_policy), the shards, their gradients and
    so the optimizer step in host memory (pinned on CUDA), each unit copied to `device` for its
    forward and backward only (the buffers stay on `device`). The shards are in host memory before
    they are filled: to_empty makes each unit's on `device`, and FSDP2 copies them to pinned host
    memory at once (FSDPParam.reset_sharded_param, torch 2.13); the broadcast then sends each whole
    parameter on `device` (NCCL needs it), and every rank copies it to host memory, then its slice
    into its shard (torch/distributed/_state_dict_utils.py, _broadcast_tensors)."""
    if offload and lora and lora.quant != "none":
        sys.exit("error: --offload moves FSDP2's shards to host memory, and a quantised base "
                 "(--quant) is kept whole on each GPU, not sharded: use one or the other")
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from transformers import AutoConfig, BitsAndBytesConfig
    auto, attn = auto_model(path), attention(device, bf16, tree_mask, flex)
    quant = lora.quant if lora else "none"
    full, buffers, generation_config = {}, {}, None
    if quant != "none":
        q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                               bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=torch.bfloat16 if bf16 else torch.float32) \
            if quant == "nf4" else BitsAndBytesConfig(load_in_8bit=True)
        model = auto.from_pretrained(path, dtype=torch.float32, attn_implementation=attn,
                                     quantization_config=q, device_map={"": device})
    else:
        if dist.get_rank() == 0:
            src = auto.from_pretrained(path, dtype=torch.float32, attn_implementation=attn)
            src = to_critic(src) if value_head else src
            src = add_lora(src, lora) if lora else src
            full, buffers = src.state_dict(), dict(src.named_buffers())
            generation_config = src.generation_config
        with torch.device("meta"):
            model = auto.from_config(AutoConfig.from_pretrained(path), dtype=torch.float32,
                                     attn_implementation=attn)
            model = to_critic(model) if value_head else model
    if quant != "none" and value_head:
        model = to_critic(model)
    if activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = add_lora(model, lora) if lora else model
    if value_head and lora:  # peft froze everything but the adapters: the new head trains too
        model.get_output_embeddings().requires_grad_(True)
    # world size 1 without offload: the plain module, as transformers' own loop has it (a shard
    # would be the whole parameter, gathered and reduced by copies: 1 s of an 8 s SFT step on the
    # CPU); bf16 compute by autocast (plain_autocast)
    plain = world == 1 and not offload and quant == "none"
    if not plain:
        shard(model, device, world, bf16, offload, train)
    if quant == "none":
        model.to_empty(device=device)
        if plain:  # to_empty made the tied head and embeddings two tensors (FSDP2 keeps them one)
            model.tie_weights()
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True,
                                                                   broadcast_from_rank0=True))
        for name, b in model.named_buffers():
            if dist.get_rank() == 0:
                b.copy_(buffers[name])
            dist.broadcast(b, src=0)
        if dist.get_rank() == 0:
            model.generation_config = generation_config
    if plain and bf16:
        plain_autocast(model, device)
    if offload:  # no-op for shards to_empty pinned (above); any an unpinned policy left on `device`
        model.to("cpu")  # go to host memory, and the buffers, moved with them, back to `device`
        for b in model.buffers():
            b.data = b.data.to(device)
    # FlexAttention: transformers compiles it anew whenever a forward's training flag is not the
    # last one's (integrations/flex_attention.py, WrappedFlexAttention), so a frozen reference in
    # eval mode beside the policy recompiled at every switch until Dynamo's limit (8) left it eager
    # (the whole score matrix): without dropout the mode changes nothing, so it runs the policy's
    frozen_flex = not train and attn == "flex_attention"
    if frozen_flex and has_dropout(model):
        sys.exit(f"error: --flex_attention: {path} has dropout, so its frozen copy (the KL "
                 "reference) cannot run in training mode, and FlexAttention would recompile at "
                 "every switch between it and the policy: drop --flex_attention")
    model.train(train or frozen_flex)
    if not train:
        model.requires_grad_(False)
    return model

def plain_autocast(model, device):
    """A plain module's bf16 compute: its forward under torch.autocast (the weights fp32, the
    masters; matmuls and attention in bf16, each weight cast as it is used, norms and the residual
    stream in fp32), as a transformers user's loop has it. FSDP2's mixed precision (world > 1)
    casts every weight and activation to bf16 instead: the same bf16 matmuls, other rounding
    around them. No cache of the casts (cache_enabled=False): a no-grad forward (the sync check,
    the old and the reference logprobs) holds one bf16 weight at a time, not the whole model's."""
    model.forward = torch.autocast(device.type, torch.bfloat16, cache_enabled=False)(model.forward)

def has_dropout(model):
    """Whether a forward in training mode drops anything: an nn.Dropout with p > 0, or an
    attention's own rate (transformers' attention modules keep it as a float)."""
    return any((isinstance(m, torch.nn.Dropout) and m.p > 0)
               or float(getattr(m, "attention_dropout", 0.0) or 0.0) > 0 for m in model.modules())

def shard(model, device, world, bf16, offload, train):
    """FSDP2 over `model` (load_sharded's): each block a unit, the root the rest; a quantised base's
    weights are kept whole (ignored)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16
          else MixedPrecisionPolicy())
    kw = dict(mesh=init_device_mesh(device.type, (world,)), mp_policy=mp,
              ignored_params={p for p in model.parameters() if is_quantized(p)},
              offload_policy=offload_policy(device, offload))
    # world size 1: the blocks stay gathered from their forward to the step's last backward
    # (accumulate)
    gathered = train and world == 1 and not offload
    for block in blocks(model):
        fully_shard(block, **kw, reshard_after_forward=False if gathered else None)
    # the root (embeddings, final norm, head) stays gathered after a forward until a backward
    # reshards it; a frozen model (the KL reference) never runs one, so its root reshards after
    # every forward (+2.2 GB a GPU at 7B)
    fully_shard(model, **kw, reshard_after_forward=True if not train else None)

def offload_policy(device, offload):
    """FSDP2's offload policy for units that compute on `device`: with offload CPUOffloadPolicy,
    pinned on CUDA (asynchronous copies to and from the GPU, and the shards moved to host memory as
    soon as to_empty makes them), unpinned on the CPU (pinning needs an accelerator); else none."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy
    return CPUOffloadPolicy(pin_memory=device.type == "cuda") if offload else OffloadPolicy()

def to_critic(model):
    """The causal LM with its LM head replaced by a scalar value head (untied from the embeddings),
    initialised as verl's critic head (transformers' token-classification head: weight N(0, 0.02),
    bias 0) from a fixed seed, the same on every rank; selected_logits returns values [N, 1]. Not
    zeros: a zero head moves each value by at most lr x |h|_1 an update, and its gradient reaches
    the backbone only through the head."""
    head = model.get_output_embeddings()
    value = torch.nn.Linear(head.in_features, 1, device=head.weight.device, dtype=head.weight.dtype)
    if value.weight.device.type != "meta":
        g = torch.Generator(device=value.weight.device).manual_seed(0)
        torch.nn.init.normal_(value.weight, std=0.02, generator=g)
        torch.nn.init.zeros_(value.bias)
    model.config.tie_word_embeddings = False
    model.set_output_embeddings(value)
    return model

GIB = 2**30
NORM_BLOCK = 2**18  # elements a float64 block of clip_grad_norm's sums on the CPU (2 MiB)

def compute_device(model):
    """The device a sharded `model` computes on: its parameters', or with --offload (its shards in
    host memory) its device mesh's, this process's GPU."""
    p = next(model.parameters())
    kind = getattr(getattr(p, "device_mesh", None), "device_type", p.device.type)
    if kind == p.device.type:
        return p.device
    return torch.device(kind, torch.cuda.current_device()) if kind == "cuda" else torch.device(kind)

def pack(rows, budget, size):
    """rows in micro-batches of at most `budget` tokens, size(row) a row's (a longer row alone), in
    order (sft.py's --pack_tokens, stepgrpo.py's --micro_tokens)."""
    out, n = [], budget
    for row in rows:
        if n + size(row) > budget:
            out.append([])
            n = 0
        out[-1].append(row)
        n += size(row)
    return out

def local(t):
    """This rank's shard of an FSDP2 parameter or gradient (a DTensor), or a plain module's tensor
    itself."""
    return t.to_local() if hasattr(t, "to_local") else t

def full(t):
    """An FSDP2 parameter or gradient gathered whole (a collective: every rank calls it), or a plain
    module's tensor itself."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t

def accumulate(model, last):
    """Before each micro-batch's backward of an optimizer step (last: the step's last). At world
    size 1 without --offload the gradients accumulate unreduced and the blocks stay gathered until
    the last backward: a step gathers and reduces each parameter once, not once a micro-batch
    (FSDP2's gather and reduce at world size 1 are copies of the whole model). The sum is the same:
    each micro-batch's gradient added in turn, in fp32. At larger worlds, or offloaded, nothing
    changes: unreduced gradients would hold a whole model's on each rank; nor for a model FSDP2 does
    not hold (load_sharded's plain module: autograd accumulates its gradients as they come)."""
    from torch.distributed.fsdp import FSDPModule
    p = next(model.parameters())
    if isinstance(model, FSDPModule) and dist.get_world_size() == 1 \
            and p.device == compute_device(model):
        model.set_requires_gradient_sync(last)
        model.set_reshard_after_backward(last)

def clip_grad_norm(model, max_norm):
    """Global grad norm, then scale the grads to at most max_norm (0: no clipping). The grads are
    FSDP2 shards (DTensors; local()): each element lives on exactly one rank. Each shard's squares
    sum in float64 (square_sum): torch's fp32 clip_grad_norm_ was off by ~3e-5 relative here, and
    by a different amount per world size, which alone breaks 1-vs-2-rank equality."""
    grads = [local(p.grad) for p in model.parameters() if p.grad is not None]
    # offload: NCCL's GPU
    sq = torch.stack([square_sum(g) for g in grads]).sum().to(compute_device(model))
    dist.all_reduce(sq)
    norm = sq.sqrt().item()
    if max_norm > 0 and norm > max_norm:
        for g in grads:
            g.mul_(max_norm / (norm + 1e-6))
    return norm

def square_sum(g):
    """The float64 sum of g's squares, in blocks: vector_norm with a float64 dtype copies its input
    to float64 first, and a whole gradient's copy (8 bytes an element, fresh memory each time) cost
    0.05-0.4 s a step at 135M on the CPU, blocks of NORM_BLOCK elements 0.045 s; on a GPU, where
    each block is a kernel launch, blocks of 2**24 (128 MiB)."""
    blocks = g.reshape(-1).split(NORM_BLOCK if g.device.type == "cpu" else 2**24)
    norms = [torch.linalg.vector_norm(b, dtype=torch.float64) for b in blocks]
    return torch.stack(norms).square().sum()

def sync_weights(model, engine, rows, pad_id, peak, check, dtype):
    """The policy's new weights into this rank's engine (stepgrpo.py's weight sync), and after this
    process's first update and where `check` says (stepgrpo.py: at every checkpoint) the engine's
    logprobs of a row against the trainer's (sync_gap; exits above sync_tol). The trainer scores
    the row first, while the engine still sleeps (the weights are final after the optimizer step),
    and lets go of what its forward gathered: on a GPU that forward's weights and logits never sit
    beside the woken engine (memory.gpu_budget's sync check phase). peak: a memory.PeakMemory.
    Returns the timings (sync_s; sync_mean_diff and sync_max_diff where checked)."""
    check = check or "sync" not in peak.gib  # gib: the phases run so far
    with peak("sync"):
        if check:  # no rows: a stand-in (the check's all-reduce is a collective)
            row = sync_row(rows[0] if rows else dict(ids=[pad_id] * 2), engine.max_len)
            mine = trainer_logprobs(model, row, engine.vis)
        t = time.perf_counter()
        engine.sync_weights(policy_params(model))
        timing = dict(sync_s=time.perf_counter() - t)
    if check:
        gap, top = sync_gap(engine, row, mine)
        timing.update(sync_mean_diff=gap, sync_max_diff=top)
        tol = sync_tol(dtype, engine)
        if not gap <= tol:  # NaN fails too
            sys.exit(f"error: after the weight sync the engine's logprobs differ from the "
                     f"trainer's by {gap:.3g} on average (tolerance {tol:g}): the engine does not "
                     "sample from the policy being trained")
    return timing

def sync_tol(dtype, engine):
    """The largest mean |engine - trainer| logprob a sync may leave, by precision. fp32 trainer and
    engine: 1e-3, 10x above a correct sync's gap (< 1e-4 in the tests, 9.5e-7 in docs/LOG.md). bf16
    on either side: 0.2. Rounding alone moves logprobs there: SmolLM2-135M in bf16, vLLM on CPU
    against the trainer, over 8 whole transcripts, a mean of 0.04-0.05 nats, a max of 0.75-1.6 on
    tokens of logprob -10 to -30 (docs/LOG.md); so the max is no test, the mean is. A broken sync (a
    parameter missing, uninitialised or another layer's) is off by nats on average."""
    return 1e-3 if dtype == "fp32" and engine.dtype == "float32" else 0.2

SYNC_CHUNK = 256  # positions a slice of the sync check's fp32 log-softmax (2 x 256 x 152k x 4 B
                  # = 0.3 GiB at Qwen2.5's vocabulary)

def sync_row(row, max_len):
    """What the sync check scores of a rollout row: a transcript the engine takes. A packed group
    (grpo.pack_group: the prompt, then each completion as a branch) gives its prompt and first
    completion: the whole row is no one text, and longer than the engine's context. A row longer
    than the engine takes (max_len - 1 tokens: a prompt leaves room for one new one; None: no
    limit) is cut, before a picture the cut would go through."""
    ids, images = row["ids"], row.get("images", [])
    if "seg" in row:  # -1: the prompt, 0: the first branch
        ids = [t for t, s in zip(ids, row["seg"]) if s <= 0]
    cut = len(ids) if max_len is None else min(len(ids), max_len - 1)
    for start, n, _ in images:
        if start < cut < start + n:
            cut = start
    return dict(ids=ids[:cut], images=[im for im in images if im[0] + im[1] <= cut])

def trainer_logprobs(model, row, vis=None):
    """The sync check's trainer side: the logprob [T-1] of every token of row["ids"] after the
    first (a VL row's pictures: vis, the engine's VisionIO), the log-softmax in slices of
    SYNC_CHUNK positions (never a [T-1, V] fp32 copy beside the logits); then every FSDP2 unit
    resharded (reshard), since no backward follows before the next rollout."""
    device = compute_device(model)
    ids, images = row["ids"], row.get("images", [])
    with torch.no_grad():
        x = torch.tensor([ids], device=device)
        pix = vis.pixels([images], device, x, always=True) if vis else {}
        sel = torch.ones(1, len(ids) - 1, dtype=torch.bool, device=device)
        logits = selected_logits(model, x, sel, torch.ones(1, len(ids), device=device),
                                 pixels=pix)  # [T-1, V], the compute dtype
        mine = torch.cat([logits[k:k + SYNC_CHUNK].float().log_softmax(-1)
                          .gather(-1, x[0, k + 1:k + 1 + SYNC_CHUNK, None])[:, 0]
                          for k in range(0, len(ids) - 1, SYNC_CHUNK)])  # [T-1]
    reshard(model)
    return mine

def reshard(model):
    """Free what FSDP2 keeps gathered after no-grad forwards, for a model no backward follows
    before the next rollout: the root's (it reshards after a backward only), at world size 1 the
    blocks' too (accumulate). A plain module: nothing."""
    from torch.distributed.fsdp import FSDPModule
    for unit in model.modules():
        if isinstance(unit, FSDPModule):
            unit.reshard()

def sync_gap(engine, row, mine):
    """The weight sync's check: the mean and the max |engine - trainer| logprob over every token of
    the row after the first (the prompt's image tokens included), mine: the trainer's
    (trainer_logprobs); the mean over ranks and the max over ranks."""
    got = torch.tensor(engine.prompt_logprobs(row["ids"], row["images"]), device=mine.device)
    diff = (got - mine).abs()  # [T-1]
    mean, top = diff.mean().reshape(1), diff.max().reshape(1)
    dist.all_reduce(mean)
    dist.all_reduce(top, op=dist.ReduceOp.MAX)
    return mean.item() / dist.get_world_size(), top.item()

def selected_logits(model, ids, sel, attn=None, pos=None, pixels=None):
    """Logits [N, V] of only the N positions where sel [B, T-1] is True (position t predicts token
    t + 1). A pre-hook on lm_head keeps just those hidden states, so lm_head (with a 49k vocabulary
    the costliest matmul) runs on them alone; it acts inside the root forward, where FSDP has
    gathered lm_head. pixels: a VL batch's image inputs (vision.VisionIO.pixels); their "dummy"
    picture goes through the vision tower with weight 0 in a hook on the token embeddings
    (zero_vision_term), the point of the forward where the model runs its own pictures, so every
    rank enters the vision blocks' all-gathers (forward) and reduce-scatters (backward) in the same
    order."""
    pixels = dict(pixels or {})
    dummy = pixels.pop("dummy", None)
    head = model.get_output_embeddings()
    # [B, T, H] -> [1, N, H]
    hooks = [head.register_forward_pre_hook(lambda mod, args: (args[0][:, :-1][sel][None],))]
    if dummy is not None:
        hooks.append(model.get_input_embeddings().register_forward_hook(
            lambda mod, args, out: out + zero_vision_term(model, dummy)))
    try:
        return model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=False,
                     **pixels).logits[0]
    finally:
        for h in hooks:
            h.remove()

def zero_vision_term(model, dummy):
    """0 x the sum of every output of the vision tower and connector on the dummy picture's inputs
    (a scalar): it changes no logit and no gradient (the vision weights' is exactly 0), but the rank
    has run the vision tower, as a rank whose batch has pictures does (verl's and TRL's fix,
    transformers#37186). The model's forward never sees the dummy: no image token, image_grid_thw or
    mm_token_type_ids, so positions (Qwen's 3-D RoPE) are a text batch's."""
    # last_hidden_state, pooler_output (the connector's)
    out = model.get_image_features(**dummy, return_dict=True)
    # Qwen: a tensor an image
    parts = [v for x in out.values() for v in (x if isinstance(x, (list, tuple)) else [x])]
    return 0.0 * sum(v.float().sum() for v in parts)

def save_checkpoint(model, opt, tok, out, step, state, rank, keep=2, protect=None, merged=True,
                    fmt=None, crit=None):
    """step_<N>/ (every rank takes part): the HF folder of the policy's full weights (gathered to
    rank 0's host memory; what transformers and vLLM load), trainer/ the sharded trainable weights
    and optimizer state (torch.distributed.checkpoint: each rank writes its own shards, so no rank
    holds the whole optimizer state), trainer_state.pt (step, RNG and the script's `state`: data
    position, args, ...). A LoRA policy's folder holds its adapters in peft's format, and its merged
    weights only if `merged` (they are as large as a full checkpoint). All of it goes to
    .step_<N>.tmp, renamed when whole; then `latest` names it, and all but the newest `keep` step
    folders and `protect` (e.g. the best one's) are removed. tok saves the tokenizer files beside
    the weights (a VL model's processor: tokenizer, chat template and image processor); fmt, the
    transcript.format_meta the policy was trained on, goes to transcript.FORMAT (None: unknown,
    nothing written). crit: PPO's (critic, its optimizer), whose shards go to trainer/ too."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    out, lora = Path(out), hasattr(model, "peft_config")
    tmp, dst = out / f".step_{step}.tmp", out / f"step_{step}"
    need = (checkpoint_bytes(model, export=merged or not lora)
            + (checkpoint_bytes(crit[0], export=False) if crit else 0))
    error = disk_error(out, need, step)
    # every rank checks its own disk (several nodes: each writes its shards), so none waits at a
    # barrier
    if error:
        sys.exit(error)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    # this rank's shards
    dcp.save(trainer_state(model, opt, crit), checkpoint_id=str(tmp / "trainer"))
    if lora:
        # a collective: the adapters gathered whole into rank 0's host memory (empty elsewhere)
        sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                  cpu_offload=True,
                                                                  ignore_frozen_params=True))
        # a folder of its own: transformers would read adapter files beside weights as "load the
        # base". peft's own writer, given the gathered weights so that it reads no shard: the
        # folder peft and the Hub load (the base's folder and class, inference mode, safetensors
        # marked "pt"); the embeddings are never adapted (refuse_unmergeable), so it need not look
        # for the base's config to compare vocabularies
        if rank == 0:
            model.save_pretrained(tmp / "adapter", state_dict=sd, save_embedding_layers=False)
    if merged or not lora:
        export_hf(model, tmp, rank)
    cuda = [None] * dist.get_world_size()  # each rank's own accelerator generator, by rank
    dist.all_gather_object(cuda, device_rng(model))
    if rank == 0:
        tok.save_pretrained(tmp)
        if fmt:
            (tmp / transcript.FORMAT).write_text(json.dumps(fmt) + "\n")
        rng = dict(torch=torch.get_rng_state(), python=random.getstate(), cuda=cuda)
        torch.save(dict(step=step, rng=rng, **state), tmp / "trainer_state.pt")
        if dst.exists():
            shutil.rmtree(dst)
        os.replace(tmp, dst)
        dataio.write_atomic(out / "latest", f"step_{step}\n")
        for p in sorted(out.glob("step_*"), key=lambda p: int(p.name.split("_")[1]))[:-keep]:
            if p.name != protect:
                shutil.rmtree(p)
    dist.barrier()

def checkpoint_bytes(model, export=True):
    """About what one step_<N>/ takes on disk: the trainable weights and AdamW's two moments (fp32),
    in trainer/, and with export the whole policy in fp32 (the HF folder)."""
    trainable = sum(p.numel() * (p.element_size() + 8) for p in model.parameters()
                    if p.requires_grad)
    # DTensor: the global numel
    return trainable + (4 * sum(p.numel() for p in model.parameters()) if export else 0)

def disk_error(out, need, step):
    """The one-line error when the disk holding `out` has less than `need` bytes free for step
    <step>'s checkpoint (a write that would fail half-way through; the checkpoints before it stay
    whole), else None."""
    free = shutil.disk_usage(out if Path(out).exists() else Path(out).parent).free
    if free >= need:
        return None
    latest = Path(out) / "latest"
    last = latest.read_text().strip() if latest.is_file() else "none yet"
    size = lambda b: f"{b / GIB:.1f} GiB" if b >= GIB else f"{b / 2**20:.0f} MiB"  # noqa: E731
    return (f"error: {out}: {size(free)} free, step {step}'s checkpoint needs ~{size(need)} (the "
            f"last whole checkpoint: {last}); free space (or lower --keep) and rerun with --resume "
            f"auto")

def export_hf(model, folder, rank):
    """The policy's effective weights (policy_params: LoRA merged, a quantised base dequantised) as
    an HF folder on rank 0, in fp32, of the base model's class and config (no quantisation config):
    transformers and vLLM load it."""
    import copy
    # a collective: every rank
    full = {name: t.cpu() if rank == 0 else None for name, t in policy_params(model)}
    if rank != 0:
        return
    config = copy.deepcopy(model.config)
    config.__dict__.pop("quantization_config", None)
    # fresh, unsharded, tied like the original
    cpu_model = auto_model(config).from_config(config, dtype=torch.float32)
    missing, unexpected = cpu_model.load_state_dict(full, strict=False)
    # a tied head is an alias, not a parameter of its own
    params = {n for n, _ in cpu_model.named_parameters()}
    assert not unexpected and set(missing).isdisjoint(params), (missing, unexpected)
    cpu_model.generation_config = model.generation_config
    cpu_model.save_pretrained(folder)

def trainable_state(model, opt):
    """This rank's shards of the trainable weights and of the optimizer state: what trainer/ holds
    (LoRA: the adapters; ignore_frozen_params alone would keep a frozen tied head, which is not a
    parameter of its own)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(ignore_frozen_params=True))
    trainable = {n.removeprefix("_orig_mod.") for n, p in model.named_parameters()
                 if p.requires_grad}
    return {k: v for k, v in msd.items() if k in trainable}, osd

def trainer_state(model, opt, crit=None):
    """What trainer/ holds: this rank's shards of the policy's trainable weights and optimizer
    state, and of the critic's (crit: (critic, its optimizer))."""
    msd, osd = trainable_state(model, opt)
    out = {"model": msd, "optim": osd}
    if crit:
        out["critic"], out["critic_optim"] = trainable_state(*crit)
    return out

def device_rng(model):
    """This rank's CUDA generator state (on its own device), or None for a model on the CPU."""
    device = compute_device(model)
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else None

def restore_device_rng(saved, rank, device):
    """Give this rank's CUDA generator the state its rank saved (saved: device_rng of every rank, by
    rank). A resume on more GPUs than were saved leaves the new ranks' generators as seeded; on the
    CPU there is none."""
    if device.type == "cuda" and saved and rank < len(saved) and saved[rank] is not None:
        torch.cuda.set_rng_state(saved[rank], device)

def load_trainer_state(model, opt, ckpt, args, print0, crit=None):
    """Restore the sharded model and optimizer state (each rank reads its own shards), PPO's
    critic's too (crit), and the RNG; returns the saved dict. trainer_state.pt is read with
    weights_only: tensors and plain data, so loading runs no pickled code. Exits with one line when
    the checkpoint has no critic for crit or one of another shape."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict
    state = torch.load(Path(ckpt) / "trainer_state.pt", weights_only=True)
    want, folder = trainer_state(model, opt, crit), str(Path(ckpt) / "trainer")
    if crit:
        # "critic.<name>" -> its metadata
        saved = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
        if not any(k.startswith("critic.") for k in saved):
            sys.exit(f"error: --resume: {ckpt} holds no critic (a run without --adv_estimator "
                     "gae): resume with the run's own flags")
        for name, t in want["critic"].items():
            shape = tuple(getattr(saved.get(f"critic.{name}"), "size", ()))
            if shape != tuple(t.shape):
                sys.exit(f"error: --resume: {ckpt}: its critic's {name} is {shape or 'missing'}, "
                         f"this run's {tuple(t.shape)} (another --model?)")
    dcp.load(want, checkpoint_id=folder)
    set_state_dict(model, opt, model_state_dict=want["model"], optim_state_dict=want["optim"],
                   options=StateDictOptions(ignore_frozen_params=True, strict=False))
    if crit:
        set_state_dict(*crit, model_state_dict=want["critic"],
                       optim_state_dict=want["critic_optim"],
                       options=StateDictOptions(ignore_frozen_params=True, strict=False))
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    restore_device_rng(state["rng"]["cuda"], dist.get_rank(), compute_device(model))
    changed = {k: (v, getattr(args, k)) for k, v in state["args"].items()
               if k != "resume" and getattr(args, k, v) != v}
    print0(f"resuming from {ckpt} at step {state['step']}"
           + (f"; changed args (old, new): {changed}" if changed else ""))
    return state

def policy_params(model):
    """(name, full tensor) of each of the policy's effective weights, named as in the base model's
    HF state dict, for the engine's streamed sync and export_hf. Each is all-gathered from its FSDP2
    shards only when the consumer asks for it (a collective: every rank must iterate, in the same
    order). A LoRA layer gives W + scaling B A (peft's scaling: alpha / r; rsLoRA's alpha /
    sqrt(r)), its base W dequantised first when quantised (what the trainer's forward computes
    with; add_lora refuses adapters whose merge is another, such as DoRA); the adapters and the
    "base_model.model." / ".base_layer" parts of peft's names do not appear."""
    # offload: each shard copied there to be gathered (NCCL's tensors are on the GPU)
    dev = compute_device(model)
    whole = lambda p: full(p.to(dev)).detach()
    modules = dict(model.named_modules())
    # peft and bitsandbytes imported only then (~2 s a process)
    if any(is_quantized(p) for p in model.parameters()):
        from peft.utils.integrations import dequantize_module_weight
    for name, p in model.named_parameters():
        if ".lora_" in name:  # merged into their layer's weight below
            continue
        owner, _, leaf = name.rpartition(".")
        m = modules[owner.removesuffix(".base_layer")]
        w = dequantize_module_weight(modules[owner]).detach() if is_quantized(p) else whole(p)
        # a LoRA layer (peft wraps its base as .base_layer)
        if m is not modules[owner] and leaf == "weight":
            # [r, in], [out, r]
            a, b = whole(m.lora_A["default"].weight), whole(m.lora_B["default"].weight)
            w = w.float() + m.scaling["default"] * (b.float() @ a.float())  # [out, in]
        yield name.removeprefix("base_model.model.").replace(".base_layer.", "."), w

@contextlib.contextmanager
def reference(model, ref):
    """`with reference(model, ref) as r:` r is the frozen KL reference: `ref` (a second model), or
    for a LoRA policy (ref None) the policy with its adapters disabled, i.e. the base it started
    from (no second copy of the weights)."""
    if ref is not None:
        yield ref
        return
    trainable = [p for p in model.parameters() if p.requires_grad]
    with model.disable_adapter():
        # peft's disable also sets the adapters' requires_grad off, and FSDP2 picks each unit's
        # gradient dtypes from requires_grad at the model's first forward, which can be this one:
        # under bf16 the adapters' gradients would then stay bf16 and fail against their fp32
        # shards. The forward only reads the disable flag.
        for p in trainable:
            p.requires_grad_(True)
        yield model

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
    """log.jsonl + wandb, on rank 0 only; on resume keeps records up to `step`. wandb's mode is its
    own WANDB_MODE environment variable (online | offline | disabled), offline when unset."""
    def __init__(self, out, rank, step, resume, config, project="r1router-nano"):
        self.f, self.run, mode = None, None, os.environ.get("WANDB_MODE", "offline")
        if rank != 0:
            return
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        old = ([json.loads(l) for l in open(out / "log.jsonl")]
               if resume and (out / "log.jsonl").exists() else [])
        dataio.write_atomic(out / "log.jsonl",
                            "".join(json.dumps(r) + "\n" for r in old if r["step"] <= step))
        self.f = open(out / "log.jsonl", "a")
        if mode != "disabled":
            import wandb
            self.run = wandb.init(project=project, mode=mode, config=config, dir=str(out),
                                  # no 25-line run summary at the end
                                  settings=wandb.Settings(quiet=True))

    def __call__(self, record):
        if self.f:
            self.f.write(json.dumps(record) + "\n")
            self.f.flush()
        if self.run:
            self.run.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    def table(self, step, name, columns, rows):
        """rows (lists of cells under `columns`) as wandb Table `name` at `step`: what TRL's and
        verl's sample tables are, wandb's alone (log.jsonl keeps the scalars). Mixed cell types are
        allowed, so that a row of Nones or an empty list never stops a run on wandb's typing."""
        if self.run and rows:
            import wandb
            table = wandb.Table(columns=list(columns), data=rows, allow_mixed_types=True)
            self.run.log({name: table}, step=step)

    def close(self):
        if self.f:
            self.f.close()
        if self.run:
            self.run.finish()
