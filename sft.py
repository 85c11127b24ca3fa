"""
sft.py: supervised fine-tuning on golden step trajectories (synth.py), FSDP2, CPU or GPU. Defaults are the recipe.

    python sft.py --model models/SmolLM2-135M-Instruct --data data/mini/traj --out out/sft
    torchrun --standalone --nproc_per_node 2 sft.py --model models/SmolLM2-135M-Instruct --data data/mini/traj --out out/sft
    python sft.py ... --out out/sft --resume            # continue from <out>/latest: same data order, same LR schedule
    WANDB_MODE=disabled python sft.py ... --train_steps 5 --eval_every 0 --save_every 0   # a quick smoke run, no wandb
    python sft.py ... --lora_r 16                               # LoRA adapters on the frozen base (peft)
    python sft.py ... --lora_r 16 --quant nf4                   # QLoRA: the base quantised (bitsandbytes)
    python sft.py ... --offload                                 # FSDP2 CPU offload: shards and Adam in host memory

Data: <data>/train.jsonl and <data>/dev.jsonl, one trajectory a row with `ids` (a whole chat transcript, tokenised
with the model's tokenizer: <data>/meta.json, from synth.py, names it, and another is refused) and `mask` (1 where
the policy wrote the token). The loss is next-token cross-entropy
on the policy's tokens only, summed over the GLOBAL batch (every rank, every micro-batch of one optimizer step) and
divided by the global count of such tokens, so any world size x grad_accum split of the same global batch gives the
same gradient (tests/test_sft.py: 2 ranks equal 1 process). Global batch G = batch_size x grad_accum x world rows;
each epoch is a permutation seeded by seed + epoch, global step s of an epoch takes rows perm[s*G:(s+1)*G] and rank
r the r-th slice of those. A single process is an FSDP2 world of one, so it runs the multi-rank code paths.

Outputs in --out (trainutil.py): step_<N>/ (an HF folder transformers and vLLM load, + trainer_state.pt for
--resume), latest, final -> step_<N>, log.jsonl (loss, lr, grad_norm, tokens/s, peak memory per step; eval_loss).
Outline: arguments -> data (validated rows, masked loss) -> checkpoints -> dev loss -> one step -> main.
"""
import argparse
import math
import os
import random
import sys
import time
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

os.environ.setdefault("HF_HUB_OFFLINE", "1")

#### arguments

def get_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/SmolLM2-135M-Instruct", help="HF causal LM folder to start from")
    ap.add_argument("--data", default="data/mini/traj", help="folder with train.jsonl and dev.jsonl (synth.py)")
    ap.add_argument("--train_splits", nargs="+", default=["train"], help="<data>/<split>.jsonl files trained on, mixed")
    ap.add_argument("--dev_split", default="dev", help="<data>/<split>.jsonl for the dev loss")
    ap.add_argument("--out", default="out/sft")
    ap.add_argument("--batch_size", type=int, default=1, help="rows per micro-batch per rank (raise it on GPU)")
    ap.add_argument("--grad_accum", type=int, default=8, help="micro-batches per optimizer step")
    ap.add_argument("--max_len", type=int, default=2048, help="truncate transcripts to this many tokens")
    ap.add_argument("--train_steps", type=int, default=48, help="optimizer steps (48 x 8 rows: ~1 epoch of the mini-world)")
    ap.add_argument("--optim", default="adamw", choices=["adamw", "sgd"])
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--weight_decay", type=float, default=0.0)
    ap.add_argument("--warmup_steps", type=int, default=2)
    ap.add_argument("--min_lr_ratio", type=float, default=0.1, help="cosine decays the LR to lr * this")
    ap.add_argument("--decay_steps", type=int, default=0,
                    help="the cosine ends at this step and the LR stays at lr * min_lr_ratio after it (0: the last step)")
    ap.add_argument("--grad_clip", type=float, default=1.0, help="max global grad norm (0: no clipping)")
    ap.add_argument("--activation_checkpointing", action="store_true")
    ap.add_argument("--offload", action="store_true",
                    help="FSDP2 CPU offload: the trainer's shards, gradients and Adam state in host memory, each layer "
                         "on the GPU only for its compute (a model past the GPUs' memory; slower)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"],
                    help="compute dtype (FSDP2 mixed precision; master weights, grads and optimizer stay fp32); "
                         "auto: bf16 on CUDA and AVX512-BF16 CPUs, else fp32")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                    help="auto: CUDA when torch sees it, else the CPU; cuda: exit at once when CUDA is missing")
    ap.add_argument("--lora_r", type=int, default=0, help="LoRA rank: train adapters on a frozen base (0: all weights)")
    ap.add_argument("--lora_alpha", type=float, default=32.0, help="LoRA scale is alpha / r")
    ap.add_argument("--lora_dropout", type=float, default=0.05)
    ap.add_argument("--lora_targets", nargs="+", default=["all-linear"],
                    help="module names to adapt (all-linear: every linear layer but the output head)")
    ap.add_argument("--quant", default="none", choices=["none", "nf4", "int8"],
                    help="QLoRA: the frozen base quantised by bitsandbytes (needs --lora_r)")
    ap.add_argument("--eval_every", type=int, default=24, help="dev loss every N steps and at the end (0: never)")
    ap.add_argument("--eval_rows", type=int, default=128, help="evaluate on the first N dev rows (0: all)")
    ap.add_argument("--save_every", type=int, default=12, help="checkpoint every N steps (0: only at the end)")
    ap.add_argument("--keep", type=int, default=2, help="keep the newest N step_* checkpoints (0: all)")
    ap.add_argument("--resume", nargs="?", const="yes", choices=["yes", "auto"],
                    help="continue from <out>/latest; auto: if there is one, else start (a restarted job)")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)

#### data: validated rows, right-padded micro-batches, the masked loss

def load_rows(path, max_len, vocab_size, vl=False):
    """[(ids, mask, images)] of a trajectory file, truncated to max_len (before an image the cut would split);
    DataError naming the file and row on bad rows. A trajectory of several chats (rollout.py --structure released:
    `segments`) gives one row per chat. images: [[start, n, path]] of a VL policy's transcript (vl: the model has a
    vision tower); image tokens are context, never a policy token."""
    rows = []
    for i, r in enumerate(dataio.read_jsonl(path), 1):
        ids, mask = r.get("ids"), r.get("mask")
        if not isinstance(ids, list) or not isinstance(mask, list):
            raise dataio.DataError(f"{path}: row {i}: needs list fields 'ids' and 'mask'")
        if len(ids) != len(mask):
            raise dataio.DataError(f"{path}: row {i}: ids has {len(ids)} tokens but mask has {len(mask)}")
        if not all(isinstance(t, int) and 0 <= t < vocab_size for t in ids):
            raise dataio.DataError(f"{path}: row {i}: ids must be ints in [0, {vocab_size}) (the model's vocabulary)")
        if not all(m in (0, 1) for m in mask) or 1 not in mask:
            raise dataio.DataError(f"{path}: row {i}: mask must be 0/1 with at least one 1 (a policy token)")
        images = r.get("images") or []
        if images and not vl:
            raise dataio.DataError(f"{path}: row {i}: holds images, but the model has no vision tower (synthesise "
                                   "with the text model's tokenizer, or train a VL model)")
        for start, n, image in images:
            if 1 in mask[start:start + n]:
                raise dataio.DataError(f"{path}: row {i}: the image at token {start} is marked as policy tokens")
            if not Path(image).is_file():
                raise dataio.DataError(f"{path}: row {i}: image file not found: {image}")
        for a, b in r.get("segments") or [[0, len(ids)]]:
            if 1 in mask[a:b]:
                seg = vision.images_in(images, a, b)
                end = min([b - a, max_len] + [s for s, n, _ in seg if s + n > max_len])
                rows.append((ids[a:a + end], mask[a:a + end], [im for im in seg if im[0] + im[1] <= end]))
    if not rows:
        raise dataio.DataError(f"{path}: no rows")
    return rows

def collate(rows, pad_id, device):
    """rows [(ids, mask, ...)] -> ids [B, T] right-padded, labels [B, T] (= ids where mask is 1, else -100)."""
    T = max(len(r[0]) for r in rows)
    ids = torch.full((len(rows), T), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), T), -100, dtype=torch.long)
    for i, (x, m, *_) in enumerate(rows):
        ids[i, :len(x)] = torch.tensor(x)
        labels[i, :len(x)] = torch.where(torch.tensor(m, dtype=torch.bool), torch.tensor(x), -100)
    return ids.to(device), labels.to(device)

def pixels(rows, vis, ids):
    """A VL micro-batch's image inputs (vision.VisionIO.pixels; {} for a text model), a dummy picture for rows without
    images (every rank runs the vision tower: its blocks are FSDP units)."""
    return vis.pixels([r[2] for r in rows], ids.device, ids, always=True) if vis else {}

def loss_sum(model, ids, labels, pix=None):
    """Sum of the next-token NLLs over label positions (fp32) and their count. ids, labels: [B, T]; pix: pixels().
    No attention mask: padding is on the right and attention is causal, so real tokens never see it."""
    sel = labels[:, 1:] != -100  # [B, T-1] position t predicts token t + 1
    logits = trainutil.selected_logits(model, ids, sel, pixels=pix)  # [N, V]
    return F.cross_entropy(logits.float(), labels[:, 1:][sel], reduction="sum"), sel.sum()

def lr_at(step, args, total):
    """Linear warm-up to lr at step warmup_steps (0-based), then cosine down to lr * min_lr_ratio at the last step
    (or at step decay_steps - 1, held there after it)."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / (args.warmup_steps + 1)
    end = min(args.decay_steps or total, total)
    progress = min(1.0, (step - args.warmup_steps) / max(1, end - args.warmup_steps - 1))
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))

#### checkpoints

def save_checkpoint(model, opt, tok, args, step, steps_per_epoch, rank, fmt):  # tok: tokenizer or VL processor
    state = dict(epoch=step // steps_per_epoch, position=step % steps_per_epoch, args=vars(args),
                 global_batch=args.batch_size * args.grad_accum * dist.get_world_size())
    trainutil.save_checkpoint(model, opt, tok, args.out, step, state, rank, args.keep, merged=step >= args.train_steps,
                              fmt=fmt)

#### evaluation

@torch.no_grad()
def evaluate(model, rows, args, rank, world, pad_id, device, vis=None):
    """Token-level dev loss over all ranks. Every rank runs the same number of forwards (FSDP all-gathers in each):
    a rank whose slice of the last batch is empty runs one row with weight 0."""
    model.eval()
    B, tot = args.batch_size, torch.zeros(2, device=device)  # [loss sum, token count]
    for b in range(math.ceil(len(rows) / (B * world))):
        chunk = rows[(b * world + rank) * B:(b * world + rank + 1) * B]
        ids, labels = collate(chunk or rows[:1], pad_id, device)
        s, n = loss_sum(model, ids, labels, pixels(chunk or rows[:1], vis, ids))
        tot += torch.stack([s, n.float()]) * (1.0 if chunk else 0.0)
    dist.all_reduce(tot)
    model.train()
    return (tot[0] / tot[1]).item()

def train_step(model, opt, rows, lr, args, pad_id, device, vis=None):
    """One optimizer step; `rows` is this rank's share of the global batch, in grad_accum micro-batches. The loss is
    the global mean over every rank's label tokens. Returns the log record's numbers."""
    world = dist.get_world_size()
    chunks = [rows[a * args.batch_size:(a + 1) * args.batch_size] for a in range(args.grad_accum)]
    micro = [(ids, labels, pixels(c, vis, ids)) for c in chunks for ids, labels in [collate(c, pad_id, device)]]
    t0 = time.perf_counter()
    counts = torch.tensor([sum((lab[:, 1:] != -100).sum().item() for _, lab, _ in micro), sum(len(r[0]) for r in rows)],
                          dtype=torch.float64, device=device)
    dist.all_reduce(counts)  # [loss tokens, all tokens] of the global batch
    n_loss = counts[0].clamp(min=1)
    for g in opt.param_groups:
        g["lr"] = lr
    loss_acc = torch.zeros((), device=device)
    for ids, labels, pix in micro:
        s, _ = loss_sum(model, ids, labels, pix)
        (s * world / n_loss).backward()  # FSDP averages gradients over ranks: * world makes it a global sum
        loss_acc += s.detach()
    gnorm = trainutil.clip_grad_norm(model, args.grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    dist.all_reduce(loss_acc)
    dt = time.perf_counter() - t0
    return dict(loss=(loss_acc / n_loss).item(), lr=lr, grad_norm=gnorm, loss_tokens=int(counts[0]), tokens=int(counts[1]),
                loss_tok_s=counts[0].item() / dt, tok_s=counts[1].item() / dt, step_s=dt)

#### main

def main(argv=None):
    args = get_args(argv)
    from transformers import AutoConfig, AutoTokenizer
    rank, world, device, print0 = trainutil.env_rank(args.device)
    lora = trainutil.lora_of(args.lora_r, args.quant, args.lora_alpha, args.lora_dropout, args.lora_targets)
    args.dtype = trainutil.resolve_dtype(args.dtype, device)  # the resolved choice is what trainer_state.pt records

    # ---- inputs (every rank checks, so every rank exits on bad input before any collective)
    out = Path(args.out)
    start, weights, resuming = trainutil.resolve_start(args.model, out, args.resume, lora is not None)
    try:
        config = AutoConfig.from_pretrained(weights)
        vl, vocab = hasattr(config, "vision_config"), config.get_text_config().vocab_size
        tok = AutoTokenizer.from_pretrained(weights)
        fmt = transcript.check_tokenizer(args.data, tok, print0)
        train = [r for sp in args.train_splits for r in load_rows(Path(args.data) / f"{sp}.jsonl", args.max_len, vocab, vl)]
        dev = load_rows(Path(args.data) / f"{args.dev_split}.jsonl", args.max_len, vocab, vl) if args.eval_every else []
    except (dataio.DataError, OSError, ValueError) as e:
        sys.exit(f"error: {e}")
    dev = dev[:args.eval_rows or None]
    G = args.batch_size * args.grad_accum * world  # rows per optimizer step, over all ranks
    steps_per_epoch = len(train) // G
    if steps_per_epoch == 0:
        sys.exit(f"error: {args.data}/{{{','.join(args.train_splits)}}}.jsonl have {len(train)} rows, fewer than one global batch ({G})")
    total = args.train_steps
    own_group = trainutil.init_group(world, device=device)
    torch.manual_seed(args.seed)
    random.seed(args.seed)

    # ---- model (FSDP2, fp32 master weights) and optimizer
    # a VL model's image plumbing, with the picture cap the trajectories' image expansions were made with; the saved
    # processor carries it on to Step-GRPO and evaluation
    vis = vision.VisionIO.load(weights, transcript.data_meta(args.data).get("max_pixels"))
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    model = trainutil.load_sharded(weights, device, world, args.activation_checkpointing, bf16=args.dtype == "bf16",
                                   lora=lora, offload=args.offload)
    params = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters alone
    if args.optim == "adamw":
        opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    else:
        opt = torch.optim.SGD(params, lr=args.lr, weight_decay=args.weight_decay)
    step = 0
    if resuming:  # weights came from the checkpoint folder; now the optimizer, the step and the RNG
        state = trainutil.load_trainer_state(model, opt, start, args, print0)
        step = state["step"]
        if state["args"]["seed"] != args.seed or state["global_batch"] != G:
            print0("warning: seed or global batch size changed: the data order does not continue the old run's")
    n_params, n_train = (sum(p.numel() for p in ps) for ps in (model.parameters(), params))
    print0(f"{n_params / 1e6:.1f}M parameters ({n_train / 1e6:.2f}M trained), world {world} ({trainutil.device_kind(device)}: {args.dtype}), {len(train)} train rows, "
           f"global batch {G} = {args.batch_size} x {args.grad_accum} x {world}, {steps_per_epoch} steps/epoch, {total} steps")
    record = trainutil.Log(out, rank, step, resuming, vars(args))
    bar = trainutil.progress(rank, total, step, "sft")
    peak = memory.PeakMemory(device)

    #### training loop
    perm, perm_epoch = None, -1
    saved_at = step if resuming else -1
    while step < total:
        epoch, pos = divmod(step, steps_per_epoch)
        if epoch != perm_epoch:  # the epoch's order depends on seed + epoch only: resuming mid-epoch rebuilds it
            perm = torch.randperm(len(train), generator=torch.Generator().manual_seed(args.seed + epoch)).tolist()
            perm_epoch = epoch
        mine = perm[pos * G:(pos + 1) * G][rank * G // world:(rank + 1) * G // world]  # this rank's rows
        with peak("step"):
            r = dict(step=step + 1, epoch=epoch, **train_step(model, opt, [train[i] for i in mine],
                                                              lr_at(step, args, total), args, pad_id, device, vis))
        r["memory_gib"] = peak.gib["step"]  # this rank's peak (CPU: resident memory; CUDA: allocated)
        step += 1
        record(r)
        if rank == 0:
            bar.update(1)
            bar.set_postfix(loss=f"{r['loss']:.4f}", lr=f"{r['lr']:.2e}", gnorm=f"{r['grad_norm']:.2f}", tok_s=f"{r['tok_s']:.0f}")
        if args.eval_every and (step % args.eval_every == 0 or step == total):
            ev = evaluate(model, dev, args, rank, world, pad_id, device, vis)
            record(dict(step=step, eval_loss=ev))
            print0(f"\nstep {step}: dev loss {ev:.4f}")
        if (args.save_every and step % args.save_every == 0) or step == total:
            save_checkpoint(model, opt, vis.proc if vis else tok, args, step, steps_per_epoch, rank, fmt)
            saved_at = step
    if saved_at != step:  # resumed a finished run, or total == 0
        save_checkpoint(model, opt, vis.proc if vis else tok, args, step, steps_per_epoch, rank, fmt)
    if rank == 0:
        trainutil.link_step(out, step, "final")
        bar.close()
    record.close()
    print0(f"done: {step} steps; final checkpoint {out / f'step_{step}'} (also {out / 'final'})")
    if own_group:
        dist.destroy_process_group()

if __name__ == "__main__":
    main()
    engines.exit_now()
