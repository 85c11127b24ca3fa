"""
memory.py: what a rank's device must hold, checked before the run starts, and what it held,
measured as it ran.
    check_gpu_budget  at start-up: exit in one line naming the phase (rollout beside the engine, or
                      the update) and the parts that do not fit on this GPU (gpu_budget's sums;
                      docs/gpu.md)
    PeakMemory        `with peak("update"):` the phase's peak (CUDA's allocator, or this process's
                      resident memory)
    held_parts        what a rank holds, part by part, counted off its tensors; breakdown: each
                      phase's peak beside them
Shared by sft.py and stepgrpo.py.
"""
import os
import sys

import torch
import torch.distributed as dist

from grpo import LOGIT_CHUNK
from trainutil import GIB, SYNC_CHUNK, blocks, compute_device, is_quantized, local

# What a rank's GPU holds outside torch's allocator, in every phase (estimates;
# torch.cuda.memory_allocated sees neither):
CUDA_CONTEXT = GIB // 2  # the process's CUDA context, one for the trainer and its in-process
                         # engine: 287 MB bare with CUDA's lazy module loading, 667 MB without
                         # (pytorch/pytorch#86509), more as kernels load
NCCL_BUFFERS = GIB  # the trainer's NCCL communicator on 2+ ranks (FSDP2's 1-D mesh reuses the
                    # default group: torch/distributed/device_mesh.py, "Append the default pg"):
                    # 688 MB for one over 4 A100s' NVLink (NVIDIA/nccl#964), linear in the
                    # channels, which NCCL opens more of on H100s (NVIDIA/nccl#986)
LOSS_COPIES = 3  # fp32 [C, V] tensors of one chunk alive at the loss's peak, in the backward (the
                 # chunk's logits / temperature and log_softmax recomputed, its gradient; measured
                 # 2 in fp32, 2.5 in bf16), beside the whole [N, V] logits and their gradient in
                 # the compute dtype (grpo.chunk_logprobs; tests/test_gpu_path.py)

def loss_bytes(tokens, vocab, compute_bytes):
    """Bytes the update's loss holds at its peak for a micro-batch of `tokens` policy tokens: the
    [N, V] logits and their gradient in the compute dtype (compute_bytes a value), and LOSS_COPIES
    fp32 copies of one LOGIT_CHUNK-row chunk (grpo.token_logprobs)."""
    return (2 * compute_bytes * tokens + LOSS_COPIES * 4 * min(tokens, LOGIT_CHUNK)) * vocab

def activation_bytes(config, tokens, compute_bytes, recomputed):
    """Bytes the update's forward keeps for its backward over a micro-batch of `tokens` positions,
    for a decoder of transformers' Llama / Qwen2 layers (config: its text config), as autograd's
    saved tensors count them (tests/test_gpu_path.py): a layer keeps, a token, (8 + 6c)h +
    2c kv + 4c i + 4 heads + 8 bytes (c compute_bytes; h hidden, kv the keys' width, i the MLP's:
    the two norms' fp32 inputs and rsqrt, their outputs, q, k, v and the attention's output with
    its fp32 log-sum-exp, the MLP's gate, up, activation and product), the rest (4 + c)h + 2c
    head_dim + 12 (the final norm, the rotary cos and sin, the position ids). recomputed
    (--activation_checkpointing): each layer keeps its input alone (c h), and the backward holds
    one layer's whole again while it recomputes it. A VL policy's vision tower is not counted."""
    h, i, heads = config.hidden_size, config.intermediate_size, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    kv = (getattr(config, "num_key_value_heads", None) or heads) * head_dim
    c = compute_bytes
    layer = (8 + 6 * c) * h + 2 * c * kv + 4 * c * i + 4 * heads + 8
    kept = c * h if recomputed else layer  # a layer's, a token, from its forward to its backward
    rest = (4 + c) * h + 2 * c * head_dim + 12  # the final norm, rotary cos and sin, positions
    return tokens * (config.num_hidden_layers * kept + (layer if recomputed else 0) + rest)

def gpu_budget(total, allocated, trainable, engine_fraction, world, tokens, vocab, offload=False,
               row_tokens=0, gathered=0, compute_bytes=2, activations=0):
    """{phase: {part: bytes}} of one rank's GPU of `total` bytes in Step-GRPO beside an in-process
    vLLM engine. rollout: the engine's share (gpu_memory_utilization: its weights, KV cache and
    CUDA graphs, whose pool vLLM 0.32 estimates into the share: model_budget_error) beside what the
    trainer keeps: what is `allocated` at start-up (the policy's fp32 shards, a reference) and the
    Adam state of the `trainable` shard bytes. update (the engine asleep, its graph pool offloaded
    too: vllm/device_allocator/sleep_mode_backend.py, CuMemBackend.suspend): that, the fp32
    gradients, the loss's logits (loss_bytes; tokens: a micro-batch's policy tokens), the layers'
    `activations` (activation_bytes) and FSDP2's `gathered` bf16 units (gathered_bytes). Both:
    the CUDA context and NCCL's buffers, in use before the engine starts, so outside its share
    (vLLM counts what it allocates after its start-up snapshot: vllm/v1/worker/gpu_worker.py,
    init_device). offload (--offload): the shards, gradients and Adam state are in host memory,
    `allocated` is what stays on the GPU (the buffers), and neither Adam nor the gradients
    count. sync check (row_tokens > 0: the engine's context, the longest row the check scores;
    trainutil.sync_weights: before the engine wakes, the gradients freed): what is kept, the
    `gathered` bytes of weights FSDP2 holds in the compute dtype (gathered_bytes), the row's
    logits in it (compute_bytes a value) and the two fp32 [SYNC_CHUNK, vocab] slices of its
    log-softmax."""
    outside = {"CUDA context": CUDA_CONTEXT, "NCCL buffers": NCCL_BUFFERS if world > 1 else 0}
    kept = {"policy shards and reference": allocated, "Adam state": 0 if offload else 2 * trainable}
    phases = {"rollout": {f"vLLM engine ({engine_fraction:.0%})": engine_fraction * total, **kept,
                          **outside},
              "update": {**kept, "gradients": 0 if offload else trainable,
                         f"logits ({tokens} tokens x {vocab})":
                             loss_bytes(tokens, vocab, compute_bytes),
                         "activations": activations, "gathered weights": gathered, **outside}}
    if row_tokens:
        phases["sync check"] = {**kept, "gathered weights": gathered,
                                f"logits ({row_tokens} tokens x {vocab})":
                                    compute_bytes * row_tokens * vocab,
                                "fp32 log-softmax slices": 2 * 4 * SYNC_CHUNK * vocab, **outside}
    return phases

def gathered_bytes(model, world, offload, compute_bytes):
    """Bytes of `model`'s weights FSDP2 holds gathered in the compute dtype (compute_bytes a value)
    during a no-grad forward: every weight at world size 1 without --offload (its blocks stay
    gathered: trainutil.shard), else the root's and two blocks' (the one computing, the next
    prefetched); 0 for a plain module (one process: nothing gathered; bf16 autocast casts one
    weight at a time: trainutil.plain_autocast). A quantised base's weights are whole already."""
    from torch.distributed.fsdp import FSDPModule
    if not isinstance(model, FSDPModule):
        return 0
    size = lambda m: sum(p.numel() for p in m.parameters() if not is_quantized(p))  # noqa: E731
    if world == 1 and not offload:
        return compute_bytes * size(model)
    units = [size(b) for b in blocks(model)]
    return compute_bytes * (size(model) - sum(units) + 2 * max(units, default=0))

def gpu_budget_error(total, allocated, trainable, engine_fraction, world, tokens, vocab, device=0,
                     offload=False, **sync):
    """The one-line error naming a phase of gpu_budget that does not fit and its parts, else
    None. sync: gpu_budget's row_tokens, gathered, compute_bytes and activations."""
    gib = lambda b: f"{b / GIB:.1f} GiB"  # noqa: E731
    for phase, parts in gpu_budget(total, allocated, trainable, engine_fraction, world, tokens,
                                   vocab, offload, **sync).items():
        if sum(parts.values()) > total:
            return (f"error: GPU {device} ({gib(total)}) cannot hold the {phase} phase "
                    f"({gib(sum(parts.values()))}: " +
                    ", ".join(f"{k} {gib(v)}" for k, v in parts.items() if v) +
                    "); use more GPUs (the shards shrink with the world size)" +
                    ("" if offload else ", --offload") +
                    (" or a smaller --micro_batch (or --activation_checkpointing)"
                     if phase == "update" else "") +
                    (" or a smaller --max_model_len" if phase == "sync check" else ""))
    return None

def optimizer_bytes(opt):
    """Bytes of the optimizer state already allocated: 0 before the first step, Adam's two moments
    after a resume."""
    return sum(local(v).numel() * local(v).element_size()
               for st in opt.state.values() for v in st.values() if torch.is_tensor(v))

def model_budget_error(model, opt, total, allocated, engine_fraction, world, tokens, device=0,
                       crit=None, row_tokens=0, bf16=True, positions=0):
    """gpu_budget_error for this rank's sharded `model` and its `opt` on a GPU of `total` bytes of
    which torch has `allocated` (check_gpu_budget reads both from CUDA). The Adam state a resume has
    loaded is taken out of `allocated`, since the budget adds it: the same verdict fresh and
    resumed. Adam is kept for the trainable weights alone (LoRA: the adapters). The budget counts
    vLLM's CUDA graphs inside its share, where vLLM 0.32 puts them by default (vllm/envs.py:
    VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS defaults to 1; gpu_worker.py takes the estimate out of
    the KV cache's room); with the variable 0 their pool would come on top, of a size known only
    once captured. A model loaded with --offload (its shards on the CPU, computing on the GPU)
    keeps its Adam state and gradients in host memory: the budget leaves them out. row_tokens,
    bf16: the sync check's longest row (the engine's context) and the compute dtype; positions: a
    micro-batch's most tokens, prompts included, whose activations the update keeps
    (activation_bytes; recomputed where the model checkpoints its layers)."""
    if not int(os.environ.get("VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS", "1")):
        return ("error: VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0 puts vLLM's CUDA graphs outside "
                "its share of the GPU, where the trainer's memory is: unset it")
    # PPO: the critic's gradients and Adam state beside the policy's
    pairs = [(model, opt)] + ([crit] if crit else [])
    trainable = sum(tensor_bytes(p for p in m.parameters() if p.requires_grad) for m, _ in pairs)
    vocab = model.get_output_embeddings().weight.shape[0]
    offload = next(model.parameters()).device != compute_device(model)
    # offload: the loaded Adam state is on the host
    resumed = 0 if offload else sum(optimizer_bytes(o) for _, o in pairs)
    width = 2 if bf16 else 4
    acts = activation_bytes(model.config.get_text_config(), positions, width,
                            getattr(model, "is_gradient_checkpointing", False))
    return gpu_budget_error(total, allocated - resumed, trainable, engine_fraction, world, tokens,
                            vocab, device, offload, row_tokens=row_tokens, compute_bytes=width,
                            gathered=gathered_bytes(model, world, offload, width),
                            activations=acts)

def check_gpu_budget(model, opt, engine_fraction, world, tokens, crit=None, row_tokens=0,
                     bf16=True, positions=0):
    """At start-up, before the engine exists: exit with model_budget_error's line if this rank's
    GPU is too small. Only for a policy on a GPU (--device cpu on a GPU host: nothing to check).
    crit: PPO's (critic, optimizer), whose shards are in memory already and whose Adam state comes
    on top. row_tokens, bf16, positions: model_budget_error's."""
    device = compute_device(model)
    if device.type == "cuda":
        error = model_budget_error(model, opt, torch.cuda.mem_get_info(device)[1],
                                   torch.cuda.memory_allocated(device),
                                   engine_fraction, world, tokens, device.index, crit,
                                   row_tokens, bf16, positions)
        if error:
            sys.exit(error)

def return_freed():
    """Hand the memory this process has freed back to the system (glibc's malloc_trim: the heap
    keeps freed chunks, and a phase's peak would sit on the last phase's leftovers); a no-op
    where the C library has no malloc_trim."""
    import ctypes
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass

def tensor_bytes(tensors):
    """Bytes of this rank's part of `tensors` (an FSDP2 shard's local tensor)."""
    return sum(local(t).numel() * t.element_size() for t in tensors)

UPDATE_ONLY = ("gradients", "critic gradients", "the loss's logits")  # alive in the update alone

def resident():
    """This process's resident memory now, in bytes."""
    import psutil
    return psutil.Process().memory_info().rss

def held_parts(model, opt, ref, crit, engine, micro_tokens, bf16, before=0):
    """{part: bytes} of what this rank holds: `before`, the process's resident memory before its
    models (the libraries, the data, the index: resident() then), then, counted off the tensors
    themselves, the policy's weights, its gradients (their size; alive in the update only) and
    Adam state, the reference's and the critic's, the engine's weights and KV cache (engine.held),
    and the loss's logits at the largest micro-batch's `micro_tokens` policy tokens (loss_bytes,
    which tests/test_gpu_path.py checks against torch's profiler)."""
    trainable = lambda m: [p for p in m.parameters() if p.requires_grad]  # noqa: E731
    parts = {"before the models": before, "policy weights": tensor_bytes(model.parameters()),
             "gradients": tensor_bytes(trainable(model)), "Adam state": optimizer_bytes(opt)}
    if ref is not None:
        parts["reference"] = tensor_bytes(ref.parameters())
    if crit is not None:
        parts.update({"critic weights": tensor_bytes(crit[0].parameters()),
                      "critic gradients": tensor_bytes(trainable(crit[0])),
                      "critic Adam state": optimizer_bytes(crit[1])})
    parts.update(engine.held() if hasattr(engine, "held") else {})
    vocab = model.get_output_embeddings().weight.shape[0]
    parts["the loss's logits"] = loss_bytes(micro_tokens, vocab, 2 if bf16 else 4)
    return parts

def breakdown(peaks, parts):
    """One line per phase: its peak (GiB, this rank's PeakMemory) = the parts alive in it + the
    rest (the engine's library, the activations, the allocator's slack: what no count shows)."""
    gib = lambda b: b / GIB  # noqa: E731
    lines = []
    for phase, peak in peaks.items():
        alive = {k: v for k, v in parts.items() if phase == "update" or k not in UPDATE_ONLY}
        rest = peak - gib(sum(alive.values()))
        lines.append(f"{phase} {peak:.2f} GiB = " +
                     " + ".join(f"{k} {gib(v):.2f}" for k, v in alive.items() if v) +
                     f" + the rest {rest:.2f}")
    return lines

class PeakMemory:
    """`with peak("update"):` records the phase's peak memory in GiB, in self.gib[phase]: on CUDA
    the peak of torch's allocated bytes (reset when the phase starts); on CPU this process's peak
    resident memory sampled every 10 ms by a thread (it includes the in-process vLLM engine, whose
    memory on CPU is this process's)."""
    def __init__(self, device=None):
        self.gib, self.phase = {}, None
        self.cuda = (torch.cuda.is_available() if device is None
                     else torch.device(device).type == "cuda")

    def __call__(self, phase):
        self.phase = phase
        return self

    def __enter__(self):
        import threading
        import psutil
        if self.cuda:
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
        if self.cuda:
            self.gib[self.phase] = torch.cuda.max_memory_allocated() / 2**30
        else:
            self.done.set()
            self.thread.join()
            self.gib[self.phase] = self.peak / 2**30

def gather_peaks(gib, world):
    """{phase: [GiB on rank 0, rank 1, ...]} from every rank's PeakMemory readings (checkpoint: the
    last save's)."""
    parts = [None] * world
    dist.all_gather_object(parts, dict(gib))
    return {k: [p.get(k, 0.0) for p in parts] for k in parts[0]}

def highest(peaks, new):
    """Per phase and rank, the larger of two {phase: [GiB per rank]} readings."""
    return {k: [max(a, b) for a, b in zip(v, peaks.get(k, v))] for k, v in new.items()}
