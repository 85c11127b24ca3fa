"""
grpo.py: the policy-gradient arithmetic of stepgrpo.py, free of engines and process groups:
group-relative advantages (per step and per trajectory, with or without the std division), PPO's GAE
over policy tokens with its whitening and its clipped value loss, the split of a routing step's
credit between its wording and its KB tokens, the PPO-clipped token loss with its k3 KL and entropy
terms, and the packing of a group's completions behind one shared prompt (a tree attention mask) or,
for 3-D positions, a row each. Each formula sits next to its function; tests check them by hand.
"""
import math
from collections import Counter

import numpy as np
import torch
import torch.utils.checkpoint

import trainutil
from transcript import truncate

CLIP_LOW = 0.2  # PPO's ratio clip below 1 (verl's clip_ratio_low);
                # above it, stepgrpo.py --clip_high
OVERLONG_BUFFER = 0.2  # DAPO's soft overlong punishment: L_cache = 0.2 L_max
                       # (its 4,096 of 20,480 tokens)

def norm(v, eps=1e-4, std=True):
    """(v - mean) / (std + eps) over a group, with the unbiased std as GRPO implementations;
    exactly 0 if all equal. std False: v - mean (Dr. GRPO: small reward differences are not blown
    up to +-1)."""
    v = np.asarray(v, dtype=np.float64)
    if len(v) < 2 or v.min() == v.max():  # exactly 0, not v - mean's rounding error / eps (~1e-13)
        return np.zeros_like(v)
    return (v - v.mean()) / (v.std(ddof=1) + eps) if std else v - v.mean()

def group_relative(r, std):
    """GRPO's estimator: norm(r) within the group (--adv_std: divided by its std; else Dr. GRPO's
    r - mean)."""
    return norm(r, std=std)

def from_critic(r, std):
    """PPO's (--adv_estimator gae): nothing at the group; GAE over the critic's values gives each
    token's advantage in the update (critic.advantages, gae)."""
    return np.zeros_like(r)

# --adv_estimator: name -> f(rewards [n], std) -> [n]
ESTIMATORS = {"grpo": group_relative, "gae": from_critic}

def advantages(rewards, estimator="grpo", std=False, scale=1.0):
    """The advantages [n] of a group's n rewards, times `scale` (a routing step's --balance_kb
    factor). Every rollout mode calls it on every set of samples it compares: a step's n completions
    (teacher_prefix, branch), the samples' spans of one kind and step and their outcomes
    (onpolicy: group_advantages)."""
    return scale * ESTIMATORS[estimator](np.asarray(rewards, dtype=np.float64), std)

def group_advantages(spans, rewards, outcomes, mode="step", scale=None, std=True, estimator="grpo"):
    """onpolicy, one group (the n samples of a question). spans[i]: span dicts of sample i,
    rewards[i]: their rewards, outcomes[i]: R_i. Returns
    A[i][j] = c_(kind, step) adv_(kind, step)(r_ij) + adv(R_i), where adv_(kind, step) runs over
    the samples that have a span of that kind at that step (0 if only one has it) and
    c = scale.get((kind, step), 1) (--balance_kb); mode "outcome": A[i][j] = adv(R_i) (plain
    GRPO). adv: `advantages` by `estimator`."""
    R = advantages(outcomes, estimator, std)
    adv = [[float(R[i]) for _ in s] for i, s in enumerate(spans)]
    if mode == "outcome":
        return adv
    by_key = {}
    for i, s in enumerate(spans):
        for j, sp in enumerate(s):
            by_key.setdefault((sp["kind"], sp["step"]), []).append((i, j))
    for key, members in by_key.items():
        a = advantages([rewards[i][j] for i, j in members], estimator, std,
                       (scale or {}).get(key, 1.0))
        for (i, j), a_ij in zip(members, a):
            adv[i][j] += float(a_ij)
    return adv

def token_advantages(n_tokens, spans, adv):
    """[n_tokens]: span j's advantage adv[j] on its token range, 0 on every other token."""
    out = [0.0] * n_tokens
    for sp, a in zip(spans, adv):
        out[sp["start"]:sp["end"]] = [a] * (sp["end"] - sp["start"])
    return out

def gae(rewards, values, mask, gamma=1.0, lam=1.0):
    """Generalized advantage estimation over the policy tokens of each row, as verl computes it for
    multi-turn rollouts. rewards, values, mask: [B, T]; mask marks the policy's tokens (a step of
    the MDP). Backwards over t:
        delta_t = r_t + gamma V_next - V_t,   A_t = delta_t + gamma lam A_next,   R_t = A_t + V_t
    where V_next and A_next are those of the next policy token (0 past the last): a token off the
    mask (retrieved evidence, the chat template) is neither a step nor a reset, and both carry
    across it. Returns (advantages, returns) [B, T], 0 off the mask, before any whitening
    (whiten)."""
    B, T = rewards.shape
    adv, next_v, next_a = torch.zeros_like(rewards), rewards.new_zeros(B), rewards.new_zeros(B)
    m, mask = mask.to(rewards.dtype), mask.bool()  # a bool or a 0/1 float mask
                                                   # (verl's response_mask)
    for t in reversed(range(T)):
        a = rewards[:, t] + gamma * next_v - values[:, t] + gamma * lam * next_a  # [B]
        adv[:, t] = a * m[:, t]
        next_v = torch.where(mask[:, t], values[:, t], next_v)
        next_a = torch.where(mask[:, t], a, next_a)
    return adv, (adv + values) * m

def whiten(x, count, total, total_sq, eps=1e-8):
    """(x - mean) / sqrt(var + eps) with the mean and the unbiased variance of `count` values whose
    sum is `total` and sum of squares `total_sq` (a whole batch's, summed over ranks: verl's
    masked_whiten of the batch's advantages)."""
    mean = total / count
    var = (total_sq - count * mean ** 2) / max(count - 1, 1)
    return (x - mean) / math.sqrt(max(var, 0.0) + eps)

def value_loss(values, old_values, returns, clip, denom):
    """PPO's clipped value loss (verl's compute_value_loss), values, old_values, returns [N] over
    policy tokens:
        0.5 max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2)
    summed and divided by the global `denom` (the batch's policy tokens: a token mean). Returns the
    loss and the per-token indicator that the clipped term was the larger (vf_clipfrac)."""
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    a, b = (values - returns) ** 2, (clipped - returns) ** 2
    return 0.5 * torch.maximum(a, b).sum() / denom, (b > a).float()

def token_rewards(n_tokens, spans, step_rewards, outcome, mode="step"):
    """PPO's token-level rewards [n_tokens]: the outcome R on the last token of the last span (the
    final answer's; a trajectory without one, cut by a format failure or the context, has R = 0),
    and with mode "step" (Step-PPO) each span's step reward on its own last token, so GAE carries
    each step's credit back from where it was earned instead of through group advantages; 0 on every
    other token."""
    out = [0.0] * n_tokens
    for sp, r in zip(spans, step_rewards):
        out[sp["end"] - 1] += r if mode == "step" else 0.0
    if spans:
        out[spans[-1]["end"] - 1] += outcome
    return out

def token_logprobs(model, ids, attn, sel, pos=None, temperature=1.0, entropy_grad=False, pix=None,
                   suppress=()):
    """Logprob of each selected next token and the entropy of its prediction, both [N], where
    sel [B, T-1] marks the positions (t predicts token t + 1) that are policy tokens: lm_head and
    softmax run on those alone. Both are of the distribution the engine sampled from,
    softmax(logits / temperature) (EasyR1 divides the logits the same way), without the
    `suppress`ed tokens (a VL policy's image tokens, which the engines never sample).
    attn: [B, T] padding mask, or [B, 1, T, T] tree mask with position ids pos [B, T] for packed
    groups; pix: a VL batch's image inputs. entropy_grad: keep the entropy's graph
    (--entropy_coef). The fp32 softmax work runs LOGIT_CHUNK rows at a time (chunk_logprobs)."""
    # [N, V] in the compute dtype
    logits = trainutil.selected_logits(model, ids, sel, attn, pos, pix)
    target = ids[:, 1:][sel]  # [N]
    parts = [chunk_logprobs(x, t, temperature, suppress, entropy_grad)
             for x, t in zip(logits.split(LOGIT_CHUNK), target.split(LOGIT_CHUNK))]
    return torch.cat([lp for lp, _ in parts]), torch.cat([h for _, h in parts])

LOGIT_CHUNK = 512  # rows of the [N, V] logits whose fp32 softmax work is alive at once (verl
                   # chunks its entropy by 2,048 rows)

def chunk_logprobs(logits, target, temperature, suppress, entropy_grad):
    """token_logprobs' fp32 part for one chunk of rows: logits [C, V], target [C] -> ([C], [C]).
    Under autograd it is checkpointed (torch.utils.checkpoint): its fp32 [C, V] tensors are
    recomputed in the backward instead of kept, so the update holds the compute-dtype logits and
    their gradient, not memory.py's LOSS_COPIES fp32 copies of all of them. The same operations on
    each row as on the whole [N, V]: the same values and gradients, bit for bit."""
    if torch.is_grad_enabled() and logits.requires_grad:
        return torch.utils.checkpoint.checkpoint(softmax_part, logits, target, temperature,
                                                 suppress, entropy_grad, use_reentrant=False)
    return softmax_part(logits, target, temperature, suppress, entropy_grad)

def softmax_part(logits, target, temperature, suppress, entropy_grad):
    """(log softmax(logits / temperature)[target], its entropy), [C] each. The gather comes first:
    the checkpoint's recomputation stops at the last tensor the backward needs, so a no-grad
    entropy is not computed again there."""
    x = logits.float() / temperature  # [C, V]
    if len(suppress):
        x[:, suppress] = float("-inf")
    logp = x.log_softmax(-1)  # [C, V]
    picked = logp.gather(-1, target.unsqueeze(-1)).squeeze(-1)  # [C]
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        # [C]; 0 log 0 = 0
        entropy = -(logp.exp() * logp.masked_fill(logp == float("-inf"), 0.0)).sum(-1)
    return picked, entropy

def policy_ratio(logp, old, seq=None):
    """The importance ratio [N] of the clipped loss. seq None (--ratio token, PPO's):
    exp(logp_t - old_t). seq [N] (--ratio sequence, GSPO's, arXiv 2507.18071, as verl's
    compute_policy_loss_gspo): each token's sequence index (spans_of), and every token of
    sequence i gets
        s_i = exp(mean_{t in i}(logp_t - old_t)),   written  exp(logp_t - sg[logp_t] + sg[log s_i])
    (GSPO-token: the value of s_i, the gradient s_i grad logp_t), log-clamped at 10 as verl's."""
    if seq is None:
        return torch.exp(logp - old)
    d, n = (logp - old).detach(), len(seq)  # n bounds the sequences' count
                                            # (no host sync for their max)
    mean = torch.zeros(n, dtype=d.dtype, device=d.device).index_add_(0, seq, d) / \
        torch.zeros(n, dtype=d.dtype,
                    device=d.device).index_add_(0, seq, torch.ones_like(d)).clamp(min=1)  # [n]
    return torch.exp((logp - logp.detach() + mean[seq]).clamp(max=10.0))

def spans_of(sel):
    """[N]: the index of the contiguous run of selected positions each selected one belongs to
    (row-major), sel [B, T-1]: a step's completion in a packed group or a span of a trajectory,
    GSPO's sequence."""
    prev = torch.zeros_like(sel)
    prev[:, 1:] = sel[:, :-1]
    return (sel & ~prev).flatten().cumsum(0).view_as(sel)[sel] - 1

def tis_weights(old, sampler, cap):
    """Truncated importance sampling (--tis_cap C; verl's rollout correction, token-level truncate):
    the weights w_t = min(pi_old(t) / pi_sampler(t), C) = min(exp(old_t - sampler_t), C) [N],
    detached, that correct the loss for the sampler (vLLM) not being the trainer: old is the
    trainer's recomputed logprob, sampler the engine's."""
    return torch.exp(old - sampler).clamp(max=cap).detach()

def grpo_loss(logp, old, ref, adv, clip, kl_coef, denom, entropy=None, entropy_coef=0.0, seq=None,
              tis=None):
    """logp, old, ref, adv, entropy: [N] over the policy tokens of a micro-batch;
    clip = (eps_low, eps_high).
      ratio_t = exp(logp_t - old_t)   (old: the sampling engine's logprobs, or with --old_logprobs
                trainer the trainer's; seq: GSPO's sequence ratio instead, policy_ratio)
      l_t = w_t max(-ratio_t A_t, -clip(ratio_t, 1 - eps_low, 1 + eps_high) A_t)   (verl's
                compute_policy_loss; eps_high > eps_low: DAPO's clip-higher; w_t: tis, the
                truncated IS weights, else 1)
            + kl_coef (exp(ref - logp) - (ref - logp) - 1)   (k3 KL)
            - entropy_coef H_t   (EasyR1's entropy_coeff)
    Returns the loss to backprop, already divided by the global `denom` (the policy tokens of the
    global batch: every token weighs the same, DAPO's token-level mean), the per-token kl, and the
    per-token indicators that the clip acted below (A < 0, ratio < 1 - eps_low) and
    above (A > 0, ratio > 1 + eps_high): verl's pg_clipfrac is their sum."""
    ratio = policy_ratio(logp, old, seq)
    pg = -torch.minimum(ratio * adv, ratio.clamp(1 - clip[0], 1 + clip[1]) * adv)
    pg = pg * tis if tis is not None else pg
    kl = torch.exp(ref - logp) - (ref - logp) - 1  # k3 estimator of KL(policy || ref)
    per_tok = pg + kl_coef * kl - (entropy_coef * entropy if entropy_coef else 0.0)
    loss = per_tok.sum() / denom
    r = ratio.detach()
    return (loss, kl.detach(), ((adv < 0) & (r < 1 - clip[0])).float(),
            ((adv > 0) & (r > 1 + clip[1])).float())

def was_cut(tok, ids, budget, stop):
    """Whether the engine stopped a completion `ids` at its budget of new tokens before any of its
    stop strings."""
    return len(ids) >= budget and not any(st in tok.decode(ids) for st in stop)

def overlong(n_tokens, budget, cut, mode):
    """DAPO's overlong handling of one completion of n_tokens at a step budget of `budget` new
    tokens (cut: the engine stopped it at the budget, before its stop string).
    Returns (reward added, trained):
      mask     a cut completion is not trained (overlong filtering): (0, not cut)
      penalty  soft overlong punishment, L_max the budget, L_cache OVERLONG_BUFFER of it:
               0 if n <= L_max - L_cache, ((L_max - L_cache) - n) / L_cache above
               (-1 at the budget), trained
      none     (0, True)"""
    if mode == "mask":
        return 0.0, not cut
    if mode == "penalty":
        cache = max(1, round(OVERLONG_BUFFER * budget))
        return min(0.0, ((budget - cache) - n_tokens) / cache), True
    return 0.0, True

def split_credit(tok, group, rewards, kb_part, std, scale, estimator="grpo"):
    """--route_credit split: per completion, per-token advantages. The part of the route reward its
    KB choice earned (kb_part: steprewards.kb_credit; R1-Router's 0.5 [KB = gold's]) gets its group
    advantage on the tokens from <ret> on, where the KB is written; the rest of the reward
    (R1-Router's: the sub-question's cosine, the format term) on the tokens before. So the
    decision's credit is not diluted over the ~40 tokens of the step's wording, and wording noise
    does not reach the decision tokens."""
    a_kb = advantages(kb_part, estimator, std, scale)
    a_rest = advantages([r - k for r, k in zip(rewards, kb_part)], estimator, std, scale)
    cuts = [ret_start(tok, ids) for ids, _ in group]
    return [[float(a_rest[i])] * k + [float(a_kb[i])] * (len(ids) - k)
            for i, ((ids, _), k) in enumerate(zip(group, cuts))]

def ret_start(tok, ids):
    """The number of tokens before the first one that completes "<ret>" (len(ids) if none does):
    transcript.truncate's search for the first prefix holding a stop string."""
    if "<ret>" not in tok.decode(ids):
        return len(ids)
    return len(truncate(tok, ids, ids, ["<ret>"], None)[0]) - 1

def choice_entropy(choices):
    """Entropy in bits of the empirical distribution of a group's routing choices (a malformed route
    is one more outcome): 0 when every sample made the same choice, which leaves the route decision
    no relative advantage."""
    n = len(choices)
    return float(-sum(c / n * math.log2(c / n) for c in Counter(choices).values())) if n else 0.0

def pack_group(prefix, group, adv, keep=None):
    """The n completions of one prompt as one row, the prompt (but its last token) once and then,
    per completion, that last token and the completion: a branch. seg gives each token's branch
    (-1: the shared prompt), pos its position id (a branch continues the prompt). collate's tree
    mask lets a branch see the prompt and itself only, so the repeated last token makes each policy
    token's left neighbour its true predecessor, and the row scores every completion exactly as n
    separate rows (~3x less compute than those on CPU). keep[i] False: completion i stays in the row
    untrained, mask 0 (--overlong mask)."""
    L = len(prefix) - 1
    row = dict(ids=list(prefix[:-1]), mask=[0] * L, old=[0.0] * L, adv=[0.0] * L, seg=[-1] * L,
               pos=list(range(L)))
    for i, ((ids, lps), a) in enumerate(zip(group, adv)):
        # a: one value, or one a token
        a = [0.0, *a] if isinstance(a, list) else [float(a)] * (1 + len(ids))
        trained = 1 if keep is None or keep[i] else 0
        for key, vals in (("ids", [prefix[-1], *ids]), ("mask", [0] + [trained] * len(ids)),
                          ("old", [0.0, *lps]), ("adv", a), ("seg", [i] * (1 + len(ids))),
                          ("pos", list(range(L, L + 1 + len(ids))))):
            row[key] += vals
    return row

def group_rows(prefix, group, adv, images=(), mrope=False, keep=None):
    """The training rows of one group, the n completions (ids, logprobs) of the prompt `prefix` with
    their advantages adv (each one value or one a token): one packed row (pack_group), or for a
    policy with 3-D positions (mrope, a VL policy's) a row per completion. images: the prefix's
    pictures ([[start, n, path]]). keep[i] False: completion i untrained (pack_group)."""
    if not mrope:
        return [dict(pack_group(prefix, group, adv, keep), images=images)]
    P, keep = len(prefix), keep or [True] * len(group)
    return [dict(ids=prefix + ids, mask=[0] * P + [int(k)] * len(ids), old=[0.0] * P + list(lps),
                 adv=[0.0] * P + (a if isinstance(a, list) else [float(a)] * len(ids)),
                 images=images)
            for (ids, lps), a, k in zip(group, adv, keep)]

def merge_rows(rows):
    """Training rows end to end as one (learner's --micro_tokens): each keeps its tree (seg; -1
    throughout for a row that is no packed group) and its position ids, and doc gives each token its
    row's index, so collate's mask lets no token see another row's."""
    out = {k: [v for s in rows for v in s[k]] for k in ("ids", "mask", "old", "adv")}
    out["seg"] = [v for s in rows for v in s.get("seg", [-1] * len(s["ids"]))]
    out["pos"] = [v for s in rows for v in s.get("pos", range(len(s["ids"])))]
    out["doc"] = [r for r, s in enumerate(rows) for _ in s["ids"]]
    return out

def tree_visible(seg, doc, b, q, kv):
    """Whether token q of packed row b (pack_group, merge_rows) sees token kv: kv not after q, of
    the same row (doc), and in the shared prompt (seg -1) or in q's own branch. seg, doc [B, T]
    (padding: 1 << 30, -1). The indices broadcast (collate's dense mask) or are scalars
    (FlexAttention's mask_mod)."""
    return (kv <= q) & (doc[b, kv] == doc[b, q]) & ((seg[b, kv] == -1) | (seg[b, kv] == seg[b, q]))

def tree_block_mask(seg, doc):
    """The tree mask of seg, doc [B, T] as a FlexAttention BlockMask: blocks no query sees are
    skipped (~half of a group's attention with long completions). Its compiled kernels have a
    backward on CUDA only (torch 2.13)."""
    from torch.nn.attention.flex_attention import create_block_mask
    B, T = seg.shape
    return create_block_mask(lambda b, h, q, kv: tree_visible(seg, doc, b, q, kv), B, None, T, T,
                             device=seg.device)

def collate(rows, pad_id, device, keys=("old", "adv"), flex=False):
    """Right-pad to ids [B, T]; sel [B, T-1] marks positions whose next token is a policy token; the
    per-token values `keys` of those tokens (old logprobs and advantages; PPO's rows add "reward"),
    each flattened to [N] in sel's (row-major) order. attn: the padding mask [B, T] and pos None,
    or, if a row is packed (pack_group, merge_rows), a tree mask [B, 1, T, T] (flex: a BlockMask of
    it, for a model loaded with FlexAttention) and position ids [B, T]."""
    T = max(len(s["ids"]) for s in rows)
    ids = torch.tensor([s["ids"] + [pad_id] * (T - len(s["ids"])) for s in rows], device=device)
    attn = torch.tensor([[1] * len(s["ids"]) + [0] * (T - len(s["ids"])) for s in rows],
                        device=device)
    sel = torch.tensor([s["mask"][1:] + [0] * (T - len(s["ids"])) for s in rows],
                       device=device).bool()
    pick = lambda key: torch.tensor([v for s in rows for v, m in zip(s[key][1:], s["mask"][1:])
                                     if m], device=device).float()
    pos = None
    if any("seg" in s for s in rows):
        seg, doc = (torch.tensor([s.get(k, [v] * len(s["ids"])) + [p] * (T - len(s["ids"]))
                                  for s in rows], device=device)
                    for k, v, p in (("seg", -1, 1 << 30), ("doc", 0, -1)))  # [B, T] each
        i = torch.arange(T, device=device)
        # [B, 1, T, T]
        attn = tree_block_mask(seg, doc) if flex else tree_visible(
            seg, doc, torch.arange(len(rows), device=device)[:, None, None], i[:, None], i)[:, None]
        pos = torch.tensor([s.get("pos", list(range(len(s["ids"])))) + [0] * (T - len(s["ids"]))
                            for s in rows], device=device)
    return (ids, attn, pos, sel, *map(pick, keys))
