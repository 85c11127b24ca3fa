"""
bench/plain.py: each trainer's optimizer step beside a plain training loop on the same rows, in
one process on this machine, the two alternating step by step (a machine's drift in speed falls on
both): the same model, rows, dtype, threads and rows a step.
- SFT: sft.train_step on a Trainer built as sft.main builds it (one rank: the plain module, bf16 by
  autocast: trainutil.plain_autocast), against what a transformers user writes: model(ids).logits
  over every position, masked cross-entropy, backward, clip_grad_norm_, AdamW (torch's default
  kernels), bf16 by autocast.
- the Step-GRPO update: learner.update (the clipped loss, grpo.grpo_loss, on learner.micro_batches)
  against the same plain loop with the clipped loss written out (log_softmax over every position,
  PPO's clip, the global token mean). Its rows are the golden trajectories' policy tokens, each row
  an advantage (seeded normal), the old logprobs the starting weights' (the first ratios are 1).
Prints each side's median seconds a step (the first step apart: allocation, first-touch), tokens a
second, the ratio plain / ours (the median of each step's, the two on the same rows; 1.0: as fast
as the plain loop; the goal is at least 1.0), and the
first step's loss of each (the same rows and weights give the same loss: the same work).
--profile K: each side's K ops with the most self CPU time a timed step, and their shares of the
step, under torch.profiler (where the time goes; the profiler's own cost is in it).

    python -m bench.plain --model models/SmolLM2-135M-Instruct --data data/mini/traj-top1 --steps 6
    python -m bench.plain ... --grad_accum 8 --batch_size 1                 # sft.py's defaults
    python -m bench.plain ... --stages sft --pack_tokens 4096               # padding-free SFT
    python -m bench.plain ... --steps 4 --profile 15 --stages sft           # where SFT's time goes
"""
import argparse
import collections
import contextlib
import statistics
import time

import torch
import torch.nn.functional as F

import grpo
import learner
import sft
import trainutil

CPU = torch.device("cpu")

def plain_model(model_dir, lr):
    """The plain loop's model (fp32 weights, as the trainers' masters) and torch's AdamW."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train()
    return model, torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)

def ours_model(model_dir, dtype, lr):
    """The trainers' model and optimizer at world size 1: trainutil.load_sharded, sft's AdamW."""
    model = trainutil.load_sharded(model_dir, CPU, 1, bf16=dtype == "bf16")
    return model, sft.make_optimizer(list(model.parameters()), "adamw", lr, 0.0)

def plain_finish(model, opt):
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)

#### SFT

def sft_sides(model_dir, tok, pad_id, batch_size, grad_accum, dtype, lr, pack_tokens=0):
    """{name: step(rows) -> (seconds, loss)}: sft.py's step and the plain loop's, each timed from
    the collated micro-batches on (as sft.train_step times itself)."""
    model, opt = ours_model(model_dir, dtype, lr)
    t = sft.Trainer(model, opt, 0, 1, CPU, print, pad_id, None, tok, None)
    r = sft.Recipe("", 0, batch_size, grad_accum, pack_tokens, 1.0, None, 0, 0, 0, 0, {})

    def ours(batch):
        rec = sft.train_step(t, batch, lr, r)
        return rec["step_s"], rec["loss"]
    plain, popt = plain_model(model_dir, lr)

    def loop(batch):
        micro = [sft.collate(batch[a:a + batch_size], pad_id, CPU)
                 for a in range(0, len(batch), batch_size)]
        t0 = time.perf_counter()
        n = sum(int((lab[:, 1:] != -100).sum()) for _, lab in micro)  # the step's label tokens
        total = 0.0
        for ids, labels in micro:  # [B, T] each
            with torch.autocast("cpu", torch.bfloat16, enabled=dtype == "bf16"):
                logits = plain(input_ids=ids).logits  # [B, T, V]
            loss = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), labels[:, 1:].flatten(),
                                   ignore_index=-100, reduction="sum")
            (loss / n).backward()
            total += loss.item()
        plain_finish(plain, popt)
        return time.perf_counter() - t0, total / n
    return {"sft.py": ours, "plain loop": loop}

#### the Step-GRPO update

def update_rows(rows, model_dir, seed):
    """The golden rows as a rollout's training rows (learner.micro_batches' dicts): old, the
    starting weights' logprob of each token; adv, one seeded normal a row."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    adv = torch.randn(len(rows), generator=torch.Generator().manual_seed(seed)).tolist()
    out = []
    with torch.no_grad():
        for (ids, mask, _), a in zip(rows, adv):
            x = torch.tensor([ids])
            lp = model(input_ids=x).logits[0, :-1].log_softmax(-1)  # [T-1, V]
            old = [0.0] + lp.gather(-1, x[0, 1:, None])[:, 0].tolist()
            out.append(dict(ids=ids, mask=mask, old=old, adv=[a] * len(ids)))
    return out

def update_sides(model_dir, pad_id, micro_batch, dtype, lr, micro_tokens=0):
    """{name: step(rows) -> (seconds, loss)}: learner.update (micro_tokens: its rows end to end)
    and the plain loop's clipped loss (micro_batch rows, padded)."""
    cfg = learner.UpdateConfig(micro_batch=micro_batch, micro_tokens=micro_tokens)
    model, opt = ours_model(model_dir, dtype, lr)

    def ours(rows):
        micro, denom, _ = learner.micro_batches(rows, cfg, pad_id, CPU)
        olds = [m.logp_sampler for m in micro]
        t0 = time.perf_counter()
        sums, _ = learner.update(model, opt, micro, olds, [None] * len(micro), denom, cfg)
        return time.perf_counter() - t0, float(sums["loss"])
    plain, popt = plain_model(model_dir, lr)
    eps_low, eps_high = cfg.clip_low, cfg.clip_high

    def loop(rows):
        rows = sorted(rows, key=lambda s: len(s["ids"]))  # as micro_batches: similar lengths
        # right-padded: ids, attn [B, T], sel [B, T-1], old, adv [N] at the policy tokens
        micro = [grpo.collate(rows[a:a + micro_batch], pad_id, CPU)
                 for a in range(0, len(rows), micro_batch)]
        t0 = time.perf_counter()
        n = sum(int(sel.sum()) for _, _, _, sel, _, _ in micro)  # the step's policy tokens
        total = 0.0
        for ids, attn, _, sel, old, adv in micro:
            with torch.autocast("cpu", torch.bfloat16, enabled=dtype == "bf16"):
                logits = plain(input_ids=ids, attention_mask=attn).logits  # [B, T, V]
            logp = logits[:, :-1].float().log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
            ratio = torch.exp(logp[sel] - old)  # [N]
            pg = -torch.minimum(ratio * adv, ratio.clamp(1 - eps_low, 1 + eps_high) * adv)
            loss = pg.sum() / n
            loss.backward()
            total += loss.item()
        plain_finish(plain, popt)
        return time.perf_counter() - t0, total
    return {"learner.update": ours, "plain loop": loop}

#### the two sides, alternating

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

def n_tokens(batch):
    """The tokens of a step's rows (sft's (ids, mask, images) or the update's dicts)."""
    return sum(len(r[0] if isinstance(r, tuple) else r["ids"]) for r in batch)

def run(sides, batches, profile=0):
    """Each step's rows through both sides, alternating which goes first: {name: [(seconds,
    loss, tokens)] a step}, and the profiler (profile: K > 0) or None."""
    names = list(sides)
    recs = {name: [] for name in names}
    with (torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if profile
          else contextlib.nullcontext()) as prof:
        for s, batch in enumerate(batches):
            for name in names[::-1] if s % 2 else names:
                with torch.profiler.record_function(name):
                    recs[name].append((*sides[name](batch), n_tokens(batch)))
    return recs, prof

def report(title, recs, prof, profile):
    """The table: each side's median step, tokens a second, first loss; the ratio; the profile."""
    names = list(recs)
    print(f"\n{title}, median of steps 2-{len(recs[names[0]])}:")
    for name in names:
        med = statistics.median(s for s, _, _ in recs[name][1:])
        tok_s = sum(n for *_, n in recs[name][1:]) / sum(s for s, *_ in recs[name][1:])
        print(f"  {name:15s} {med:7.2f} s a step, {tok_s:6.0f} tokens/s, "
              f"first step's loss {recs[name][0][1]:.4f}")
    # each step's two sides ran the same rows: the ratio is the median of the steps' ratios (a
    # ratio of the medians would set one step's length against another's)
    ratio = statistics.median(p / o for (o, *_), (p, *_) in zip(recs[names[0]][1:],
                                                               recs["plain loop"][1:]))
    print(f"  ratio plain / {names[0]}: {ratio:.2f}x, the median step's (goal >= 1.0)")
    for name in names if profile else []:
        print(f"  {name}: the top {profile} ops by self CPU time a step")
        for op, sec, share in top_ops(prof, name, profile):
            print(f"    {op[:48]:48s} {sec:7.3f} s {share:6.1%}")

def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/SmolLM2-135M-Instruct")
    ap.add_argument("--data", default="data/mini/traj-top1", help="synth.py folder (train.jsonl)")
    ap.add_argument("--stages", nargs="+", default=["sft", "update"], choices=["sft", "update"])
    ap.add_argument("--steps", type=int, default=6, help="optimizer steps a side (first untimed)")
    ap.add_argument("--batch_size", type=int, default=1)
    ap.add_argument("--grad_accum", type=int, default=2, help="the main job's (Makefile SFT_ACCUM)")
    ap.add_argument("--pack_tokens", type=int, default=0, help="sft.py's --pack_tokens")
    ap.add_argument("--update_rows", type=int, default=8, help="rows an update step")
    ap.add_argument("--micro_batch", type=int, default=2, help="stepgrpo.py's default")
    ap.add_argument("--micro_tokens", type=int, default=0,
                    help="stepgrpo.py's --micro_tokens (ours only)")
    ap.add_argument("--max_len", type=int, default=2048, help="sft.py's default")
    ap.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"])
    ap.add_argument("--lr", type=float, default=4e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", type=int, default=0, help="print each side's top N ops (0: none)")
    args = ap.parse_args()
    dtype = trainutil.resolve_dtype(args.dtype, CPU)
    trainutil.init_group(1, device=CPU)
    tok, _, rows, _ = sft.load_inputs(args.model, args.data, ["train"], None, args.max_len, print)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    perm = torch.randperm(len(rows), generator=torch.Generator().manual_seed(args.seed)).tolist()
    head = f"{dtype}, {torch.get_num_threads()} threads"
    torch.manual_seed(args.seed)
    if "sft" in args.stages:
        G = args.batch_size * args.grad_accum
        batches = [[rows[i] for i in perm[s * G:(s + 1) * G]] for s in range(args.steps)]
        sides = sft_sides(args.model, tok, pad_id, args.batch_size, args.grad_accum, dtype, args.lr,
                          args.pack_tokens)
        packed = f", packed by {args.pack_tokens} tokens" if args.pack_tokens else ""
        report(f"SFT step, {args.batch_size} x {args.grad_accum} rows{packed}, {head}",
               *run(sides, batches, args.profile), args.profile)
    if "update" in args.stages:
        U = args.update_rows
        picked = [rows[i] for i in perm[-U * args.steps:]]
        urows = update_rows(picked, args.model, args.seed)
        batches = [urows[s * U:(s + 1) * U] for s in range(args.steps)]
        sides = update_sides(args.model, pad_id, args.micro_batch, dtype, args.lr,
                             args.micro_tokens)
        ours = (f" (ours end to end, {args.micro_tokens} tokens a micro-batch)"
                if args.micro_tokens else "")
        report(f"Step-GRPO update, {U} rows in micro-batches of {args.micro_batch}{ours}, {head}",
               *run(sides, batches, args.profile), args.profile)

if __name__ == "__main__":
    main()
