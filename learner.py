"""
learner.py: the update phase of stepgrpo.py, one step's training rows -> the policy's (and PPO's critic's) optimizer
steps: the rows in --minibatches shares, each in micro-batches that every rank runs in equal number (FSDP2 gathers
inside each forward), the old and reference logprobs of every micro-batch before any step, GAE and the critic's
steps (critic.py), one pass of the clipped loss a minibatch (grpo.grpo_loss) with the global token mean.
"""
import math
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

import critic
import trainutil
from grpo import CLIP_LOW, collate, grpo_loss, spans_of, tis_weights, token_logprobs

TEMPERATURE = 1.0  # rollouts sample from softmax(logits / T), and the trainer's logprobs are of that distribution
GRAD_CLIP = 1.0    # global gradient norm

@dataclass
class Micro:
    """One micro-batch (grpo.collate): ids [B, T]; attn [B, T] padding or [B, 1, T, T] tree mask; pos [B, T] or None;
    sel [B, T-1] the positions predicting a policy token; old, adv [N] over those N tokens (sampler logprob,
    advantage); pix the image inputs of a VL policy ({} else); weight 0 for a stand-in (no rows);
    lengths: the rows' tokens without padding (what the update computes usefully: bench/flops.py)."""
    ids: torch.Tensor
    attn: torch.Tensor
    pos: torch.Tensor | None
    sel: torch.Tensor
    old: torch.Tensor
    adv: torch.Tensor
    pix: dict
    weight: float
    lengths: tuple = ()
    reward: torch.Tensor | None = None   # [N] PPO's token rewards (gae), then the critic's values and the returns
    values: torch.Tensor | None = None
    returns: torch.Tensor | None = None

def scaled_loss(logp, old, ref_lp, m, denom, args, ent, tis=None):
    """The one place the loss is scaled: (the loss to backprop, its part of the logged loss, kl, clipped below, clipped
    above). grpo_loss divides the micro-batch's per-token sum by denom / world (denom: micro_batches' global count of
    the minibatch): FSDP averages the gradients over ranks, so the update is the gradient of the global mean per
    policy token. The logged part is loss / world: summed over micro-batches and ranks (log_record) it is that global
    mean. tis: the truncated IS weights [N] (--tis_cap) or None."""
    world = dist.get_world_size()
    seq = spans_of(m.sel) if args.ratio == "sequence" else None  # GSPO: a completion or a span is one sequence
    loss, kl, low, high = grpo_loss(logp, old, ref_lp, m.adv, (CLIP_LOW, args.clip_high), args.kl_coef,
                                    denom / world, ent, args.entropy_coef, seq, tis)
    return loss, loss.detach() / world, kl, low, high

def micro_batches(rows, args, pad_id, device, vis=None):
    """The rows that carry a gradient, collated in micro-batches with their image inputs (vis: a VL policy), and the
    global loss denominator.
    Without a KL or an entropy term a row whose policy tokens all have advantage 0 (a unanimous group) has zero
    gradient: it is skipped, but `denom` still counts it, so the update is exactly the one over every row. Every rank runs the same
    number of micro-batches (FSDP all-gathers inside each forward), at least one: a rank with none left runs a copy
    of its first row with weight 0; and a VL policy's micro-batch without images a dummy picture (VisionIO.pixels
    always), since another rank's may have some and run the vision blocks.
    Returns [Micro], denom (the global count of policy tokens), the fraction of rows skipped."""
    rows = sorted(rows, key=lambda s: len(s["ids"]))  # micro-batches of similar lengths pad less; the loss is a global sum
    ppo = args.adv_estimator == "gae"  # GAE's advantages come later: every row counts
    live = [s for s in rows if ppo or args.kl_coef > 0 or args.entropy_coef > 0
            or any(a for a, m in zip(s["adv"], s["mask"]) if m)]
    n_micro = torch.tensor([max(1, math.ceil(len(live) / args.micro_batch))], device=device)
    dist.all_reduce(n_micro, op=dist.ReduceOp.MAX)
    chunks = [live[k * args.micro_batch:(k + 1) * args.micro_batch] for k in range(int(n_micro))]
    stand_in = rows[:1] or [dict(ids=[pad_id] * 2, mask=[0, 1], old=[0.0] * 2, adv=[0.0] * 2, reward=[0.0] * 2)]  # no rows
    pixels = lambda m, ids: vis.pixels([s.get("images", []) for s in m], device, ids, always=True) if vis else {}
    keys = ("old", "adv", "reward") if ppo else ("old", "adv")
    micro = [Micro(*c[:6], pix=pixels(m or stand_in, c[0]), weight=float(bool(m)), lengths=tuple(len(s["ids"]) for s in m),
                   reward=c[6] if ppo else None)
             for m in chunks for c in [collate(m or stand_in, pad_id, device, keys)]]
    denom = torch.tensor([sum(sum(s["mask"]) for s in rows)], dtype=torch.float64, device=device)
    dist.all_reduce(denom)
    return micro, denom.clamp(min=1).item(), 1 - len(live) / max(1, len(rows))

SUMS = ("loss", "kl", "clip_low", "clip_high", "entropy", "tokens", "tis", "tis_capped")  # update's, per policy token

def add_stats(sums, weight, loss, kl, low, high, entropy, tis=None, cap=0.0):
    """sums[k] += weight x this micro-batch's loss and its per-token sums (float64 scalars on the data's device)."""
    vals = dict(loss=loss.detach(), kl=kl.sum(), clip_low=low.sum(), clip_high=high.sum(), entropy=entropy.sum(),
                tokens=torch.ones_like(kl).sum())
    if tis is not None:
        vals.update(tis=tis.sum(), tis_capped=(tis >= cap).sum())
    for k, v in vals.items():
        sums[k] += weight * v.double()

def score_old(model, ref, micro, args, suppress=()):
    """Before the update: each micro-batch's old logprobs (the sampler's; --old_logprobs trainer: the trainer's own,
    R1-Router's released code via EasyR1, summing |sampler - trainer| into old_gap), the reference's (None without
    a KL term; ref None: the policy is LoRA and its adapters go off, trainutil.reference) and the trainer's own where
    --old_logprobs trainer or --kl_in_reward asks for them (None else). suppress: token ids the engines never sample
    (token_logprobs). Returns [old], [ref], [trainer's], old_gap."""
    T, olds, refs, mine_all = TEMPERATURE, [], [], []
    old_gap = torch.zeros((), dtype=torch.float64, device=micro[0].ids.device)
    with torch.no_grad():
        for m in micro:
            old, ref_lp, mine = m.old, None, None
            if args.kl_coef > 0 or args.kl_in_reward > 0:
                with trainutil.reference(model, ref) as r:
                    ref_lp = token_logprobs(r, m.ids, m.attn, m.sel, m.pos, T, pix=m.pix, suppress=suppress)[0]
            if args.old_logprobs == "trainer" or args.kl_in_reward > 0:
                mine = token_logprobs(model, m.ids, m.attn, m.sel, m.pos, T, pix=m.pix, suppress=suppress)[0]  # [N]
            if args.old_logprobs == "trainer":
                old_gap += m.weight * (mine - old).abs().sum().double()
                old = mine
            olds.append(old)
            refs.append(ref_lp)
            mine_all.append(mine)
    return olds, refs, mine_all, old_gap

def update(model, opt, micro, olds, refs, denom, args, suppress=()):
    """One pass of the clipped loss over one minibatch's micro-batches, one optimizer step. With --tis_cap C each
    token's loss is weighted by min(exp(old - sampler), C), old the trainer's (grpo.tis_weights). Returns this rank's
    sums (SUMS over its policy tokens) and the global grad norm."""
    sums = {k: torch.zeros((), dtype=torch.float64, device=micro[0].ids.device) for k in SUMS}
    for m, old, ref_lp in zip(micro, olds, refs):
        logp, ent = token_logprobs(model, m.ids, m.attn, m.sel, m.pos, TEMPERATURE, args.entropy_coef > 0, m.pix,
                                   suppress)  # [N] each
        ref_lp = logp.detach() if ref_lp is None or args.kl_coef == 0 else ref_lp  # no reference: KL term 0
        tis = tis_weights(old, m.old, args.tis_cap) if args.tis_cap else None  # m.old: the sampler's logprobs
        loss, logged, kl, low, high = scaled_loss(logp, old, ref_lp, m, denom, args, ent, tis)
        (loss * m.weight).backward()
        add_stats(sums, m.weight, logged, kl, low, high, ent.detach(), tis, args.tis_cap)
    grad_norm = trainutil.clip_grad_norm(model, GRAD_CLIP)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return sums, grad_norm

def minibatch_rows(rows, k, seed):
    """--minibatches k: the rollout's rows shuffled (seeded by the step: an exact resume) into k shares of near-equal
    size, an optimizer step each (Search-R1's and verl's ppo_mini_batch_size); k = 1: [rows] as they are, today's one
    update bit for bit."""
    if k == 1:
        return [rows]
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed)).tolist()
    return [[rows[i] for i in order[j::k]] for j in range(k)]

def learn(model, ref, opt, crit, rows, args, pad_id, device, vis, seed, warmup, peak, timing):
    """The update phase of one step: the rows in --minibatches shares (micro_batches each), every micro-batch's old
    and reference logprobs before any step, PPO's GAE and critic steps (crit), then one policy step a minibatch
    (none while the critic warms up). Fills timing; returns the micro-batches and the sums (SUMS, old_gap, PPO's
    critic sums) over the minibatches (loss and value loss: their mean), and the mean grad norm."""
    t = time.perf_counter()
    shares = [micro_batches(c, args, pad_id, device, vis) for c in minibatch_rows(rows, args.minibatches, seed)]
    timing["skipped"] = float(np.mean([sk for *_, sk in shares]))
    flat, sup, K = [m for mb, *_ in shares for m in mb], vis.special_ids if vis else (), len(shares)
    cuts = np.cumsum([0] + [len(mb) for mb, *_ in shares])  # shares[j]'s micro-batches: flat[cuts[j]:cuts[j + 1]]
    with peak("update"):
        olds, refs, mine, old_gap = score_old(model, ref, flat, args, sup)
    sums = {k: torch.zeros((), dtype=torch.float64, device=device) for k in SUMS}
    if crit:
        t_c = time.perf_counter()
        with peak("critic"):
            critic.advantages(crit[0], flat, mine, refs, args)  # whitened over the whole rollout
            out = [critic.update(*crit, mb, denom, args) for mb, denom, _ in shares]
        sums["critic"] = critic.combine([c for c, _ in out])
        timing["critic_grad_norm"] = float(np.mean([g for _, g in out]))
        timing["critic_s"] = time.perf_counter() - t_c
    norms = []
    with peak("update"):
        for j, (mb, denom, _) in enumerate(shares if not warmup else []):  # warm-up: the policy waits for its critic
            part, g = update(model, opt, mb, olds[cuts[j]:cuts[j + 1]], refs[cuts[j]:cuts[j + 1]], denom, args, sup)
            norms.append(g)
            for k in SUMS:
                sums[k] += part[k] / (K if k == "loss" else 1)
    if warmup:
        sums["tokens"] += sum(m.weight * len(m.old) for m in flat)
    sums["old_gap"] = old_gap
    timing["update_s"] = time.perf_counter() - t - timing.get("critic_s", 0.0)
    return flat, sums, float(np.mean(norms)) if norms else 0.0
