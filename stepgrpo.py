"""
stepgrpo.py: Step-GRPO. GRPO whose rewards are given per step (routing, sub-question, intermediate answer, format)
and not only for the outcome; FSDP2 policy, frozen reference, a vLLM engine on every rank synced after each update.

    python stepgrpo.py --model out/sft/final --data data/mini --out out/stepgrpo
    torchrun --standalone --nproc_per_node 2 stepgrpo.py --model out/sft/final --data data/mini --out out/stepgrpo
    python stepgrpo.py ... --resume                           # continue from <out>/latest exactly
    python stepgrpo.py ... --rollout teacher_prefix           # the paper's released scheme
    python stepgrpo.py ... --reward outcome                   # plain GRPO (outcome reward only), the ablation
    python stepgrpo.py ... --eval_questions 100               # dev score at every checkpoint; <out>/best the top one

One step: every rank rolls out its share of the questions on its own engine (rollout.py: route -> retrieve ->
answer, batched), scores every step span (reward.py), computes group-relative advantages, gets the reference's
logprobs, takes --ppo_epochs passes of PPO-clipped updates, then gathers the full weights and syncs them into its
engine (rollout.VLLMEngine.sync_weights), so every rollout is on-policy.

Rollouts (--rollout):
  onpolicy        n full multi-step trajectories per question form a group. Span j of sample i (route step t,
                  answer step t, final answer) gets reward r_ij (below) and the trajectory an outcome R_i. Token
                  advantage of span j:  A_ij = norm_t(r_ij) + norm(R_i)  with norm(x) = (x - mean) / (std + 1e-4)
                  over the group (unbiased std, as GRPO implementations), norm_t over the samples of the group
                  that have a span of the same (kind, step) (0 if only one has it); credited to that span's tokens.
  teacher_prefix  R1-Router's released code: the golden trajectory (rollout.GoldPolicy, real retrieval) up to
                  each step is a prompt; n completions of that one step form a group; A = norm(r) within it.
                  --teacher_spans route (extension) keeps the routing steps' prompts only.
                  --prefixes policy (extension, DAgger-style; with --teacher_spans route): the prompts are the route
                  points of the current policy's own greedy trajectory instead (the states evaluation reaches), and
                  the target there is the first gold step whose document no earlier step retrieved, or stop once
                  every gold document is in the context (next_gold_step): re-asking an answered sub-question and
                  not stopping score as wrong routes, and a missed step is asked again.
--reward outcome: A_ij = norm(R_i) for every span (plain GRPO); onpolicy only.
--credit split (extension, onpolicy): each route span is cut into two parts normalised on their own: the
                <sub-question> (0.5 w_route cos + hit) and the rest, i.e. the <think> that argues for a KB and the <ret>
                that names it (format + 0.5 w_route [KB = gold KB]), so the sub-question's score does not move the KB
                choice and vice versa.
--balance_kb [P] (extension): the per-step part of a route span's advantage is multiplied by (N / (C n_c))^P, c its
                gold route (text, table, image, stop), n_c that class's share of the N gold route steps of the training
                questions (kb_balance), so that the majority KB does not dominate the routing gradient (P = 1 bare).
--share_prefix (default; teacher_prefix): a group's completions are packed behind one copy of their prompt with a
                tree attention mask (pack_group, collate): the same update, ~3x less compute on CPU.

Step rewards (weights are flags; route_reward and answer_reward are reward.py's, i.e. R1-Router's):
  route step t   w_format [parses] + w_route (0.5 cos(sub-question, gold's) + 0.5 [KB = gold KB]) + w_hit [gold doc
                 retrieved]; past the gold steps the gold is "stop" (sub-question None, no KB)
                 - w_repeat [its sub-question was asked at an earlier step] (extension, default 0)
  answer step t  w_format [parses] + w_answer answer_reward(answer, [gold intermediate answer])
  final answer   w_format [parses]  (+ w_outcome answer_reward(final, golds) in teacher_prefix mode)
  outcome R      f1_recall(final, golds) (or EM, --outcome em); 0 if any step failed to parse
A span that fails to parse ends its trajectory and gets reward 0.

Loss over policy tokens only (prompt, retrieved evidence and template tokens are masked out):
  ratio = exp(logp - logp_old)  (logp_old: the sampling engine's own logprobs)
  l_t = -min(ratio A, clip(ratio, 1 - eps, 1 + eps) A) + kl_coef (exp(ref - logp) - (ref - logp) - 1)   (k3 KL)
  token normalisation: sum of l_t over the global batch / its number of policy tokens; sequence: the mean over
  sequences of each sequence's token mean. --kl_coef 0 (the default) is what the released R1-Router code does:
  it logs the KL term but leaves it out of the loss. The frozen reference is loaded and run only when --kl_coef > 0
  or --log_kl (it costs ~20% of a step on CPU). With --kl_coef 0 a row whose advantages are all 0 (a group whose
  samples all scored the same) has no gradient and is not run at all; the denominators still count it, so the
  update is unchanged (log: "skipped", the fraction of rows).
  --sft_coef c (extension, InstructGPT's "ptx" term): + c x the mean NLL of the policy tokens of this step's questions'
  gold trajectories (rollout.GoldPolicy with real retrieval, as SFT trains on), an anchor that holds the SFT
  behaviour where the groups agree and give no gradient (log: sft_nll, its mean over the --ppo_epochs passes).
"""
import argparse
import math
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

import corpus
import reward
import rollout
import trainutil

#### arguments

def get_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="out/sft/final", help="policy to start from (an HF folder, e.g. the SFT checkpoint)")
    ap.add_argument("--ref_model", default=None, help="frozen reference for the KL term (default: --model)")
    ap.add_argument("--data", default="data/mini", help="corpus.py folder: questions, KBs and indexes")
    ap.add_argument("--split", nargs="+", default=["train"], help="question splits trained on, mixed")
    ap.add_argument("--out", default="out/stepgrpo")
    ap.add_argument("--resume", action="store_true", help="continue from <out>/latest")
    # rollout
    ap.add_argument("--rollout", default="onpolicy", choices=["onpolicy", "teacher_prefix"])
    ap.add_argument("--reward", default="step", choices=["step", "outcome"], help="outcome = plain GRPO (onpolicy only)")
    ap.add_argument("--teacher_spans", default="all", choices=["all", "route"],
                    help="teacher_prefix: route = train the routing steps only (extension; all = the paper's)")
    ap.add_argument("--prefixes", default="gold", choices=["gold", "policy"],
                    help="teacher_prefix: policy (extension) = route points of the policy's own greedy trajectory")
    ap.add_argument("--batch_questions", type=int, default=8, help="questions per step, over all ranks")
    ap.add_argument("-n", "--group_size", type=int, default=4, help="samples per question (onpolicy) or per step prompt")
    ap.add_argument("--max_steps", type=int, default=3, help="sub-questions per trajectory (paper: 3)")
    ap.add_argument("--topk", type=int, default=3, help="evidence documents per sub-question")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--route_tokens", type=int, default=64)
    ap.add_argument("--answer_tokens", type=int, default=48)
    ap.add_argument("--retriever", default="dense", help="dense | bm25 | hybrid | http://host:port of retrievers.py serve")
    ap.add_argument("--backend", default="vllm", choices=["vllm", "hf"], help="rollout engine")
    # reward weights
    ap.add_argument("--w_format", type=float, default=0.2)
    ap.add_argument("--w_route", type=float, default=1.0)
    ap.add_argument("--w_hit", type=float, default=0.0, help="bonus when the gold document is retrieved (extension)")
    ap.add_argument("--w_answer", type=float, default=1.0)
    ap.add_argument("--w_repeat", type=float, default=0.0,
                    help="penalty on a route step that re-asks an earlier step's sub-question (extension)")
    ap.add_argument("--w_outcome", type=float, default=1.0, help="teacher_prefix: weight of the final answer's reward")
    ap.add_argument("--outcome", default="f1_recall", choices=["f1_recall", "em"])
    ap.add_argument("--balance_kb", type=float, nargs="?", const=1.0, default=0.0, metavar="POWER",
                    help="extension: scale route advantages by (1 / frequency of the gold route)^POWER (text, table, "
                         "image, stop); bare --balance_kb is POWER 1, 0 is off, 0.5 the square root")
    ap.add_argument("--credit", default="span", choices=["span", "split"],
                    help="split (extension, onpolicy): the KB-match half of the route reward is credited to the <ret> tokens alone")
    # optimisation
    ap.add_argument("--lr", type=float, default=2e-6)
    ap.add_argument("--clip_eps", type=float, default=0.2)
    ap.add_argument("--kl_coef", type=float, default=0.0)
    ap.add_argument("--sft_coef", type=float, default=0.0, help="extension: weight of the gold trajectories' NLL in the loss")
    ap.add_argument("--log_kl", action="store_true", help="run the reference to log the KL even when --kl_coef is 0")
    ap.add_argument("--loss_norm", default="token", choices=["token", "sequence"])
    ap.add_argument("--ppo_epochs", type=int, default=1, help="update passes over each batch of rollouts")
    ap.add_argument("--micro_batch", type=int, default=4, help="sequences (packed rows) per forward/backward")
    ap.add_argument("--share_prefix", action=argparse.BooleanOptionalAction, default=True,
                    help="teacher_prefix: a group's n completions share one copy of their prompt in the update (tree mask)")
    ap.add_argument("--grad_clip", type=float, default=1.0)
    ap.add_argument("--weight_decay", type=float, default=0.0)
    ap.add_argument("--train_steps", type=int, default=20)
    ap.add_argument("--save_every", type=int, default=10)
    ap.add_argument("--keep", type=int, default=2, help="newest checkpoints kept (and <out>/best's)")
    ap.add_argument("--eval_questions", type=int, default=0,
                    help="score the first N --eval_split questions (greedy, routed) at the start and at every checkpoint; "
                         "<out>/best links the trained checkpoint with the highest --select (0: off)")
    ap.add_argument("--eval_split", default="dev")
    ap.add_argument("--select", default="f1_routing", choices=["f1_routing", "f1_recall", "routing_acc"],
                    help="dev score that picks best: the mean of F1-Recall and routing accuracy, or one of them")
    ap.add_argument("--activation_checkpointing", action="store_true")
    ap.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"],
                    help="compute dtype (FSDP2 mixed precision; master weights, grads and optimizer stay fp32); "
                         "auto: bf16 on CUDA and AVX512-BF16 CPUs, else fp32")
    ap.add_argument("--check_sync", action="store_true", help="after each sync, log the max |engine - trainer| logprob")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--wandb_project", default="r1router-nano")
    ap.add_argument("--wandb_mode", default=os.environ.get("WANDB_MODE", "offline"), choices=["online", "offline", "disabled"])
    return ap.parse_args(argv)

#### rewards and advantages

@dataclass
class Weights:
    format: float = 0.2
    route: float = 1.0
    hit: float = 0.0
    answer: float = 1.0
    outcome_metric: str = "f1_recall"
    route_scale: dict | None = None  # --balance_kb: gold route -> factor on route advantages (kb_balance)
    repeat: float = 0.0  # --w_repeat

def gold_route(gold_steps, t):
    return gold_steps[t]["kb"] if t < len(gold_steps) else "stop"

def next_gold_step(gold_steps, steps):
    """--prefixes policy: the target at a route point whose earlier steps are `steps` (dicts with "retrieved" ids):
    the index of the first gold step whose document none of them retrieved, or None (stop) once all were."""
    seen = {d for s in steps for d in s["retrieved"]}
    return next((j for j, g in enumerate(gold_steps) if g["doc_id"] not in seen), None)

def rollout_settings(args, temperature):
    return rollout.Settings(max_steps=args.max_steps, topk=args.topk, route_tokens=args.route_tokens,
                            answer_tokens=args.answer_tokens, temperature=temperature)

def policy_prefixes(engine, retriever, qs, args):
    """--prefixes policy: each question's greedy trajectory under the current policy and its route points, as
    golden_prefixes gives them: [(trajectory, span, prompt ids up to that span)]."""
    trajs = rollout.rollout(engine, retriever, qs, n=1, s=rollout_settings(args, temperature=0.0))
    return trajs, [(x, sp, x["ids"][:sp["start"]]) for x in trajs for sp in x["spans"] if sp["kind"] == "route"]

def kb_balance(questions, max_steps, power=1.0):
    """--balance_kb: factor (N / (C n_c))^power for each gold route c over the N route steps of the training questions
    (C classes, n_c steps of class c). Power 1 makes text, table, image and stop steps weigh the same in total (a
    class-balanced loss); power 0.5 goes halfway in log space. A question with k gold steps has route steps
    0..min(k, max_steps - 1), stop at k."""
    from collections import Counter
    n = Counter(gold_route(q["steps"], t) for q in questions for t in range(min(len(q["steps"]) + 1, max_steps)))
    return {c: (sum(n.values()) / (len(n) * k)) ** power for c, k in n.items()}

def span_rewards(x, encode, w):
    """Reward of every policy span of trajectory x (in x["spans"] order) and its outcome reward."""
    gold, out = x["gold_steps"], []
    for j, sp in enumerate(x["spans"]):
        if not x["format_ok"] and j == len(x["spans"]) - 1:  # the span that failed to parse
            out.append(0.0)
            continue
        t, r = sp["step"], w.format
        if sp["kind"] == "route":
            g = gold[t] if t < len(gold) else None
            took = t < len(x["steps"])  # else this route was the stop
            pred = reward.Route(ok=True, sub_question=x["steps"][t]["sub_question"] if took else "None",
                                kb=x["steps"][t]["kb"] if took else None, stop=not took)
            r += w.route * reward.route_reward(pred, g and g["sub_question"], g and g["kb"], encode)
            if g and took:
                r += w.hit * reward.retrieval_hit_reward(x["steps"][t]["retrieved"], g["doc_id"])
            if took and w.repeat:
                r -= w.repeat * reward.re_asks(x["steps"][t]["sub_question"], x["steps"][:t])
        elif sp["kind"] == "answer" and t < len(gold):
            r += w.answer * reward.answer_reward(x["steps"][t]["answer"] or "", [gold[t]["answer"]])
        out.append(r)
    metric = reward.exact_match if w.outcome_metric == "em" else reward.f1_recall
    return out, (metric(x["final_answer"] or "", x["answers"]) if x["format_ok"] else 0.0)

def kbs_at(x, t):
    """(KB the trajectory chose at route step t, the gold KB there); None stands for "stop"."""
    return (x["steps"][t]["kb"] if t < len(x["steps"]) else None,
            x["gold_steps"][t]["kb"] if t < len(x["gold_steps"]) else None)

def split_route_spans(x, rewards, w, tok):
    """--credit split: cut every parsed route span into ("route_q": the <sub-question>..</sub-question> tokens, rewarded
    with 0.5 w_route cos + w_hit) and ("route_kb": the <think> before it and the <ret> after it, rewarded with format +
    0.5 w_route [KB = gold KB]). The think argues for a KB before <ret> names it, so it is credited with the KB choice.
    route_kb covers two token ranges: [start, end) and its "also" range."""
    spans, out = [], []
    for j, (sp, r) in enumerate(zip(x["spans"], rewards)):
        ids = x["ids"][sp["start"]:sp["end"]]
        text = tok.decode(ids)
        a, b = text.find("<sub-question>"), text.find("</sub-question>")
        if sp["kind"] != "route" or a < 0 or b < 0 or (not x["format_ok"] and j == len(x["spans"]) - 1):
            spans.append(sp)
            out.append(r)
            continue
        cut = lambda pos: max(k for k in range(len(ids) + 1) if len(tok.decode(ids[:k])) <= pos)  # token holding char pos
        lo, hi = sp["start"] + cut(a), sp["start"] + cut(b + len("</sub-question>"))
        pred, gold = kbs_at(x, sp["step"])
        r_kb = w.format + w.route * 0.5 * float(pred == gold)
        spans += [dict(sp, kind="route_q", start=lo, end=hi), dict(sp, kind="route_kb", end=lo, also=(hi, sp["end"]))]
        out += [r - r_kb, r_kb]
    return spans, out

def norm(v, eps=1e-4):
    v = np.asarray(v, dtype=np.float64)
    if len(v) < 2 or v.min() == v.max():  # exactly 0, not v - mean's rounding error / eps (~1e-13)
        return np.zeros_like(v)
    return (v - v.mean()) / (v.std(ddof=1) + eps)

def group_advantages(spans, rewards, outcomes, mode="step", scale=None):
    """One group (the n samples of a question). spans[i]: span dicts of sample i, rewards[i]: their rewards,
    outcomes[i]: R_i. Returns advantages[i][j] = c_(kind, step) norm_(kind, step)(r_ij) + norm(R_i) (mode "outcome":
    norm(R_i)), where c = scale.get((kind, step), 1) (--balance_kb)."""
    R = norm(outcomes)
    adv = [[float(R[i])] * len(s) for i, s in enumerate(spans)]
    if mode == "outcome":
        return adv
    by_key = {}
    for i, s in enumerate(spans):
        for j, sp in enumerate(s):
            by_key.setdefault((sp["kind"], sp["step"]), []).append((i, j))
    for key, members in by_key.items():
        c = (scale or {}).get(key, 1.0)
        for (i, j), a in zip(members, norm([rewards[i][j] for i, j in members])):
            adv[i][j] += c * float(a)
    return adv

def token_advantages(n_tokens, spans, adv):
    """[n_tokens]: span j's advantage adv[j] on its token range (and its "also" range), 0 on every other token."""
    out = [0.0] * n_tokens
    for sp, a in zip(spans, adv):
        for lo, hi in ((sp["start"], sp["end"]), sp.get("also", (0, 0))):
            out[lo:hi] = [a] * (hi - lo)
    return out

#### loss

def token_logprobs(model, ids, attn, sel, pos=None):
    """Logprob of each selected next token and the entropy of its prediction, both [N], where sel [B, T-1] marks the
    positions (t predicts token t + 1) that are policy tokens: lm_head and softmax run on those alone.
    attn: [B, T] padding mask, or [B, 1, T, T] tree mask with position ids pos [B, T] for packed groups."""
    logp = trainutil.selected_logits(model, ids, sel, attn, pos).float().log_softmax(-1)  # [N, V]
    with torch.no_grad():
        entropy = -(logp.exp() * logp).sum(-1)  # [N]
    return logp.gather(-1, ids[:, 1:][sel].unsqueeze(-1)).squeeze(-1), entropy

def grpo_loss(logp, old, ref, adv, seq, clip_eps, kl_coef, norm_mode, denom, n_seq):
    """logp, old, ref, adv: [N] over the policy tokens of a micro-batch; seq [N]: each token's sequence (0..n_seq-1).
    Returns the loss to backprop, already divided by the global `denom` (policy tokens for token normalisation,
    sequences for sequence normalisation), and the per-token kl and clipped indicators."""
    ratio = torch.exp(logp - old)
    pg = -torch.minimum(ratio * adv, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv)
    kl = torch.exp(ref - logp) - (ref - logp) - 1  # k3 estimator of KL(policy || ref)
    per_tok = pg + kl_coef * kl
    if norm_mode == "token":
        loss = per_tok.sum() / denom
    else:  # each sequence's token mean, summed
        count = torch.zeros(n_seq, dtype=per_tok.dtype).index_add_(0, seq, torch.ones_like(per_tok))
        loss = (per_tok / count[seq]).sum() / denom
    clipped = ((ratio - 1).abs() > clip_eps).float()
    return loss, kl.detach(), clipped

#### rollouts -> training sequences

def onpolicy_batch(engine, retriever, qs, args, encode, w, seed):
    trajs = rollout.rollout(engine, retriever, qs, n=args.group_size, s=rollout_settings(args, args.temperature), seed=seed)
    seqs, stats = [], dict(route_r=[], kb_acc=[], answer_r=[], outcome=[], format_ok=[], retrievals=[], tokens=[],
                           reask=[], retrieve_s=sum(x["timings"]["retrieve"] for x in trajs))
    for g in range(len(qs)):
        group = trajs[g * args.group_size:(g + 1) * args.group_size]
        scored = [span_rewards(x, encode, w) for x in group]
        spans, rs = [x["spans"] for x in group], [r for r, _ in scored]
        if args.credit == "split":
            spans, rs = zip(*[split_route_spans(x, r, w, engine.tok) for x, r in zip(group, rs)])
        scale = w.route_scale and {(k, t): w.route_scale[gold_route(group[0]["gold_steps"], t)]
                                   for k in ("route", "route_q", "route_kb") for t in range(args.max_steps)}
        adv = group_advantages(spans, rs, [o for _, o in scored], args.reward, scale)
        for x, sps, (r, o), a in zip(group, spans, scored, adv):
            seqs.append(dict(ids=x["ids"], mask=x["mask"], old=x["logprobs"], adv=token_advantages(len(x["ids"]), sps, a)))
            stats["route_r"] += [v for sp, v in zip(x["spans"], r) if sp["kind"] == "route"]
            stats["answer_r"] += [v for sp, v in zip(x["spans"], r) if sp["kind"] == "answer"]
            stats["outcome"].append(o)
            n_routes = sum(sp["kind"] == "route" for sp in x["spans"]) - (not x["format_ok"] and x["spans"][-1]["kind"] == "route")
            stats["kb_acc"] += [float(pred == gold) for pred, gold in (kbs_at(x, t) for t in range(n_routes))]
            stats["format_ok"].append(float(x["format_ok"]))
            stats["retrievals"].append(len(x["steps"]))
            stats["reask"] += [float(reward.re_asks(st["sub_question"], x["steps"][:t])) for t, st in enumerate(x["steps"])]
            stats["tokens"].append(x["n_policy_tokens"])
    return seqs, stats

def teacher_prefix_batch(engine, retriever, qs, args, encode, w, seed):
    t = time.perf_counter()
    if args.prefixes == "policy":
        golds, prompts = policy_prefixes(engine, retriever, qs, args)
        retrieve_s = sum(x["timings"]["retrieve"] for x in golds)
    else:  # the gold policy writes its steps at no cost: this is retrieval time
        golds, prompts = rollout.golden_prefixes(engine.tok, retriever, qs, rollout.Settings(max_steps=args.max_steps, topk=args.topk))
        retrieve_s = time.perf_counter() - t
    stats = dict(route_r=[], kb_acc=[], answer_r=[], outcome=[], format_ok=[], retrievals=[], tokens=[], reask=[],
                 retrieve_s=retrieve_s)
    seqs = []  # each prefix is its own group
    kinds = (("route", "</ret>", args.route_tokens), ("answer", "</answer>", args.answer_tokens))
    for kind, stop, max_tok in kinds[:1] if args.teacher_spans == "route" else kinds:
        todo = [(x, sp, prefix) for x, sp, prefix in prompts if (sp["kind"] == "route") == (kind == "route")]
        outs = engine.generate([prefix for _, _, prefix in todo for _ in range(args.group_size)],
                               max_tok, args.temperature, 1.0, [stop], seed)
        for k, (x, sp, prefix) in enumerate(todo):
            group = outs[k * args.group_size:(k + 1) * args.group_size]
            t_, gold = sp["step"], x["gold_steps"]
            j = next_gold_step(gold, x["steps"][:t_]) if args.prefixes == "policy" else t_  # the target gold step
            g = gold[j] if j is not None and j < len(gold) else None  # None: stop
            rs = []
            for ids, _ in group:
                text = engine.tok.decode(ids, skip_special_tokens=True)
                if kind == "route":
                    p = reward.parse_route(text)
                    r = w.format * p.ok + w.route * reward.route_reward(p, g and g["sub_question"], g and g["kb"], encode)
                    if p.ok and not p.stop:  # the prefix's earlier steps (the gold ones, or the policy's own)
                        again = reward.re_asks(p.sub_question, x["steps"][:t_])
                        r -= w.repeat * again
                        stats["reask"].append(float(again))
                    stats["route_r"].append(r)
                    if p.ok:
                        stats["kb_acc"].append(float(p.kb == (g and g["kb"])))
                else:
                    p = reward.parse_answer(text)
                    golds_ = [gold[t_]["answer"]] if sp["kind"] == "answer" else x["answers"]
                    wt = w.answer if sp["kind"] == "answer" else args.w_outcome
                    r = w.format * p.ok + (wt * reward.answer_reward(p.answer, golds_) if p.ok else 0.0)
                    (stats["answer_r"] if sp["kind"] == "answer" else stats["outcome"]).append(r)
                stats["format_ok"].append(float(p.ok))
                stats["tokens"].append(len(ids))
                rs.append(r)
            adv = norm(rs) * (w.route_scale[g["kb"] if g else "stop"] if w.route_scale and kind == "route" else 1.0)
            if args.share_prefix:
                seqs.append(pack_group(prefix, group, adv))
                continue
            for (ids, lps), a in zip(group, adv):
                seqs.append(dict(ids=prefix + ids, mask=[0] * len(prefix) + [1] * len(ids),
                                 old=[0.0] * len(prefix) + list(lps), adv=[float(a)] * (len(prefix) + len(ids))))
    stats["retrievals"] = [len(x["steps"]) for x in golds]
    return seqs, stats

def pack_group(prefix, group, adv):
    """--share_prefix: the n completions of one prompt as one row, the prompt (but its last token) once and then, per
    completion, that last token and the completion: a branch. seg gives each token's branch (-1: the shared prompt),
    pos its position id (a branch continues the prompt). collate's tree mask lets a branch see the prompt and itself
    only, so the repeated last token makes each policy token's left neighbour its true predecessor, and the row
    scores every completion exactly as n separate rows."""
    L = len(prefix) - 1
    row = dict(ids=list(prefix[:-1]), mask=[0] * L, old=[0.0] * L, adv=[0.0] * L, seg=[-1] * L, pos=list(range(L)),
               n_seq=len(group))
    for i, ((ids, lps), a) in enumerate(zip(group, adv)):
        for key, vals in (("ids", [prefix[-1], *ids]), ("mask", [0] + [1] * len(ids)), ("old", [0.0, *lps]),
                          ("adv", [float(a)] * (1 + len(ids))), ("seg", [i] * (1 + len(ids))),
                          ("pos", list(range(L, L + 1 + len(ids))))):
            row[key] += vals
    return row

def collate(seqs, pad_id, device):
    """Right-pad to ids [B, T]; sel [B, T-1] marks positions whose next token is a policy token; old logprobs,
    advantages and sequence index of those tokens, flattened to [N] in sel's (row-major) order. attn: the padding
    mask [B, T] and pos None, or, if a row is packed (pack_group), a tree mask [B, 1, T, T] and position ids [B, T]."""
    T = max(len(s["ids"]) for s in seqs)
    ids = torch.tensor([s["ids"] + [pad_id] * (T - len(s["ids"])) for s in seqs], device=device)
    attn = torch.tensor([[1] * len(s["ids"]) + [0] * (T - len(s["ids"])) for s in seqs], device=device)
    sel = torch.tensor([s["mask"][1:] + [0] * (T - len(s["ids"])) for s in seqs], device=device).bool()
    pick = lambda key: torch.tensor([v for s in seqs for v, m in zip(s[key][1:], s["mask"][1:]) if m], device=device).float()
    first = np.cumsum([0] + [s.get("n_seq", 1) for s in seqs])  # index of each row's first sequence
    seq = torch.tensor([first[b] + max(g, 0) for b, s in enumerate(seqs)
                        for g, m in zip(s.get("seg", [-1] * len(s["ids"]))[1:], s["mask"][1:]) if m], device=device)
    pos = None
    if any("seg" in s for s in seqs):
        seg = torch.tensor([s.get("seg", [-1] * len(s["ids"])) + [1 << 30] * (T - len(s["ids"])) for s in seqs], device=device)
        shared = seg == -1  # [B, T]
        causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
        attn = (causal & (shared[:, None, :] | (seg[:, :, None] == seg[:, None, :])))[:, None]  # [B, 1, T, T]
        pos = torch.tensor([s.get("pos", list(range(len(s["ids"])))) + [0] * (T - len(s["ids"])) for s in seqs], device=device)
    return ids, attn, pos, sel, pick("old"), pick("adv"), seq

#### dev evaluation (checkpoint choice)

def dev_eval(engine, retriever, qs, args, rank, world):
    """Greedy routed trajectories of qs (each rank its share, on its own engine), scored by evaluate.py's score(): the
    numbers `evaluate.py --methods routed --split dev --n_questions N` gives for the checkpoint saved at this step.
    Training's RNG state is put back afterwards, so a run trains the same with or without it."""
    import evaluate
    rng = torch.get_rng_state(), random.getstate()
    mine = rollout.rollout(engine, retriever, qs[rank::world], 1, rollout.Settings(max_steps=args.max_steps, topk=args.topk,
                                                                                     temperature=0.0), seed=0)
    torch.set_rng_state(rng[0])
    random.setstate(rng[1])
    parts = [None] * world
    dist.all_gather_object(parts, [{k: v for k, v in x.items() if k not in ("ids", "mask", "logprobs")} for x in mine])
    s = evaluate.score([x for p in parts for x in p])
    dev = {"dev_f1_recall": s["f1_recall"], "dev_routing_acc": s["routing_acc"], "dev_routing_macro": s["routing_macro"]}
    dev["dev_score"] = (dev["dev_f1_recall"] + dev["dev_routing_acc"]) / 2 if args.select == "f1_routing" else dev[f"dev_{args.select}"]
    return dev

#### main

def main(argv=None):
    args = get_args(argv)
    rank, world, device, print0 = trainutil.env_rank()
    args.dtype = trainutil.resolve_dtype(args.dtype, device)  # the resolved choice is what trainer_state.pt records
    if args.rollout == "teacher_prefix" and (args.reward == "outcome" or args.credit == "split"):
        sys.exit("error: --reward outcome and --credit split need --rollout onpolicy (teacher_prefix groups hold one step each)")
    if args.rollout == "onpolicy" and (args.teacher_spans != "all" or args.prefixes != "gold"):
        sys.exit("error: --teacher_spans and --prefixes need --rollout teacher_prefix")
    if args.prefixes == "policy" and args.teacher_spans != "route":
        sys.exit("error: --prefixes policy needs --teacher_spans route (an answer's target on the policy's own steps is not defined)")
    if args.balance_kb < 0:
        sys.exit(f"error: --balance_kb POWER must be >= 0 (got {args.balance_kb}; 0 is off, 1 the full class balance)")
    if args.batch_questions % world:
        sys.exit(f"error: --batch_questions {args.batch_questions} must be divisible by the world size {world}")
    out = Path(args.out)
    start = trainutil.resolve_start(args.model, out, args.resume)
    import retrievers
    try:
        questions = [q for sp in args.split for q in corpus.load_questions(args.data, sp)]
        dev_qs = corpus.load_questions(args.data, args.eval_split)[:args.eval_questions] if args.eval_questions else []
        ret = retrievers.RemoteRetriever(args.retriever) if args.retriever.startswith("http") else retrievers.Retriever(args.data, args.retriever)
    except corpus.DataError as e:
        sys.exit(f"error: {e}")
    own_group = trainutil.init_group(world)
    encoder = retrievers.Encoder()  # all-MiniLM-L6-v2, for the sub-question cosine
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(start)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    torch.manual_seed(args.seed)
    random.seed(args.seed)

    tree = args.rollout == "teacher_prefix" and args.share_prefix
    model = trainutil.load_sharded(start, device, world, args.activation_checkpointing, bf16=args.dtype == "bf16", tree_mask=tree)
    use_ref = args.kl_coef > 0 or args.log_kl
    ref = trainutil.load_sharded(args.ref_model or args.model, device, world, train=False, bf16=args.dtype == "bf16",
                                tree_mask=tree) if use_ref else None
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=args.weight_decay)
    step, dev_hist = 0, {}  # dev_hist: step -> dev score (--eval_questions)
    if args.resume:
        state = trainutil.load_trainer_state(model, opt, start, args, print0)
        step, dev_hist = state["step"], state.get("dev", {})
    engine = rollout.make_engine(args.backend, start, seed=args.seed + rank)  # each rank owns one engine
    w = Weights(args.w_format, args.w_route, args.w_hit, args.w_answer, args.outcome,
                kb_balance(questions, args.max_steps, args.balance_kb) if args.balance_kb else None, args.w_repeat)
    if w.route_scale:
        print0("--balance_kb route advantage factors: " + ", ".join(f"{c} {v:.2f}" for c, v in sorted(w.route_scale.items())))
    make_batch = onpolicy_batch if args.rollout == "onpolicy" else teacher_prefix_batch
    per_epoch = len(questions) // args.batch_questions
    log = trainutil.Log(out, rank, step, args.resume, args.wandb_project, args.wandb_mode, vars(args))
    print0(f"Step-GRPO ({args.rollout}, reward {args.reward}): world {world} ({device.type}, {args.dtype}), {len(questions)} questions, "
           f"{args.batch_questions} x {args.group_size} per step, {args.train_steps} steps")
    bar = None
    if rank == 0:
        from tqdm import tqdm
        bar = tqdm(total=args.train_steps, initial=step, desc="step-grpo", dynamic_ncols=True)
    if dev_qs and step == 0:  # the starting policy's dev score: what the trained checkpoints have to beat
        dev = dev_eval(engine, ret, dev_qs, args, rank, world)
        log(dict(step=0, **dev))
        print0(f"dev ({len(dev_qs)} {args.eval_split} questions) at the start: F1-Recall {dev['dev_f1_recall']:.1f}, "
               f"routing acc {dev['dev_routing_acc']:.1f}")

    #### training loop
    while step < args.train_steps:
        epoch, pos = divmod(step, per_epoch)
        perm = torch.randperm(len(questions), generator=torch.Generator().manual_seed(args.seed + epoch)).tolist()
        batch = perm[pos * args.batch_questions:(pos + 1) * args.batch_questions]
        mine = [questions[i] for i in batch[rank::world]]
        timing = {}
        # ---- rollout (generation + retrieval) and rewards
        t = time.perf_counter()
        seqs, st = make_batch(engine, ret, mine, args, encoder.encode, w, seed=args.seed + 7919 * step + 104729 * rank)
        anchor = []  # --sft_coef: micro-batches of the gold trajectories (equally many on every rank: len(mine) is)
        if args.sft_coef:
            golds, _ = rollout.golden_prefixes(tok, ret, mine, rollout.Settings(max_steps=args.max_steps, topk=args.topk))
            golds = [dict(ids=x["ids"], mask=x["mask"], old=[0.0] * len(x["ids"]), adv=[0.0] * len(x["ids"])) for x in golds]
            anchor = [collate(golds[k:k + args.micro_batch], pad_id, device) for k in range(0, len(golds), args.micro_batch)]
            gold_denom = torch.tensor([float(sum(sum(x["mask"][1:]) for x in golds))], dtype=torch.float64, device=device)
            dist.all_reduce(gold_denom)
            gold_denom = gold_denom.clamp(min=1).item() / world
        timing["rollout_s"] = time.perf_counter() - t
        timing["retrieve_s"] = st.pop("retrieve_s")
        engine.sleep()  # GPU: the engine's memory goes to the reference and the update until the sync wakes it
        seqs.sort(key=lambda s: len(s["ids"]))  # micro-batches of similar lengths pad less; the loss is a global sum
        # without a KL term a row whose policy tokens all have advantage 0 (a unanimous group) has zero gradient: skip
        # it. denom below still counts it, so the update is exactly the one over every row
        live = [s for s in seqs if args.kl_coef > 0 or any(a for a, m in zip(s["adv"], s["mask"]) if m)]
        # every rank must run the same number of micro-batches (FSDP all-gathers inside each forward), at least one
        n_micro = torch.tensor([max(1, math.ceil(len(live) / args.micro_batch))], device=device)
        dist.all_reduce(n_micro, op=dist.ReduceOp.MAX)
        micro = [live[k * args.micro_batch:(k + 1) * args.micro_batch] for k in range(int(n_micro))]
        micro = [collate(m or seqs[:1], pad_id, device) + (float(bool(m)),) for m in micro]  # (..., weight)
        timing["skipped"] = 1 - len(live) / max(1, len(seqs))  # rows skipped (logged with the timings, rank mean)
        denom = torch.tensor([sum(sum(s["mask"]) for s in seqs) if args.loss_norm == "token" else sum(s.get("n_seq", 1) for s in seqs)],
                             dtype=torch.float64, device=device)
        dist.all_reduce(denom)
        denom = denom.clamp(min=1).item() / world  # FSDP averages gradients over ranks: / world makes it a global sum
        # ---- reference logprobs
        t = time.perf_counter()
        refs = []
        with torch.no_grad():
            for ids, attn, pos, sel, *_ in micro:
                refs.append(token_logprobs(ref, ids, attn, sel, pos)[0] if use_ref else None)
        timing["reference_s"] = time.perf_counter() - t
        # ---- policy update(s)
        t = time.perf_counter()
        acc = torch.zeros(7, dtype=torch.float64, device=device)  # [loss, kl sum, clipped, entropy sum, tokens, grad norm, sft nll]
        for _ in range(args.ppo_epochs):
            for (ids, attn, pos, sel, old, adv, seq, weight), ref_lp in zip(micro, refs):
                logp, ent = token_logprobs(model, ids, attn, sel, pos)  # [N] each
                ref_lp = logp.detach() if ref_lp is None else ref_lp  # no reference: KL term 0
                loss, kl, clipped = grpo_loss(logp, old, ref_lp, adv, seq, args.clip_eps, args.kl_coef, args.loss_norm,
                                              denom, int(seq.max()) + 1 if len(seq) else 1)
                (loss * weight).backward()
                acc[:5] += weight * torch.stack([loss.detach(), kl.sum(), clipped.sum(), ent.sum(), torch.tensor(float(len(kl)))]).double()
            for ids, attn, pos, sel, *_ in anchor:
                nll = -token_logprobs(model, ids, attn, sel, pos)[0].sum() / gold_denom
                (args.sft_coef * nll).backward()
                acc[6] += nll.detach().double()
            acc[5] += trainutil.clip_grad_norm(model, args.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
        timing["update_s"] = time.perf_counter() - t
        # ---- sync the new weights into this rank's engine
        t = time.perf_counter()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        engine.sync_weights(get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)))  # full on every rank
        timing["sync_s"] = time.perf_counter() - t
        if args.check_sync:  # the engine must now score a rollout exactly as the trainer does
            ids = seqs[0]["ids"]
            with torch.no_grad():
                mine = token_logprobs(model, torch.tensor([ids], device=device), torch.ones(1, len(ids), device=device),
                                      torch.ones(1, len(ids) - 1, dtype=torch.bool, device=device))[0]  # [T-1], every token
            diff = (torch.tensor(engine.prompt_logprobs(ids), device=device) - mine).abs().max().reshape(1)
            dist.all_reduce(diff, op=dist.ReduceOp.MAX)
            timing["sync_max_diff"] = diff.item()  # equal on every rank: the sum over ranks / world below gives it back
        step += 1
        # ---- log (means over all ranks)
        keys = ["route_r", "kb_acc", "answer_r", "outcome", "format_ok", "retrievals", "tokens", "reask"]
        sums = torch.tensor([v for k in keys for v in (sum(st[k]), len(st[k]))] + list(timing.values()), dtype=torch.float64, device=device)
        dist.all_reduce(sums)
        dist.all_reduce(acc)
        rec = dict(step=step, epoch=epoch, **{k: (sums[2 * i] / sums[2 * i + 1]).item() if sums[2 * i + 1] else None for i, k in enumerate(keys)},
                   loss=acc[0].item() / args.ppo_epochs, kl=(acc[1] / acc[4].clamp(min=1)).item() if use_ref else None,
                   clip_frac=(acc[2] / acc[4].clamp(min=1)).item(),
                   entropy=(acc[3] / acc[4].clamp(min=1)).item(), grad_norm=acc[5].item() / world / args.ppo_epochs,
                   sft_nll=acc[6].item() / world / args.ppo_epochs if anchor else None,
                   adv_abs=float(np.mean([abs(a) for s in seqs for a, m in zip(s["adv"], s["mask"]) if m] or [0.0])),
                   **{k: sums[2 * len(keys) + i].item() / world for i, k in enumerate(timing)})
        saving = (args.save_every and step % args.save_every == 0) or step == args.train_steps
        if saving and dev_qs:
            t = time.perf_counter()
            rec.update(dev_eval(engine, ret, dev_qs, args, rank, world), dev_s=time.perf_counter() - t)
            dev_hist[step] = rec["dev_score"]
        log(rec)
        if bar:
            bar.update(1)
            bar.set_postfix(outcome=f"{rec['outcome'] or 0:.3f}", route=f"{rec['route_r'] or 0:.3f}", fmt=f"{rec['format_ok']:.2f}",
                            kl=f"{rec['kl'] or 0:.4f}", sync=f"{rec['sync_s']:.2f}s")
        if saving:
            best = max(dev_hist, key=dev_hist.get) if dev_hist else None  # the earliest of equal scores
            trainutil.save_checkpoint(model, opt, tok, out, step, dict(args=vars(args), dev=dev_hist), rank, args.keep,
                                      protect=f"step_{best}" if best else None)
            if rank == 0 and best:
                trainutil.link_step(out, best, "best")
    if rank == 0:
        trainutil.link_step(out, step, "final")
        bar.close()
        log.close()
        plot_curves(out)
    print0(f"done: {step} steps; final checkpoint {out / 'final'}; learning curves {out / 'curves.png'}")
    if dev_hist:
        b = max(dev_hist, key=dev_hist.get)
        print0(f"best on {args.eval_split} ({args.select}): step {b}, {dev_hist[b]:.1f}; {out / 'best'}")
    engine.close()  # vLLM's teardown destroys the default process group too (it shares it)
    if own_group and dist.is_initialized():
        dist.destroy_process_group()

def plot_curves(out):
    import json
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    recs = [json.loads(l) for l in open(Path(out) / "log.jsonl")]
    panels = [("outcome", "outcome reward"), ("route_r", "route-step reward"), ("kb_acc", "KB choice = gold's"),
              ("answer_r", "answer-step reward"), ("format_ok", "well-formed trajectories"), ("entropy", "entropy"),
              ("kl", "KL to reference (k3)"),
              ("retrievals", "retrieval calls / trajectory"), ("tokens", "policy tokens / trajectory"),
              ("dev_f1_recall", "dev F1-Recall (greedy)"), ("dev_routing_acc", "dev routing accuracy (greedy)"),
              ("dev_routing_macro", "dev balanced routing accuracy (greedy)")]
    fig, axes = plt.subplots(4, 3, figsize=(14, 13))
    for ax, (k, title) in zip(axes.flat, panels):
        pts = [(r["step"], r[k]) for r in recs if r.get(k) is not None]
        if pts:
            ax.plot(*zip(*pts), marker="o", ms=3)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.suptitle(f"Step-GRPO learning curves ({out})")
    fig.tight_layout()
    tmp = Path(out) / ".curves.tmp.png"
    fig.savefig(tmp, dpi=90)
    os.replace(tmp, Path(out) / "curves.png")

if __name__ == "__main__":
    main()
