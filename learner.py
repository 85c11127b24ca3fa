"""
learner.py: the update phase of stepgrpo.py. One step's training rows -> the policy's (and PPO's
critic's) optimizer steps: the rows in --minibatches shares, each in micro-batches that every rank
runs in equal number (FSDP2 gathers inside each forward); the old and reference logprobs of every
micro-batch before any step; GAE and the critic's steps (critic.py); then one pass of the clipped
loss a minibatch (grpo.grpo_loss), the global token mean.
"""
import math
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

import critic
import trainutil
from grpo import CLIP_LOW, collate, grpo_loss, merge_rows, spans_of, tis_weights, token_logprobs

TEMPERATURE = 1.0  # rollouts sample from softmax(logits / T);
                   # the trainer's logprobs are of that distribution
GRAD_CLIP = 1.0    # global gradient norm

@dataclass(frozen=True)
class UpdateConfig:
    """The update's settings (stepgrpo.py's flags; docs/stepgrpo.md gives each one's source)."""
    micro_batch: int = 2            # rows a forward/backward
    micro_tokens: int = 0           # or rows end to end up to this many tokens (0: off)
    minibatches: int = 1            # optimizer steps a rollout,
                                    # each over a shuffled share of its rows
    clip_low: float = CLIP_LOW      # the ratio's clip below 1
    clip_high: float = 0.2          # the ratio's clip above 1
    kl_coef: float = 0.0            # k3 KL to the reference in the loss
    entropy_coef: float = 0.0       # entropy bonus
    ratio: str = "token"            # token (PPO) | sequence (GSPO)
    tis_cap: float = 0.0            # truncated importance sampling's cap (0: off)
    old_logprobs: str = "sampler"   # the ratio's old logprobs: the sampler's,
                                    # or the trainer's recomputed
    kl_in_reward: float = 0.0       # PPO: -beta (logp_old - logp_ref) in the token rewards
    gae: bool = False               # PPO: advantages from the critic in the update
                                    # (every row counts)
    flex: bool = False              # packed groups' tree masks as FlexAttention block masks

@dataclass
class Micro:
    """One micro-batch (grpo.collate): ids [B, T]; attn [B, T] padding or [B, 1, T, T] tree mask;
    pos [B, T] or None; sel [B, T-1] the positions predicting a policy token; logp_sampler, adv [N]
    over those N tokens (the engine's logprob, the advantage); pix the image inputs of a VL policy
    ({} else); weight 0 for a stand-in (no rows); lengths: the rows' tokens without padding (what
    the update computes usefully: bench/flops.py)."""
    ids: torch.Tensor
    attn: torch.Tensor
    pos: torch.Tensor | None
    sel: torch.Tensor
    logp_sampler: torch.Tensor
    adv: torch.Tensor
    pix: dict
    weight: float
    lengths: tuple = ()
    reward: torch.Tensor | None = None   # [N] PPO's token rewards (gae),
                                         # then the critic's values and the returns
    values: torch.Tensor | None = None
    returns: torch.Tensor | None = None

def micro_batches(rows, cfg, pad_id, device, vis=None):
    """The rows that carry a gradient, collated in micro-batches with their image inputs (vis: a VL
    policy), and the global loss denominator. Without a KL or an entropy term a row whose policy
    tokens all have advantage 0 (a unanimous group) has zero gradient: it is skipped, but `denom`
    still counts it, so the update is exactly the one over every row. Every rank runs the same
    number of micro-batches (FSDP all-gathers inside each forward), at least one: a rank with none
    left (micro_tokens: whose rows pack into fewer) runs a copy of its first row with weight 0; a VL
    policy's micro-batch without images a dummy picture (VisionIO.pixels always), since another
    rank's may have some and run the vision blocks.
    Returns [Micro], denom (the global count of policy tokens), the fraction of rows skipped."""
    rows = sorted(rows, key=lambda s: len(s["ids"]))  # similar lengths pad less;
                                                      # the loss is a global sum
    live = [s for s in rows if cfg.gae or cfg.kl_coef > 0 or cfg.entropy_coef > 0
            or any(a for a, m in zip(s["adv"], s["mask"]) if m)]
    # micro_tokens: a micro-batch is its rows end to end, one row (merge_rows), no padding
    chunks = (trainutil.pack(live, cfg.micro_tokens, lambda s: len(s["ids"])) if cfg.micro_tokens
              else [live[k:k + cfg.micro_batch] for k in range(0, len(live), cfg.micro_batch)])
    n_micro = torch.tensor([max(1, len(chunks))], device=device)
    dist.all_reduce(n_micro, op=dist.ReduceOp.MAX)
    chunks += [[]] * (int(n_micro) - len(chunks))
    stand_in = rows[:1] or [dict(ids=[pad_id] * 2, mask=[0, 1], old=[0.0] * 2, adv=[0.0] * 2,
                                 reward=[0.0] * 2)]  # this rank has no rows
    keys = ("old", "adv", "reward") if cfg.gae else ("old", "adv")
    micro = []
    for m in chunks:
        c = collate([merge_rows(m)] if m and cfg.micro_tokens else m or stand_in, pad_id, device,
                    keys, cfg.flex)
        pix = (vis.pixels([s.get("images", []) for s in m or stand_in], device, c[0], always=True)
               if vis else {})
        micro.append(Micro(*c[:6], pix=pix, weight=float(bool(m)),
                           lengths=tuple(len(s["ids"]) for s in m),
                           reward=c[6] if cfg.gae else None))
    denom = torch.tensor([sum(sum(s["mask"]) for s in rows)], dtype=torch.float64, device=device)
    dist.all_reduce(denom)
    return micro, denom.clamp(min=1).item(), 1 - len(live) / max(1, len(rows))

def score_old(model, ref, micro, cfg, suppress=()):
    """Before the update: each micro-batch's old logprobs (the sampler's; --old_logprobs trainer:
    the trainer's own, R1-Router's released code via EasyR1, summing |sampler - trainer| into
    old_gap), the reference's (None without a KL term; ref None: the policy is LoRA and its adapters
    go off, trainutil.reference) and the trainer's own where --old_logprobs trainer or
    --kl_in_reward asks for them (None else). suppress: token ids the engines never sample
    (token_logprobs). Returns [old], [ref], [trainer's], old_gap."""
    olds, refs, trainers = [], [], []
    old_gap = torch.zeros((), dtype=torch.float64, device=micro[0].ids.device)
    with torch.no_grad():
        for m in micro:
            old, logp_ref, logp_trainer = m.logp_sampler, None, None
            if cfg.kl_coef > 0 or cfg.kl_in_reward > 0:
                with trainutil.reference(model, ref) as r:
                    logp_ref = token_logprobs(r, m.ids, m.attn, m.sel, m.pos, TEMPERATURE,
                                              pix=m.pix, suppress=suppress)[0]
            if cfg.old_logprobs == "trainer" or cfg.kl_in_reward > 0:
                logp_trainer = token_logprobs(model, m.ids, m.attn, m.sel, m.pos, TEMPERATURE,
                                              pix=m.pix, suppress=suppress)[0]  # [N]
            if cfg.old_logprobs == "trainer":
                old_gap += m.weight * (logp_trainer - old).abs().sum().double()
                old = logp_trainer
            olds.append(old)
            refs.append(logp_ref)
            trainers.append(logp_trainer)
    return olds, refs, trainers, old_gap

SUMS = ("loss", "kl", "clip_low", "clip_high", "entropy", "tokens", "tis",
        "tis_capped")  # per policy token

def add_stats(sums, weight, loss, kl, low, high, entropy, tis=None, cap=0.0):
    """sums[k] += weight x a micro-batch's logged loss and its per-token sums (float64 on the data's
    device)."""
    vals = dict(loss=loss.detach(), kl=kl.sum(), clip_low=low.sum(), clip_high=high.sum(),
                entropy=entropy.sum(), tokens=torch.ones_like(kl).sum())
    if tis is not None:
        vals.update(tis=tis.sum(), tis_capped=(tis >= cap).sum())
    for k, v in vals.items():
        sums[k] += weight * v.double()

def minibatch_rows(rows, k, seed):
    """--minibatches k: the rollout's rows shuffled (seeded by the step: an exact resume) into k
    shares of near-equal size, an optimizer step each (Search-R1's and verl's ppo_mini_batch_size);
    k = 1: [rows] as they are."""
    if k == 1:
        return [rows]
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed)).tolist()
    return [[rows[i] for i in order[j::k]] for j in range(k)]

def update(model, opt, micro, olds, refs, denom, cfg, suppress=()):
    """One pass of the clipped loss over one minibatch's micro-batches, one optimizer step. The loss
    of a micro-batch is its per-token sum over denom / world (denom: the minibatch's global count of
    policy tokens; FSDP averages the gradients over ranks), so the step follows the gradient of the
    global mean per policy token. With --tis_cap C each token's loss is weighted by
    min(exp(old - sampler), C) (grpo.tis_weights). Returns this rank's sums (SUMS over its policy
    tokens; loss / world summed over ranks is the global mean) and the global grad norm."""
    world = dist.get_world_size()
    sums = {k: torch.zeros((), dtype=torch.float64, device=micro[0].ids.device) for k in SUMS}
    for m, old, logp_ref in zip(micro, olds, refs):
        logp, ent = token_logprobs(model, m.ids, m.attn, m.sel, m.pos, TEMPERATURE,
                                   cfg.entropy_coef > 0, m.pix, suppress)  # [N] each
        if logp_ref is None or cfg.kl_coef == 0:  # no reference: KL term 0
            logp_ref = logp.detach()
        tis = tis_weights(old, m.logp_sampler, cfg.tis_cap) if cfg.tis_cap else None  # [N] or None
        # GSPO: a completion or a span, one sequence
        seq = spans_of(m.sel) if cfg.ratio == "sequence" else None
        loss, kl, low, high = grpo_loss(logp, old, logp_ref, m.adv, (cfg.clip_low, cfg.clip_high),
                                        cfg.kl_coef, denom / world, ent, cfg.entropy_coef, seq, tis)
        trainutil.accumulate(model, last=m is micro[-1])
        (loss * m.weight).backward()
        add_stats(sums, m.weight, loss.detach() / world, kl, low, high, ent.detach(), tis,
                  cfg.tis_cap)
    grad_norm = trainutil.clip_grad_norm(model, GRAD_CLIP)  # global: every rank skips alike
    if math.isfinite(grad_norm):  # else skipped, as verl's actor does (the caller counts it)
        opt.step()
    opt.zero_grad(set_to_none=True)
    return sums, grad_norm

def learn(model, ref, opt, crit, rows, cfg, pad_id, device, vis, seed, warmup, peak, timing):
    """The update phase of one step: the rows in --minibatches shares (micro_batches each), every
    micro-batch's old and reference logprobs before any step, PPO's GAE and critic steps
    (crit: (critic, its optimizer)), then one policy step a minibatch (none while the critic warms
    up). Fills timing; returns the micro-batches, the sums (SUMS, old_gap, PPO's critic sums) over
    the minibatches (loss and value loss: their mean), the mean grad norm."""
    t = time.perf_counter()
    fewest = torch.tensor([len(rows)], device=device)
    dist.all_reduce(fewest, op=dist.ReduceOp.MIN)
    k = max(1, min(cfg.minibatches, int(fewest)))  # a share holds a row on every rank: an empty
    # one would step AdamW on its momentum alone
    shares = [micro_batches(c, cfg, pad_id, device, vis) for c in minibatch_rows(rows, k, seed)]
    timing["skipped"] = float(np.mean([sk for *_, sk in shares]))
    flat, sup, K = [m for mb, *_ in shares for m in mb], vis.special_ids if vis else (), len(shares)
    cuts = np.cumsum([0] + [len(mb) for mb, *_ in shares])  # shares[j]'s: flat[cuts[j]:cuts[j + 1]]
    with peak("update"):
        olds, refs, trainers, old_gap = score_old(model, ref, flat, cfg, sup)
    if warmup:  # no policy backward follows to reshard what score_old's forwards gathered
        trainutil.reshard(model)
    sums = {k: torch.zeros((), dtype=torch.float64, device=device) for k in SUMS}
    if crit:
        t_c = time.perf_counter()
        with peak("critic"):
            # whitened over the rollout
            critic.advantages(crit[0], flat, trainers, refs, cfg.kl_in_reward)
            out = [critic.update(*crit, mb, denom) for mb, denom, _ in shares]
        sums["critic"] = critic.combine([c for c, _ in out])
        timing["critic_grad_norm"] = float(np.mean([g for _, g in out]))
        timing["critic_s"] = time.perf_counter() - t_c
    norms = []
    with peak("update"):
        # warm-up: the critic alone
        for j, (mb, denom, _) in enumerate(shares if not warmup else []):
            a, b = cuts[j], cuts[j + 1]
            part, g = update(model, opt, mb, olds[a:b], refs[a:b], denom, cfg, sup)
            norms.append(g)
            for k in SUMS:
                sums[k] += part[k] / (K if k == "loss" else 1)
    if warmup:
        sums["tokens"] += sum(m.weight * len(m.logp_sampler) for m in flat)
    sums["old_gap"] = old_gap
    timing["nonfinite"] = sum(not math.isfinite(g) for g in norms)  # optimizer steps skipped
    timing["update_s"] = time.perf_counter() - t - timing.get("critic_s", 0.0)
    finite = [g for g in norms if math.isfinite(g)]
    return flat, sums, float(np.mean(finite)) if finite else 0.0

def check_finite(bad, skipped, step, limit):
    """Steps in a row with an optimizer step skipped for a non-finite gradient norm (update, as
    verl skips them), and one line to stop at `limit` (--max_nonfinite) of them."""
    bad = bad + 1 if skipped else 0
    if bad >= limit:
        sys.exit(f"error: step {step}: the gradient norm was not finite in {bad} steps in a row "
                 f"(--max_nonfinite {limit}), each update skipped: lower --lr, or look for inf or "
                 "NaN in the rows' logprobs and advantages")
    return bad
