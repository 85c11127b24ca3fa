"""
bench/plain.py: sft.py's optimizer step beside a plain training loop on the same rows, in one
process on this machine: the same model, rows in the same order, dtype, threads and rows a step.
The plain loop is what a transformers user writes: model(ids).logits over every position, masked
cross-entropy, backward, clip_grad_norm_, AdamW (torch's default kernels), bf16 by autocast. Prints
each side's median seconds a step (the first step apart: allocation, first-touch), the tokens a
second and the ratio plain / sft.py (1.0: as fast as the plain loop; the goal is at least 1.0), and
the first step's loss of each (the same rows and weights give the same loss: the same work).
--profile K runs both under torch.profiler and prints each side's K ops with the most self CPU
time a timed step, and their shares of the step (where the time goes, not the timing: the
profiler's own cost is in it).

    python -m bench.plain --model models/SmolLM2-135M-Instruct --data data/mini/traj-top1 --steps 6
    python -m bench.plain ... --grad_accum 8 --batch_size 1                 # sft.py's defaults
    python -m bench.plain ... --steps 4 --profile 15                        # where the time goes
"""
import argparse
import collections
import contextlib
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import sft
import trainutil

def ours(model, data, steps, batch_size, grad_accum, dtype, lr, seed):
    """sft.py's own steps (its main, one rank, no dev loss, one checkpoint at the end, the LR held
    at lr as the plain loop's): [(seconds, tokens, loss)] a step, from its log.jsonl."""
    with tempfile.TemporaryDirectory() as out:
        sft.main(["--model", model, "--data", data, "--out", out, "--train_steps", str(steps),
                  "--batch_size", str(batch_size), "--grad_accum", str(grad_accum),
                  "--dtype", dtype, "--lr", str(lr), "--seed", str(seed), "--eval_every", "0",
                  "--save_every", "0", "--keep", "1", "--warmup_steps", "0",
                  "--min_lr_ratio", "1"])
        recs = [json.loads(line) for line in open(Path(out) / "log.jsonl")]
    return [(r["step_s"], r["tokens"], r["loss"]) for r in recs if "step_s" in r]

def plain(model_dir, data, steps, batch_size, grad_accum, dtype, lr, seed, max_len):
    """The plain loop on sft.py's rows in sft.py's order (epoch 0's permutation of seed): [(seconds,
    tokens, loss)] a step, timed as sft.py times its step (from the collated micro-batches on)."""
    from transformers import AutoModelForCausalLM
    tok, _, rows, _ = sft.load_inputs(model_dir, data, ["train"], None, max_len, print)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    G = batch_size * grad_accum
    perm = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed)).tolist()
    cpu, out = torch.device("cpu"), []
    for s in range(steps):
        batch = [rows[i] for i in perm[s * G:(s + 1) * G]]
        micro = [sft.collate(batch[a:a + batch_size], pad_id, cpu) for a in range(0, G, batch_size)]
        span = torch.profiler.record_function("plain.step")
        span.__enter__()
        t0 = time.perf_counter()
        n = sum(int((lab[:, 1:] != -100).sum()) for _, lab in micro)  # the step's label tokens
        total = 0.0
        for ids, labels in micro:  # [B, T] each
            with torch.autocast("cpu", torch.bfloat16, enabled=dtype == "bf16"):
                logits = model(input_ids=ids).logits  # [B, T, V]
            loss = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), labels[:, 1:].flatten(),
                                   ignore_index=-100, reduction="sum")
            (loss / n).backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        span.__exit__(None, None, None)
        out.append((time.perf_counter() - t0, sum(len(r[0]) for r in batch), total / n))
    return out

def top_ops(prof, label, k):
    """The k ops with the most self CPU time inside the `label` ranges but the first (the timed
    steps): [(name, seconds a step, share of the step)]."""
    events = prof.events()
    spans = sorted((e.time_range.start, e.time_range.end) for e in events if e.name == label)[1:]
    self_us = collections.Counter()
    for e in events:
        if e.name != label and any(a <= e.time_range.start < b for a, b in spans):
            self_us[e.name] += e.self_cpu_time_total
    step_us = sum(b - a for a, b in spans)
    return [(name, us / 1e6 / len(spans), us / step_us) for name, us in self_us.most_common(k)]

def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/SmolLM2-135M-Instruct")
    ap.add_argument("--data", default="data/mini/traj-top1", help="synth.py folder (train.jsonl)")
    ap.add_argument("--steps", type=int, default=6, help="optimizer steps a side (first untimed)")
    ap.add_argument("--batch_size", type=int, default=1)
    ap.add_argument("--grad_accum", type=int, default=2, help="the main job's (Makefile SFT_ACCUM)")
    ap.add_argument("--max_len", type=int, default=2048, help="sft.py's default")
    ap.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"])
    ap.add_argument("--lr", type=float, default=4e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", type=int, default=0, help="print each side's top N ops (0: none)")
    args = ap.parse_args()
    dtype = trainutil.resolve_dtype(args.dtype, torch.device("cpu"))
    common = (args.steps, args.batch_size, args.grad_accum, dtype, args.lr, args.seed)
    profile = (lambda: torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])) \
        if args.profile else contextlib.nullcontext
    with profile() as prof_a:
        a = ours(args.model, args.data, *common)
    with profile() as prof_b:
        b = plain(args.model, args.data, *common, args.max_len)
    for name, prof, label in (("sft.py", prof_a, "sft.train_step"), ("plain loop", prof_b,
                                                                     "plain.step")):
        if args.profile:
            print(f"\n{name}: the top {args.profile} ops by self CPU time a step")
            for op, s, share in top_ops(prof, label, args.profile):
                print(f"  {op[:48]:48s} {s:7.3f} s {share:6.1%}")
    print(f"\nSFT step, {args.batch_size} x {args.grad_accum} rows, {dtype}, "
          f"{torch.get_num_threads()} threads, median of steps 2-{args.steps}:")
    med = {}
    for name, recs in (("sft.py", a), ("plain loop", b)):
        med[name] = statistics.median(s for s, _, _ in recs[1:])
        tok_s = sum(n for _, n, _ in recs[1:]) / sum(s for s, _, _ in recs[1:])
        print(f"  {name:10s} {med[name]:7.2f} s a step, {tok_s:6.0f} tokens/s, "
              f"first step's loss {recs[0][2]:.4f}")
    print(f"  ratio plain / sft.py: {med['plain loop'] / med['sft.py']:.2f}x (goal >= 1.0)")

if __name__ == "__main__":
    main()
