"""
sft.py: supervised fine-tuning on golden step trajectories (synth.py), FSDP2, CPU or GPU.
Defaults are the recipe. The loss is next-token cross-entropy on the policy's tokens only, summed
over the global batch and divided by its count of them: any world size x grad_accum split of the
same global batch gives the same gradient. A single process is a world of one (in fp32 its model
is the plain module, FSDP2's otherwise: trainutil.load_sharded).

    python sft.py --model models/SmolLM2-135M-Instruct --data data/mini/traj --out out/sft
    torchrun --standalone --nproc_per_node 2 sft.py --data data/mini/traj --out out/sft
    python sft.py ... --out out/sft --resume     # on from <out>/latest: same data order and LR
    python sft.py ... --lora_r 16 --quant nf4    # QLoRA: adapters on the quantised frozen base
    python sft.py ... --pack_tokens 4096         # padding-free: a step's rows end to end

The data, the outputs, more commands and the flags' sources: docs/scripts.md#sftpy.
"""
import argparse
import math
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import dataio
import engines
import memory
import trainutil
import transcript
import vision
from clock import CLOCK

os.environ.setdefault("HF_HUB_OFFLINE", "1")

#### arguments

def get_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/SmolLM2-135M-Instruct",
                    help="HF causal LM folder to start from")
    ap.add_argument("--data", default="data/mini/traj",
                    help="folder with train.jsonl and dev.jsonl (synth.py)")
    ap.add_argument("--train_splits", nargs="+", default=["train"],
                    help="<data>/<split>.jsonl files trained on, mixed")
    ap.add_argument("--dev_split", default="dev", help="<data>/<split>.jsonl for the dev loss")
    ap.add_argument("--out", default="out/sft")
    ap.add_argument("--batch_size", type=int, default=1,
                    help="rows per micro-batch per rank (raise it on GPU)")
    ap.add_argument("--grad_accum", type=int, default=8,
                    help="optimizer step: batch_size x grad_accum rows a rank")
    ap.add_argument("--pack_tokens", type=int, default=0,
                    help="micro-batches of a step's rows end to end, N tokens at most, each row "
                         "attending to itself (0: batch_size rows a micro-batch, padded)")
    ap.add_argument("--max_len", type=int, default=2048,
                    help="truncate transcripts to this many tokens")
    ap.add_argument("--train_steps", type=int, default=48,
                    help="optimizer steps (48 x 8 rows: ~1 epoch of the mini-world)")
    ap.add_argument("--optim", default="adamw", choices=["adamw", "sgd"])
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--weight_decay", type=float, default=0.0)
    ap.add_argument("--warmup_steps", type=int, default=2)
    ap.add_argument("--min_lr_ratio", type=float, default=0.1,
                    help="cosine decays the LR to lr * this")
    ap.add_argument("--decay_steps", type=int, default=0,
                    help="the cosine ends at this step, the LR held after it (0: the last step)")
    ap.add_argument("--grad_clip", type=float, default=1.0,
                    help="max global grad norm (0: no clipping)")
    ap.add_argument("--activation_checkpointing", action="store_true")
    ap.add_argument("--offload", action="store_true",
                    help="FSDP2 CPU offload: shards, gradients and Adam state in host memory")
    ap.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"],
                    help="compute dtype (master weights stay fp32); auto: bf16 where native")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                    help="auto: CUDA when torch sees it, else the CPU; cuda: exit without CUDA")
    ap.add_argument("--lora_r", type=int, default=0,
                    help="LoRA rank: train adapters on a frozen base (0: all weights)")
    ap.add_argument("--lora_alpha", type=float, default=32.0, help="LoRA scale is alpha / r")
    ap.add_argument("--lora_dropout", type=float, default=0.05)
    ap.add_argument("--lora_targets", nargs="+", default=["all-linear"],
                    help="module names to adapt (all-linear: every linear layer but the head)")
    ap.add_argument("--quant", default="none", choices=["none", "nf4", "int8"],
                    help="QLoRA: the frozen base quantised by bitsandbytes (needs --lora_r)")
    ap.add_argument("--eval_every", type=int, default=24,
                    help="dev loss every N steps and at the end (0: never)")
    ap.add_argument("--eval_rows", type=int, default=128,
                    help="evaluate on the first N dev rows (0: all)")
    ap.add_argument("--save_every", type=int, default=12,
                    help="checkpoint every N steps (0: only at the end)")
    ap.add_argument("--keep", type=int, default=2,
                    help="keep the newest N step_* checkpoints (0: all)")
    ap.add_argument("--resume", nargs="?", const="yes", choices=["yes", "auto"],
                    help="continue from <out>/latest; auto: if there is one, else start")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)

#### data: validated rows, right-padded micro-batches, the masked loss

def load_rows(path, max_len, vocab_size, vl=False):
    """[(ids, mask, images)] of a trajectory file, truncated to max_len (before an image the cut
    would split); DataError naming the file and row on bad rows. A trajectory of several chats
    (rollout.py --structure released: `segments`) gives one row per chat. images: [[start, n, path]]
    of a VL policy's transcript (vl: the model has a vision tower); image tokens are context, never
    a policy token."""
    rows = []
    for i, r in enumerate(dataio.read_jsonl(path), 1):
        ids, mask, images = r.get("ids"), r.get("mask"), r.get("images") or []
        check_row(f"{path}: row {i}", ids, mask, images, vocab_size, vl)
        for a, b in r.get("segments") or [[0, len(ids)]]:
            if 1 in mask[a:b]:
                seg = vision.images_in(images, a, b)
                end = min([b - a, max_len] + [s for s, n, _ in seg if s + n > max_len])
                kept = [im for im in seg if im[0] + im[1] <= end]  # the images before the cut
                rows.append((ids[a:a + end], mask[a:a + end], kept))
    if not rows:
        raise dataio.DataError(f"{path}: no rows")
    return rows

def check_row(where, ids, mask, images, vocab_size, vl):
    """A DataError starting with where for a row that cannot be trained on."""
    if not isinstance(ids, list) or not isinstance(mask, list):
        raise dataio.DataError(f"{where}: needs list fields 'ids' and 'mask'")
    if len(ids) != len(mask):
        raise dataio.DataError(f"{where}: ids has {len(ids)} tokens but mask has {len(mask)}")
    if not all(isinstance(t, int) and 0 <= t < vocab_size for t in ids):
        raise dataio.DataError(f"{where}: ids must be ints in [0, {vocab_size}) (the model's "
                               "vocabulary)")
    if not all(m in (0, 1) for m in mask) or 1 not in mask:
        raise dataio.DataError(f"{where}: mask must be 0/1 with at least one 1 (a policy token)")
    if images and not vl:
        raise dataio.DataError(f"{where}: holds images, but the model has no vision tower "
                               "(synthesise with the text model's tokenizer, or train a VL model)")
    for start, n, image in images:
        if 1 in mask[start:start + n]:
            raise dataio.DataError(f"{where}: the image at token {start} is marked as policy "
                                   "tokens")
        if not Path(image).is_file():
            raise dataio.DataError(f"{where}: image file not found: {image}")

def collate(rows, pad_id, device):
    """rows [(ids, mask, ...)] -> ids [B, T] right-padded, labels [B, T] (= ids where mask is 1,
    else -100)."""
    T = max(len(r[0]) for r in rows)
    ids = torch.full((len(rows), T), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), T), -100, dtype=torch.long)
    for i, (x, m, *_) in enumerate(rows):
        ids[i, :len(x)] = torch.tensor(x)
        labels[i, :len(x)] = torch.where(torch.tensor(m, dtype=torch.bool), torch.tensor(x), -100)
    return ids.to(device), labels.to(device)

def collate_packed(rows, device):
    """rows [(ids, mask, ...)] end to end, without padding: ids, labels (as collate's; each row's
    first token -100: nothing before it is its context) and position ids restarting at each row,
    all [1, S]. From the position ids transformers attends within each row (a block-causal mask
    for SDPA and FlexAttention; flash-attn's varlen path on GPU), so each row's logits are those it
    gets alone."""
    ids = torch.tensor([t for x, *_ in rows for t in x])
    keep = torch.tensor([bool(m) and j > 0 for _, mask, *_ in rows for j, m in enumerate(mask)])
    pos = torch.tensor([j for x, *_ in rows for j in range(len(x))])
    labels = torch.where(keep, ids, -100)
    return ids[None].to(device), labels[None].to(device), pos[None].to(device)

def pixels(rows, vis, ids):
    """A VL micro-batch's image inputs (vision.VisionIO.pixels; {} for a text model), a dummy
    picture for rows without images (every rank runs the vision tower: its blocks are FSDP
    units)."""
    return vis.pixels([r[2] for r in rows], ids.device, ids, always=True) if vis else {}

def loss_sum(model, ids, labels, pix=None, pos=None):
    """Sum of the next-token NLLs over label positions (fp32) and their count. ids, labels: [B, T];
    pix: pixels(); pos: a packed micro-batch's position ids (collate_packed). No attention mask:
    padding is on the right and attention is causal, so real tokens never see it."""
    sel = labels[:, 1:] != -100  # [B, T-1] position t predicts token t + 1
    logits = trainutil.selected_logits(model, ids, sel, pos=pos, pixels=pix)  # [N, V]
    return F.cross_entropy(logits.float(), labels[:, 1:][sel], reduction="sum"), sel.sum()

def load_inputs(weights, data, train_splits, dev_split, max_len, print0):
    """The tokenizer of weights, the trajectories' transcript format, the train rows and the dev
    rows ([] when dev_split is None); one line on bad input."""
    from transformers import AutoConfig, AutoTokenizer
    try:
        config = AutoConfig.from_pretrained(weights)
        vl, vocab = hasattr(config, "vision_config"), config.get_text_config().vocab_size
        tok = AutoTokenizer.from_pretrained(weights)
        fmt = transcript.check_tokenizer(data, tok, print0)
        rows = lambda split: load_rows(Path(data) / f"{split}.jsonl", max_len, vocab, vl)
        train = [r for split in train_splits for r in rows(split)]
        dev = rows(dev_split) if dev_split is not None else []
    except (dataio.DataError, OSError, ValueError) as e:
        sys.exit(f"error: {e}")
    return tok, fmt, train, dev

#### the recipe and the trainer

@dataclass(frozen=True)
class Schedule:
    """The LR schedule's flags (lr_at)."""
    lr: float
    warmup_steps: int
    min_lr_ratio: float
    decay_steps: int  # the cosine ends here (0: at the last step)

def lr_at(step, schedule, total):
    """Linear warm-up to lr at step warmup_steps (0-based), then cosine down to lr * min_lr_ratio at
    the last step (or at step decay_steps - 1, held there after it)."""
    s = schedule
    if step < s.warmup_steps:
        return s.lr * (step + 1) / (s.warmup_steps + 1)
    end = min(s.decay_steps or total, total)
    progress = min(1.0, (step - s.warmup_steps) / max(1, end - s.warmup_steps - 1))
    return s.lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))

@dataclass(frozen=True)
class Recipe:
    """The flags the training loop reads, built once in main."""
    out: str
    train_steps: int
    batch_size: int  # rows per micro-batch per rank
    grad_accum: int  # micro-batches per optimizer step (batch_size x grad_accum rows a rank)
    pack_tokens: int  # > 0: the step's rows packed in micro-batches of at most this many tokens
    grad_clip: float  # max global grad norm (0: no clipping)
    schedule: Schedule
    eval_every: int
    save_every: int
    keep: int  # step_* checkpoints kept
    seed: int
    flags: dict  # every flag (--dtype resolved): what trainer_state.pt records

@dataclass(frozen=True)
class Trainer:
    """This rank's sharded policy and optimizer, where it runs, and what its checkpoints carry."""
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    rank: int
    world: int
    device: torch.device
    print0: object  # print on rank 0
    pad_id: int
    vis: object  # vision.VisionIO of a VL policy, else None
    processor: object  # saved beside the weights: the tokenizer, or a VL model's processor
    fmt: object  # the transcript.format_meta the policy trains on (None: unknown)

def make_optimizer(params, optim, lr, weight_decay):
    """--optim over params: AdamW (betas 0.9, 0.95) or plain SGD."""
    if optim == "adamw":
        return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay)
    return torch.optim.SGD(params, lr=lr, weight_decay=weight_decay)

#### checkpoints

def save_checkpoint(t, r, step, steps_per_epoch):
    """step_<step>/ (trainutil.save_checkpoint) with the data position a resume continues from."""
    state = dict(epoch=step // steps_per_epoch, position=step % steps_per_epoch, args=r.flags,
                 global_batch=r.batch_size * r.grad_accum * dist.get_world_size())
    trainutil.save_checkpoint(t.model, t.opt, t.processor, r.out, step, state, t.rank, r.keep,
                              merged=step >= r.train_steps, fmt=t.fmt)

#### evaluation

@torch.no_grad()
def evaluate(t, rows, batch_size):
    """Token-level dev loss over all ranks. Every rank runs the same number of forwards (FSDP
    all-gathers in each): a rank whose slice of the last batch is empty runs one row with weight
    0."""
    t.model.eval()
    B, tot = batch_size, torch.zeros(2, device=t.device)  # [loss sum, token count]
    for b in range(math.ceil(len(rows) / (B * t.world))):
        chunk = rows[(b * t.world + t.rank) * B:(b * t.world + t.rank + 1) * B]
        ids, labels = collate(chunk or rows[:1], t.pad_id, t.device)
        s, n = loss_sum(t.model, ids, labels, pixels(chunk or rows[:1], t.vis, ids))
        tot += torch.stack([s, n.float()]) * (1.0 if chunk else 0.0)
    dist.all_reduce(tot)
    t.model.train()
    return (tot[0] / tot[1]).item()

#### one step, and the loop

def micro_batches(t, rows, r):
    """This rank's share of a step as micro-batches [(ids, labels, pos, pix, weight)]: r.grad_accum
    of r.batch_size rows, right-padded (pos None), or packed by r.pack_tokens (collate_packed), as
    many on every rank (FSDP gathers inside each forward): a rank with fewer adds copies of its
    first with weight 0."""
    if not r.pack_tokens:
        chunks = [rows[a * r.batch_size:(a + 1) * r.batch_size] for a in range(r.grad_accum)]
        return [(ids, labels, None, pixels(c, t.vis, ids), 1.0)
                for c in chunks for ids, labels in [collate(c, t.pad_id, t.device)]]
    micro = [(*collate_packed(c, t.device), {}, 1.0)
             for c in trainutil.pack(rows, r.pack_tokens, lambda row: len(row[0]))]
    most = torch.tensor([len(micro)], device=t.device)
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    return micro + [(*micro[0][:4], 0.0)] * (int(most) - len(micro))

def train_step(t, rows, lr, r):
    """One optimizer step; `rows` is this rank's share of the global batch, in micro-batches
    (micro_batches). The loss is the global mean over every rank's label tokens. Returns the log
    record's numbers."""
    micro = micro_batches(t, rows, r)
    t0 = time.perf_counter()
    n_label = sum(w * (lab[:, 1:] != -100).sum().item() for _, lab, *_, w in micro)
    n_all = sum(len(row[0]) for row in rows)
    counts = torch.tensor([n_label, n_all], dtype=torch.float64, device=t.device)
    dist.all_reduce(counts)  # [loss tokens, all tokens] of the global batch
    n_loss = counts[0].clamp(min=1)
    for g in t.opt.param_groups:
        g["lr"] = lr
    loss_acc = torch.zeros((), device=t.device)
    for i, (ids, labels, pos, pix, weight) in enumerate(micro):
        s = loss_sum(t.model, ids, labels, pix, pos)[0] * weight
        trainutil.accumulate(t.model, last=i == len(micro) - 1)
        (s * t.world / n_loss).backward()  # FSDP averages gradients over ranks: * world sums them
        loss_acc += s.detach()
    gnorm = trainutil.clip_grad_norm(t.model, r.grad_clip)
    t.opt.step()
    t.opt.zero_grad(set_to_none=True)
    dist.all_reduce(loss_acc)
    dt = time.perf_counter() - t0
    return dict(loss=(loss_acc / n_loss).item(), lr=lr, grad_norm=gnorm, loss_tokens=int(counts[0]),
                tokens=int(counts[1]), loss_tok_s=counts[0].item() / dt,
                tok_s=counts[1].item() / dt, step_s=dt)

def train(t, r, rows, dev, step, resuming, record):
    """The optimizer steps from step to r.train_steps: each epoch a permutation of rows seeded by
    seed + epoch, global step s of an epoch takes perm[s*G:(s+1)*G] and rank k the k-th slice of
    those; the dev loss every eval_every steps and checkpoints every save_every, both at the end.
    Returns the last step."""
    G = r.batch_size * r.grad_accum * t.world  # rows per optimizer step, over all ranks
    steps_per_epoch = len(rows) // G
    bar = trainutil.progress(t.rank, r.train_steps, step, "sft")
    peak = memory.PeakMemory(t.device)
    perm, perm_epoch = None, -1
    saved_at = step if resuming else -1
    while step < r.train_steps:
        epoch, pos = divmod(step, steps_per_epoch)
        if epoch != perm_epoch:  # depends on seed + epoch only: a resume mid-epoch rebuilds it
            seeded = torch.Generator().manual_seed(r.seed + epoch)
            perm, perm_epoch = torch.randperm(len(rows), generator=seeded).tolist(), epoch
        mine = perm[pos * G:(pos + 1) * G][t.rank * G // t.world:(t.rank + 1) * G // t.world]
        with peak("step"), CLOCK("compute"), torch.profiler.record_function("sft.train_step"):
            lr = lr_at(step, r.schedule, r.train_steps)
            numbers = train_step(t, [rows[i] for i in mine], lr, r)
        rec = dict(step=step + 1, epoch=epoch, **numbers)
        rec["memory_gib"] = peak.gib["step"]  # this rank's peak (CPU: resident; CUDA: allocated)
        step += 1
        record(rec)
        if t.rank == 0:
            bar.update(1)
            bar.set_postfix(loss=f"{rec['loss']:.4f}", lr=f"{rec['lr']:.2e}",
                            gnorm=f"{rec['grad_norm']:.2f}", tok_s=f"{rec['tok_s']:.0f}")
        if r.eval_every and (step % r.eval_every == 0 or step == r.train_steps):
            with CLOCK("compute"):
                ev = evaluate(t, dev, r.batch_size)
            record(dict(step=step, eval_loss=ev))
            t.print0(f"\nstep {step}: dev loss {ev:.4f}")
        if (r.save_every and step % r.save_every == 0) or step == r.train_steps:
            with CLOCK("checkpoint"):
                save_checkpoint(t, r, step, steps_per_epoch)
            saved_at = step
    if saved_at != step:  # resumed a finished run, or train_steps == 0
        with CLOCK("checkpoint"):
            save_checkpoint(t, r, step, steps_per_epoch)
    if t.rank == 0:
        bar.close()
    return step

#### main

def main(argv=None):
    CLOCK.started()
    args = get_args(argv)
    rank, world, device, print0 = trainutil.env_rank(args.device)
    lora = trainutil.lora_of(args.lora_r, args.quant, args.lora_alpha, args.lora_dropout,
                             args.lora_targets)
    args.dtype = trainutil.resolve_dtype(args.dtype, device)  # what trainer_state.pt records

    # ---- inputs (every rank checks, so every rank exits on bad input before any collective)
    out = Path(args.out)
    start, weights, resuming = trainutil.resolve_start(args.model, out, args.resume,
                                                       lora is not None)
    dev_split = args.dev_split if args.eval_every else None
    with CLOCK("inputs"):
        tok, fmt, train_rows, dev = load_inputs(weights, args.data, args.train_splits, dev_split,
                                                args.max_len, print0)
    dev = dev[:args.eval_rows or None]
    G = args.batch_size * args.grad_accum * world  # rows per optimizer step, over all ranks
    steps_per_epoch = len(train_rows) // G
    if steps_per_epoch == 0:
        sys.exit(f"error: {args.data}/{{{','.join(args.train_splits)}}}.jsonl have "
                 f"{len(train_rows)} rows, fewer than one global batch ({G})")
    own_group = trainutil.init_group(world, device=device)
    torch.manual_seed(args.seed)
    random.seed(args.seed)

    # ---- model (FSDP2, fp32 master weights) and optimizer
    # a VL model's image plumbing, with the picture cap the trajectories' image expansions were made
    # with; the saved processor carries it on to Step-GRPO and evaluation
    vis = vision.VisionIO.load(weights, transcript.data_meta(args.data).get("max_pixels"))
    if vis and args.pack_tokens:
        sys.exit("error: --pack_tokens: a VL policy's position ids are 3-D and computed from its "
                 "pictures; train it without (padded micro-batches)")
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    with CLOCK("model"):
        model = trainutil.load_sharded(weights, device, world, args.activation_checkpointing,
                                       bf16=args.dtype == "bf16", lora=lora, offload=args.offload)
        params = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters alone
        opt = make_optimizer(params, args.optim, args.lr, args.weight_decay)
        # a resume: the weights came from the checkpoint folder; now the optimizer, step and RNG
        state = trainutil.load_trainer_state(model, opt, start, args, print0) if resuming else None
    step = 0
    if resuming:
        step = state["step"]
        if state["args"]["seed"] != args.seed or state["global_batch"] != G:
            print0("warning: seed or global batch size changed: the data order does not continue "
                   "the old run's")
    n_params, n_train = (sum(p.numel() for p in ps) for ps in (model.parameters(), params))
    print0(f"{n_params / 1e6:.1f}M parameters ({n_train / 1e6:.2f}M trained), world {world} "
           f"({trainutil.device_kind(device)}: {args.dtype}), {len(train_rows)} train rows, "
           f"global batch {G} = {args.batch_size} x {args.grad_accum} x {world}, "
           f"{steps_per_epoch} steps/epoch, {args.train_steps} steps")
    record = trainutil.Log(out, rank, step, resuming, vars(args))

    # ---- training
    t = Trainer(model, opt, rank, world, device, print0, pad_id, vis, vis.proc if vis else tok, fmt)
    schedule = Schedule(args.lr, args.warmup_steps, args.min_lr_ratio, args.decay_steps)
    recipe = Recipe(args.out, args.train_steps, args.batch_size, args.grad_accum,
                    args.pack_tokens, args.grad_clip, schedule, args.eval_every, args.save_every,
                    args.keep, args.seed, dict(vars(args)))
    step = train(t, recipe, train_rows, dev, step, resuming, record)
    if rank == 0:
        trainutil.link_step(out, step, "final")
    record.close()
    print0(f"done: {step} steps; final checkpoint {out / f'step_{step}'} (also {out / 'final'})")
    CLOCK.done(print0, rank)
    if own_group:
        dist.destroy_process_group()

if __name__ == "__main__":
    main()
    engines.exit_now()
