"""
critic.py: PPO's critic for stepgrpo.py --adv_estimator gae (RAG-R1's and Search-R1's RL): a value
model of the policy's own kind, the starting checkpoint with its LM head swapped for a scalar head
on the last hidden state (trainutil.to_critic), FSDP2-sharded like the policy, with its own AdamW
and learning rate; with --lora_r, LoRA adapters on the frozen base plus the head. It values the
state before each policy token; grpo.gae turns its values and the token rewards into advantages and
returns, and it learns the returns by the clipped value loss.

A separate model and not a second head on the policy's backbone, as verl builds the critic Search-R1
and RAG-R1 train with: the value loss's gradients never reach the policy, the two learn at their own
rates (Search-R1: 1e-6 and 1e-5), and the critic can warm up alone (--critic_warmup). The price is a
second model's shards, gradients and Adam state (docs/gpu.md).
"""
import json
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import trainutil
from grpo import gae, value_loss, whiten

GAMMA, LAM = 1.0, 1.0   # GAE's discount and lambda over policy tokens
                        # (Search-R1's, verl's defaults)
VF_CLIP = 0.5           # the value loss's clip around the old values (verl's cliprange_value)
MIN_EXPLAINED_VAR = 0.3  # what the critic must explain of the returns' variance after
                         # --critic_warmup for the policy to start

def load(model, lr, device, world, lora, bf16, checkpointing=False, offload=False):
    """The critic from the policy's starting folder `model` (a resume loads its trained state
    afterwards) and its AdamW at `lr`, verl's critic optimizer: betas (0.9, 0.999), weight decay
    0.01, the gradient norm clipped at 1 (update). The rest as trainutil.load_sharded's."""
    critic = trainutil.load_sharded(model, device, world, checkpointing, bf16=bf16, lora=lora,
                                    value_head=True, offload=offload)
    params = [p for p in critic.parameters() if p.requires_grad]
    return critic, torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), weight_decay=0.01)

def values(critic, m):
    """V [N]: the critic's value of the state before each policy token of micro-batch m
    (the positions sel marks)."""
    return trainutil.selected_logits(critic, m.ids, m.sel, m.attn, m.pos, m.pix)[:, 0].float()

def advantages(critic, micro, olds, refs, kl_in_reward=0.0):
    """Each micro-batch's GAE advantages (whitened over the global batch's policy tokens) and
    returns, from its token rewards, the values the critic gives now (m.values) and, with
    kl_in_reward beta, the penalty -beta (logp_old - logp_ref) on every policy token (verl's
    use_kl_in_reward, its "kl" estimator), logp_old the trainer's own recomputed logprobs
    (olds: learner.score_old's), as verl's old_log_prob, not the sampler's."""
    # count, sum, sum of squares of A
    stats = torch.zeros(3, dtype=torch.float64, device=micro[0].ids.device)
    with torch.no_grad():
        for m, old, ref in zip(micro, olds, refs):
            m.values = values(critic, m)  # [N]
            r = m.reward - kl_in_reward * (old - ref) if kl_in_reward else m.reward
            R, V = (torch.zeros(m.sel.shape, device=r.device),
                    torch.zeros(m.sel.shape, device=r.device))  # [B, T-1]
            R[m.sel], V[m.sel] = r, m.values
            adv, ret = gae(R, V, m.sel, GAMMA, LAM)
            m.adv, m.returns = adv[m.sel], ret[m.sel]  # [N] each
            if m.weight:
                stats += torch.stack([torch.tensor(float(len(m.adv)), device=stats.device),
                                      m.adv.double().sum(), (m.adv.double() ** 2).sum()])
    dist.all_reduce(stats)
    for m in micro:
        m.adv = whiten(m.adv, *stats.tolist()).float()

def update(critic, opt, micro, denom):
    """One pass of the clipped value loss over the micro-batches (token mean over the global batch,
    FSDP averaging the gradients over ranks), one AdamW step. Returns this rank's sums (policy
    tokens, value_loss, vf_clipped, and the explained variance's: sum and sum of squares of R and
    of R - V) and the global grad norm."""
    world = dist.get_world_size()
    sums = torch.zeros(7, dtype=torch.float64, device=micro[0].ids.device)
    for m in micro:
        v = values(critic, m)
        loss, clipped = value_loss(v, m.values, m.returns, VF_CLIP, denom / world)
        trainutil.accumulate(critic, last=m is micro[-1])
        (loss * m.weight).backward()
        err = (m.returns - v).detach().double()
        R = m.returns.double()
        sums += m.weight * torch.stack([R.new_tensor(float(len(R))), loss.detach().double() / world,
                                        clipped.sum().double(), R.sum(), (R ** 2).sum(), err.sum(),
                                        (err ** 2).sum()])
    grad_norm = trainutil.clip_grad_norm(critic, 1.0)
    if math.isfinite(grad_norm):  # else skipped, as the policy's (learner.update)
        opt.step()
    opt.zero_grad(set_to_none=True)
    return sums, grad_norm

def combine(parts):
    """update's sums over a rollout's minibatches: their totals, the value loss (each pass's token
    mean) their mean."""
    total = sum(parts)
    total[1] /= len(parts)
    return total

def record(sums):
    """The log's critic numbers from update's sums over all ranks: value_loss, vf_clipfrac and the
    explained variance 1 - Var(R - V) / Var(R) over the batch's policy tokens (> 0: the values
    explain some of the returns; None: the returns are constant)."""
    sums = sums.clone()
    dist.all_reduce(sums)
    n_tok, loss, clipped, r, r2, e, e2 = sums.tolist()
    n_tok = max(n_tok, 1.0)
    var = lambda s, s2: s2 / n_tok - (s / n_tok) ** 2  # noqa: E731
    flat = var(r, r2) <= 1e-9 * max(1.0, r2 / n_tok)  # constant returns, up to the sums' rounding:
                                                      # nothing to explain
    return dict(value_loss=loss, vf_clipfrac=clipped / n_tok,
                explained_var=None if flat else 1 - var(e, e2) / var(r, r2))

def check_resumed(out, step, warmup):
    """A run resumed at `step`, past its warm-up of `warmup` steps: the gate's verdict again, from
    the warm-up's last record in out/log.jsonl (the checkpoint the gate stopped at holds the
    warmed-up critic, and a resume must not pass it)."""
    if not 0 < warmup <= step:
        return
    log = Path(out) / "log.jsonl"
    recs = [json.loads(line) for line in open(log)] if log.is_file() else []
    check_warmup(next((r for r in recs if r["step"] == warmup), {}), warmup, warmup)

def check_warmup(rec, step, warmup):
    """After the last of `warmup` steps (--critic_warmup; rec: its log record, the same on every
    rank): the policy starts only if the critic explains more than MIN_EXPLAINED_VAR of the returns'
    variance, else every rank exits with one line (GAE's advantages from a critic that explains
    nothing are whitened returns: REINFORCE, not PPO)."""
    if step != warmup or not warmup:
        return
    ev = rec.get("explained_var")
    if ev is None or not ev > MIN_EXPLAINED_VAR:
        sys.exit(f"error: after --critic_warmup {warmup} steps the critic explains "
                 f"{'nothing' if ev is None else f'{ev:.2f}'} of the returns' variance "
                 f"(the policy starts above {MIN_EXPLAINED_VAR}): raise --critic_warmup, "
                 "--critic_lr or --minibatches, or --critic_warmup 0 to train the policy at once")

def check_flags(rollout, structure, actions, dynamic_sampling, warmup, kl_in_reward, model):
    """PPO's flags (stepgrpo.py --adv_estimator gae), one line for those that cannot work. A
    --structure released trajectory is several single-turn chats, each valued by the critic
    without the chats before it: PPO refuses it rather than run GAE across states it cannot see."""
    if rollout != "onpolicy":
        sys.exit("error: --adv_estimator gae needs --rollout onpolicy: PPO's returns run over "
                 "whole trajectories")
    if structure != "transcript":
        sys.exit(f"error: --adv_estimator gae needs a --structure transcript policy "
                 f"({model}'s is released): a released trajectory's chats are valued apart, "
                 "so GAE cannot run across them")
    if actions:
        sys.exit(f"error: --adv_estimator gae needs one chat a trajectory ({model} was "
                 "trained with actions, which restart the chat): GAE cannot run across chats "
                 "valued apart")
    if dynamic_sampling:
        sys.exit("error: --dynamic_sampling drops groups whose advantages are all 0: PPO "
                 "(--adv_estimator gae) has no groups")
    if warmup < 0 or kl_in_reward < 0:
        sys.exit(f"error: --critic_warmup {warmup} --kl_in_reward {kl_in_reward}: "
                 "a warm-up >= 0, a penalty >= 0")
