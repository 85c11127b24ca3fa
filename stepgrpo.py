"""
stepgrpo.py: Step-GRPO, GRPO whose rewards are given per step. One step: this rank's questions -> groups of n
samples of one step at a prompt (or of a whole trajectory) from the rank's engine -> each step's reward
(steprewards.py) -> group-relative advantages on the step's tokens (grpo.advantages) -> the clipped loss and an
AdamW step on the FSDP2 policy (learner.py) -> the new weights into the engine. Flags, their sources and the other
rollout modes, rewards and losses: docs/stepgrpo.md.

    python stepgrpo.py --model out/sft/final --data data/mini --out out/stepgrpo       # the recipe (the defaults)
    torchrun --standalone --nproc_per_node 2 stepgrpo.py --model out/sft/final --out out/stepgrpo
    python stepgrpo.py ... --resume                                                     # from <out>/latest, exactly
    python stepgrpo.py ... --rollout onpolicy --adv_estimator gae                       # PPO with a critic
"""
import argparse
import os
import random
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

import branches
import critic
import dataio
import engines
import evaluate
import grpo
import judge as judges
import learner
import memory
import reward
import rollout
import steprewards
import trainutil
import transcript
import vision
from report import curves_chart

DYNAMIC_TRIES = 4  # --dynamic_sampling: rounds of questions drawn at most in one step (the first included)
KEEP = 3           # newest checkpoints kept (and <out>/best's)

def get_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="out/sft/final", help="policy to start from; the KL reference")
    ap.add_argument("--data", default="data/mini", help="corpus.py folder: questions, KBs, indexes")
    ap.add_argument("--split", nargs="+", default=["train"], help="question splits trained on, mixed")
    ap.add_argument("--out", default="out/stepgrpo")
    ap.add_argument("--resume", nargs="?", const="yes", choices=["yes", "auto"],
                    help="continue from <out>/latest; auto: if there is one")
    # rollouts and rewards
    ap.add_argument("--rollout", default="teacher_prefix", choices=["teacher_prefix", "onpolicy", "branch"],
                    help="a group: n samples of one gold-prefix step | of a question | of an own step")
    ap.add_argument("--branch_steps", type=int, default=2, help="branch: the most steps of a trajectory grouped")
    ap.add_argument("--teacher_spans", default="route", choices=["route", "all"],
                    help="teacher_prefix: train routing steps only, or the answers too")
    ap.add_argument("--prefixes", default="gold", help="teacher_prefix: gold, or a synth.py folder's trajectories")
    ap.add_argument("--reward", default="step", choices=["step", "outcome"],
                    help="step rewards, or the outcome alone (plain GRPO)")
    ap.add_argument("--balance_kb", action=argparse.BooleanOptionalAction, default=True,
                    help="route advantages times the gold route's inverse frequency")
    ap.add_argument("--w_format", type=float, default=0.2, help="reward of a step that parses")
    ap.add_argument("--route_credit", default="split", choices=["whole", "split"],
                    help="teacher_prefix: the KB's credit on the <ret> tokens alone (split)")
    ap.add_argument("--adv_std", action=argparse.BooleanOptionalAction, default=False,
                    help="divide group advantages by the group's std")
    ap.add_argument("--dynamic_sampling", action=argparse.BooleanOptionalAction, default=False,
                    help="DAPO's: draw more questions until every group carries a gradient")
    ap.add_argument("--overlong", default="none", choices=["none", "mask", "penalty"],
                    help="a step cut at its budget: untrained (mask) or DAPO's soft penalty")
    ap.add_argument("--w_hit", type=float, default=0.0, help="onpolicy: reward of a search hitting the gold doc")
    ap.add_argument("--w_rag", type=float, nargs="+", default=[0.0], metavar="W",
                    help="judged relevance [and groundedness] weights on the outcome")
    ap.add_argument("--judge", default=None, metavar="MODEL", help="--w_rag's judge: a model folder")
    ap.add_argument("--judge_url", default=None, help="--judge served: http://host:8000/v1")
    ap.add_argument("--batch_questions", type=int, default=16, help="questions a step, over all ranks")
    ap.add_argument("-n", "--group_size", type=int, default=8, help="samples a group")
    ap.add_argument("--max_steps", type=int, default=3, help="routing steps a trajectory")
    ap.add_argument("--topk", type=int, default=3, help="evidence documents a sub-question")
    ap.add_argument("--retriever", default="dense", help="dense | bm25 | hybrid | http://host:port")
    ap.add_argument("--max_model_len", type=int, default=engines.MAX_LEN, help="the engine's context")
    ap.add_argument("--max_pixels", type=int, default=None, help="VL policy: a picture's pixel cap")
    # optimisation
    ap.add_argument("--lr", type=float, default=5e-6)
    ap.add_argument("--kl_coef", type=float, default=0.0, help="k3 KL to --model in the loss")
    ap.add_argument("--entropy_coef", type=float, default=0.0, help="entropy bonus in the loss")
    ap.add_argument("--old_logprobs", default="sampler", choices=["sampler", "trainer"],
                    help="the ratio's old logprobs: the engine's, or the trainer's recomputed")
    ap.add_argument("--clip_high", type=float, default=0.2, help="the ratio's clip above 1 (DAPO: 0.28)")
    ap.add_argument("--ratio", default="token", choices=["token", "sequence"],
                    help="importance ratio per token (PPO) or per step (GSPO)")
    ap.add_argument("--tis_cap", type=float, default=0.0, help="truncated importance sampling's cap (0: off)")
    ap.add_argument("--minibatches", type=int, default=1, help="optimizer steps a rollout")
    ap.add_argument("--micro_batch", type=int, default=2, help="rows a forward/backward")
    ap.add_argument("--train_steps", type=int, default=12)
    ap.add_argument("--save_every", type=int, default=6)
    ap.add_argument("--eval_questions", type=int, default=100,
                    help="dev questions scored at every checkpoint; <out>/best (0: off)")
    ap.add_argument("--activation_checkpointing", action="store_true")
    ap.add_argument("--offload", action="store_true", help="FSDP2 CPU offload of shards and optimizer state")
    ap.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"],
                    help="compute dtype; auto: bf16 where native")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--lora_r", type=int, default=0, help="LoRA rank (0: all weights)")
    ap.add_argument("--quant", default="none", choices=["none", "nf4", "int8"], help="QLoRA's frozen base")
    ap.add_argument("--backend", default="vllm", choices=["vllm", "hf"], help="each rank's sampler")
    # PPO (--adv_estimator gae; critic.py)
    ap.add_argument("--adv_estimator", default="grpo", choices=list(grpo.ESTIMATORS),
                    help="group-relative (grpo), or GAE over a critic's values (gae: PPO)")
    ap.add_argument("--critic_lr", type=float, default=1e-5, help="gae: the critic's learning rate")
    ap.add_argument("--critic_warmup", type=int, default=4, help="gae: steps training the critic alone first")
    ap.add_argument("--kl_in_reward", type=float, default=0.0, help="gae: KL penalty in the token rewards")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    # the transcript format is the policy's own, from its checkpoint: it has no other to run in
    args.__dict__.update(transcript.trained_format(args.model))
    return args

#### the settings, built once from the flags

@dataclass(frozen=True)
class RolloutConfig:
    """How a step's groups are sampled, scored and turned into advantages (the flags of the same names)."""
    mode: str                  # --rollout
    n: int                     # --group_size
    steps: rollout.Settings    # the step format and budgets, at the sampling temperature
    reward: str = "step"
    estimator: str = "grpo"                        # --adv_estimator
    adv_std: bool = False
    teacher_spans: str = "route"
    route_credit: str = "split"
    overlong: str = "none"
    branch_steps: int = 2
    dynamic_sampling: bool = False

def rollout_config(args):
    steps = rollout.Settings(max_steps=args.max_steps, topk=args.topk, structure=args.structure,
                             max_pairs=args.max_pairs, max_rets=args.max_rets, actions=args.actions,
                             temperature=learner.TEMPERATURE)
    return RolloutConfig(args.rollout, args.group_size, steps, args.reward, args.adv_estimator, args.adv_std,
                         args.teacher_spans, args.route_credit, args.overlong, args.branch_steps,
                         args.dynamic_sampling)

def update_config(args):
    return learner.UpdateConfig(args.micro_batch, args.minibatches, args.clip_high, args.kl_coef,
                                args.entropy_coef, args.ratio, args.tis_cap, args.old_logprobs,
                                args.kl_in_reward, args.adv_estimator == "gae")

def reward_weights(args, questions, judge=None):
    """steprewards.Weights of --w_format, --w_hit, --w_rag with its judge; with --balance_kb the class factors of
    the training questions."""
    balance = steprewards.kb_balance(questions, args.max_steps, args.max_pairs) if args.balance_kb else None
    return steprewards.Weights(args.w_format, args.w_hit, balance, (list(args.w_rag) + [0.0])[:2], judge)

#### rollout groups -> step rewards -> advantages -> training rows

STATS = ("route_r", "kb_acc", "kb_entropy", "kb_mixed", "answer_r", "outcome", "format_ok", "overflow",
         "retrievals", "tokens", "reask", "cut", "refilled", "informative", "rag", "actions")  # logged means

def teacher_prefix_batch(engine, retriever, questions, run, encode, w, seed, store=None):
    """R1-Router's groups: a question's trajectory up to each step is a prompt, the n completions of that one step a
    group, A = grpo.advantages(r) within it. The trajectory is the golden one (rollout.GoldPolicy, real retrieval),
    or the one stored for the question (`store`: qid -> trajectory, e.g. a teacher's, synth.py --teacher)."""
    t0, s, tok, n = time.perf_counter(), run.steps, engine.tok, run.n
    vis = getattr(engine, "vis", None)
    prompts = rollout.span_prefixes([store[q["id"]] for q in questions]) if store is not None else \
        rollout.golden_prefixes(tok, retriever, questions, s, vis=vis)[1]
    stats = {k: [] for k in STATS}
    stats.update(retrieve_s=time.perf_counter() - t0,  # the gold policy writes at no cost: retrieval time
                 rollout_tokens=0, rollout_generated=0)  # a group's prefix once, its completions
    rows = []  # one packed row a group
    kinds = (("route", *rollout.route_stop(tok, s)), ("answer", ["</answer>"], s.answer_tokens))
    for kind, stop, max_tok in kinds[:1] if run.teacher_spans == "route" else kinds:
        todo = [t for t in prompts if (t[1]["kind"] == "route") == (kind == "route")]
        fit = [rollout.fits(engine, prefix, max_tok) for _, _, prefix, _ in todo]
        stats["overflow"] += [float(not f) for f in fit]
        todo = [t for t, f in zip(todo, fit) if f]  # a prefix with no room for the step: no group
        outs = engine.generate([prefix for _, _, prefix, _ in todo for _ in range(n)], max_tok,
                               learner.TEMPERATURE, 1.0, stop, seed,
                               images=[images for *_, images in todo for _ in range(n)],
                               keys=[rollout.turn_key(x, sp) for x, sp, *_ in todo for _ in range(n)])
        for k, (x, sp, prefix, images) in enumerate(todo):
            group = outs[k * n:(k + 1) * n]  # [(ids, logprobs)] of the n completions
            texts = [tok.decode(ids, skip_special_tokens=True) for ids, _ in group]
            scores, gold = steprewards.score_group(kind, x, sp, texts, s, encode, w)
            adds, keep, cut = overlong_group(tok, group, max_tok, stop, run.overlong)
            rs = [sc.reward + add for sc, add in zip(scores, adds)]
            scale = steprewards.kb_factor(w, kind, gold)
            if kind == "route" and run.route_credit == "split":  # [per completion: per-token advantages]
                adv = grpo.split_credit(tok, group, rs, [sc.kb_part for sc in scores], run.adv_std, scale,
                                        run.estimator)
            else:
                adv = grpo.advantages(rs, run.estimator, run.adv_std, scale)
            rows += [dict(r, group=(x["qid"], len(rows)))
                     for r in grpo.group_rows(prefix, group, adv, images, mrope(engine), keep)]
            steprewards.log_group(stats, sp["kind"], scores, cut, [len(ids) for ids, _ in group])
            generated = sum(len(ids) for ids, _ in group)
            stats["rollout_generated"] += generated
            stats["rollout_tokens"] += len(prefix) + generated
    return rows, stats

def onpolicy_batch(engine, retriever, questions, run, encode, w, seed):
    """n whole trajectories a question form a group; span j of sample i gets A_ij (grpo.group_advantages) on its
    tokens. PPO (--adv_estimator gae): each row carries its token rewards (grpo.token_rewards) for the critic."""
    trajs = rollout.rollout(engine, retriever, questions, n=run.n, s=run.steps, seed=seed)
    stats = {k: [] for k in STATS}
    stats.update(retrieve_s=sum(x["timings"]["retrieve"] for x in trajs),
                 rollout_tokens=sum(len(x["ids"]) for x in trajs),  # a transcript once: its prefix is cached
                 rollout_generated=sum(x["n_policy_tokens"] for x in trajs))
    if w.judge:
        steprewards.judge_rag(w, trajs, stats)
    rows, ppo = [], run.estimator == "gae"
    for g, q in enumerate(questions):
        group = trajs[g * run.n:(g + 1) * run.n]
        scored = [overlong_spans(engine.tok, x, *steprewards.span_rewards(x, encode, w), run, stats) for x in group]
        gold = group[0]["gold_steps"]
        scale = {("route", t): steprewards.kb_factor(w, "route", steprewards.gold_route(gold, t))
                 for t in range(run.steps.max_steps)}
        adv = grpo.group_advantages([x["spans"] for x in group], [r for r, _ in scored], [o for _, o in scored],
                                    run.reward, scale, run.adv_std, run.estimator)
        for x, (r, o), a in zip(group, scored, adv):
            adv_tok = grpo.token_advantages(len(x["ids"]), x["spans"], a)
            tok_r = grpo.token_rewards(len(x["ids"]), x["spans"], r, o, run.reward) if ppo else None
            rows += [dict(ids=x["ids"][c:d], mask=x["mask"][c:d], old=x["logprobs"][c:d], adv=adv_tok[c:d],
                          images=vision.images_in(x["images"], c, d), group=(q["id"], g),
                          **({"reward": tok_r[c:d]} if ppo else {}))
                     for c, d in x["segments"] if any(x["mask"][c:d])]  # a row a chat (one unless released)
            steprewards.log_trajectory(stats, x, r, o)
    return rows, stats

def branch_batch(engine, retriever, questions, run, encode, w, seed):
    """Groups at the policy's own states: one trajectory a question, then at up to --branch_steps of its spans
    (branches.branch_points) the n completions of that step from its prefix, each continued to the end by the
    policy (branches.branch); A = grpo.advantages(r) within a group, r = steprewards.branch_reward, on the branched
    step's tokens alone (the prefix and the continuation are context)."""
    ret = branches.Memo(retriever)  # a replayed step's search returns what the trajectory's did
    trajs = rollout.rollout(engine, ret, questions, n=1, s=run.steps, seed=seed)
    picks = branches.branch_points(trajs, run.branch_steps, seed)
    ys = branches.branch(engine, ret, questions, trajs, picks, run.n, run.steps, seed + 1)
    stats = {k: [] for k in STATS}
    stats.update(retrieve_s=sum(x["timings"]["retrieve"] for x in trajs + ys),  # a branch: from its span on
                 rollout_tokens=sum(len(x["ids"]) for x in trajs) + sum(y["new_tokens"] for y in ys),
                 rollout_generated=sum(x["n_policy_tokens"] for x in trajs) + sum(y["generated"] for y in ys))
    if w.judge:
        steprewards.judge_rag(w, ys, stats)  # each branch's outcome
    rows = []
    for group in (ys[k:k + run.n] for k in range(0, len(ys), run.n)):
        scores, gold = steprewards.score_branches(group, encode, w, run.reward)
        prefix, images, completions = branches.branch_group(group)
        sp = group[0]["spans"][group[0]["branch"]]
        adds, keep, cut = overlong_group(engine.tok, completions, *step_budget(engine.tok, run.steps, sp["kind"]),
                                         run.overlong)
        rs = [sc.reward + add for sc, add in zip(scores, adds)]
        adv = grpo.advantages(rs, run.estimator, run.adv_std, steprewards.kb_factor(w, sp["kind"], gold))
        rows += [dict(r, group=(group[0]["qid"], len(rows)))
                 for r in grpo.group_rows(prefix, completions, adv, images, mrope(engine), keep)]
        tokens = [float(y["spans"][y["branch"]]["end"] - y["spans"][y["branch"]]["start"]) for y in group]
        steprewards.log_group(stats, sp["kind"], scores, cut, tokens, group)
    return rows, stats

def mrope(engine):
    """Whether the policy has 3-D positions (a VL policy's mrope): a group is then a row a completion."""
    return getattr(getattr(engine, "vis", None), "mrope", False)

def rollout_rows(engine, retriever, questions, run, encode, w, seed, store=None, pool=()):
    """This rank's training rows and rollout stats from its `questions`, by --rollout. --dynamic_sampling (DAPO):
    only the groups whose advantages are not all 0, and while fewer than len(questions) questions have one, as many
    questions again drawn from `pool` (seeded by the step's seed: an exact resume), at most DYNAMIC_TRIES rounds.
    Logged: refilled, the share of the trained questions drawn after the first round, and informative, their
    number over len(questions)."""
    def batch(qs, sd):
        if run.mode == "onpolicy":
            return onpolicy_batch(engine, retriever, qs, run, encode, w, sd)
        if run.mode == "branch":
            return branch_batch(engine, retriever, qs, run, encode, w, sd)
        return teacher_prefix_batch(engine, retriever, qs, run, encode, w, sd, store)
    rows, stats = batch(questions, seed)
    if not run.dynamic_sampling:
        return rows, stats
    kept, done = [], []  # done: (round, question id) of the questions trained
    for rnd in range(DYNAMIC_TRIES):
        if rnd:
            rows, more = batch(random.Random(seed + rnd).sample(pool, len(questions)), seed + 15485863 * rnd)
            for k, v in more.items():
                stats[k] += v
        groups = {}
        for r in rows:
            groups.setdefault(r["group"], []).append(r)
        for (qid, _), g in groups.items():
            if ((rnd, qid) in done or len(done) < len(questions)) and \
                    any(a for r in g for a, m in zip(r["adv"], r["mask"]) if m):
                done += [] if (rnd, qid) in done else [(rnd, qid)]
                kept += g
        if len(done) >= len(questions):
            break
    stats["refilled"].append(sum(r > 0 for r, _ in done) / max(1, len(done)))
    stats["informative"].append(len(done) / len(questions))
    return kept, stats

def step_budget(tok, s, kind):
    """(new tokens, stop strings) of a step of `kind` under settings s, the budgets evaluation gives it, so a step
    is judged as it will be scored; an action is written where a route is, under a route's budget."""
    if kind in ("route", *reward.ACTIONS):
        stop, n = rollout.route_stop(tok, s)
        return n, stop
    return s.answer_tokens, ["</answer>"]

def overlong_group(tok, group, budget, stop, mode):
    """--overlong on completions [(ids, logprobs)] of one step (grpo.overlong): each one's reward added, whether it
    is trained, and whether the engine cut it at the budget."""
    cut = [grpo.was_cut(tok, ids, budget, stop) for ids, _ in group]
    shaped = [grpo.overlong(len(ids), budget, c, mode) for (ids, _), c in zip(group, cut)]
    return [a for a, _ in shaped], [k for _, k in shaped], cut

def overlong_spans(tok, x, r, o, run, stats):
    """--overlong on on-policy trajectory x with span rewards r and outcome o: a span the engine cut at its budget
    leaves the mask, or its reward (the outcome's with --reward outcome) gets the soft penalty. Returns r, o."""
    r = list(r)
    for j, sp in enumerate(x["spans"]):
        ids = x["ids"][sp["start"]:sp["end"]]
        (add,), (keep,), cut = overlong_group(tok, [(ids, None)], *step_budget(tok, run.steps, sp["kind"]),
                                              run.overlong)
        stats["cut"] += [float(c) for c in cut]
        if run.reward == "outcome":
            o += add
        else:
            r[j] += add
        if not keep:
            x["mask"][sp["start"]:sp["end"]] = [0] * (sp["end"] - sp["start"])
    return r, o

#### the update's size, the weight sync, the log

def update_tokens(args):
    """The most policy tokens a micro-batch can hold at these flags, the N of the loss's [N, vocabulary] logits (the
    memory check's): --micro_batch rows, each a packed group of n completions or a whole trajectory, at the step
    budgets (a multi-query routing step may write max_pairs pairs: rollout.route_stop)."""
    run = rollout_config(args)
    s = run.steps
    route = s.route_tokens * s.max_pairs
    row = run.n * max(route, s.answer_tokens) if run.mode != "onpolicy" else s.max_steps * route + s.answer_tokens
    return args.micro_batch * row

def sync_weights(model, engine, rows, pad_id, peak, check, dtype):
    """The policy's new weights into this rank's engine, and after this process's first update and where `check`
    says (main: at every checkpoint) the engine's logprobs of a row against the trainer's (trainutil.sync_gap;
    exits above the tolerance). Returns the timings (sync_s; sync_mean_diff and sync_max_diff where checked)."""
    check = check or "sync" not in peak.gib  # gib: the phases run so far
    t = time.perf_counter()
    with peak("sync"):
        engine.sync_weights(trainutil.policy_params(model))
    timing = dict(sync_s=time.perf_counter() - t)
    if check:
        row = rows[0] if rows else dict(ids=[pad_id] * 2)  # nothing fit: a stand-in (sync_gap is a collective)
        gap, timing["sync_max_diff"] = trainutil.sync_gap(model, engine, row, trainutil.compute_device(model))
        timing["sync_mean_diff"] = gap
        tol = trainutil.sync_tol(dtype, engine)
        if not gap <= tol:  # NaN fails too
            sys.exit(f"error: after the weight sync the engine's logprobs differ from the trainer's by {gap:.3g} "
                     f"on average (tolerance {tol:g}): the engine does not sample from the policy being trained")
    return timing

def log_record(step, epoch, stats, sums, grad_norm, timing, rows, upd):
    """One log.jsonl record: means over all ranks of the rollout stats, the update's per-token sums, the timings."""
    sums = dict(sums)
    ppo = critic.record(sums.pop("critic")) if "critic" in sums else {}  # value_loss, vf_clipfrac, explained_var
    local = {**sums, **{f"{k}.{part}": v for k in STATS for part, v in (("sum", sum(stats[k])),
                                                                         ("n", len(stats[k])))}, **timing}
    vec = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=sums["loss"].device) for v in local.values()])
    dist.all_reduce(vec)
    tot, world = dict(zip(local, vec.tolist())), dist.get_world_size()
    n_tok = max(1.0, tot["tokens"])
    adv = [abs(a) for s in rows for a, m in zip(s["adv"], s["mask"]) if m]  # rank 0's
    return dict(step=step, epoch=epoch, world=world,
                **{k: tot[f"{k}.sum"] / tot[f"{k}.n"] if tot[f"{k}.n"] else None for k in STATS},
                loss=tot["loss"],  # the global mean loss
                kl=tot["kl"] / n_tok if upd.kl_coef > 0 else None,
                clip_frac=(tot["clip_low"] + tot["clip_high"]) / n_tok,  # verl's pg_clipfrac
                clip_low_frac=tot["clip_low"] / n_tok, clip_high_frac=tot["clip_high"] / n_tok,
                tis_weight=tot["tis"] / n_tok if upd.tis_cap else None,
                tis_capped=tot["tis_capped"] / n_tok if upd.tis_cap else None,
                old_gap=tot["old_gap"] / n_tok if upd.old_logprobs == "trainer" else None,
                entropy=tot["entropy"] / n_tok, grad_norm=grad_norm, adv_abs=float(np.mean(adv or [0.0])),
                **ppo, **{k: tot[k] / world for k in timing})

#### main

@dataclass
class Policy:
    """The trained policy (FSDP2), its KL reference (None: none, or LoRA's base), AdamW, PPO's (critic, AdamW)
    or None, and this rank's engine holding the policy's weights."""
    model: torch.nn.Module
    ref: torch.nn.Module | None
    opt: torch.optim.Optimizer
    crit: tuple | None
    engine: object

def setup_policy(args, start, weights, resuming, lora, rank, world, device, print0):
    """The Policy, and the step and dev history it resumes at. --backend hf: an unsharded transformers copy synced
    after each update as vLLM's is (not generate on the FSDP2 module, whose every decoding step would be a
    collective all ranks run in lockstep)."""
    tree = args.rollout != "onpolicy"  # packed groups: 4D attention masks (SDPA, not flash-attn)
    bf16 = args.dtype == "bf16"
    model = trainutil.load_sharded(weights, device, world, args.activation_checkpointing, bf16=bf16,
                                   tree_mask=tree, lora=lora, offload=args.offload)
    kl = (args.kl_coef > 0 or args.kl_in_reward > 0) and not lora  # LoRA: the reference is its adapters off
    ref = trainutil.load_sharded(args.model, device, world, train=False, bf16=bf16, tree_mask=tree,
                                 offload=args.offload) if kl else None
    params = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters alone
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0)
    crit = critic.load(args.model, args.critic_lr, device, world, lora, bf16, args.activation_checkpointing,
                       args.offload) if args.adv_estimator == "gae" else None
    step, dev_hist = 0, {}  # dev_hist: step -> dev score (--eval_questions)
    if resuming:
        state = trainutil.load_trainer_state(model, opt, start, args, print0, crit)
        step, dev_hist = state["step"], state.get("dev", {})
    if args.backend == "hf":
        engine = engines.HFEngine(weights, seed=args.seed + rank, max_model_len=args.max_model_len,
                                  max_pixels=args.max_pixels, device=device)
    else:
        share = engines.VLLMEngine.OFFLOAD_FRACTION if args.offload else engines.VLLMEngine.GPU_FRACTION
        memory.check_gpu_budget(model, opt, share, world, update_tokens(args), crit)
        engine = engines.VLLMEngine(weights, max_model_len=args.max_model_len, max_pixels=args.max_pixels,
                                    max_images=rollout_config(args).steps.max_images, seed=args.seed + rank, device=device,
                                    gpu_memory_utilization=share)  # each rank owns one engine
    if lora:  # the engine holds the base: give it the policy (resumed adapters; a quantised base as trained)
        engine.sync_weights(trainutil.policy_params(model))
    return Policy(model, ref, opt, crit, engine), step, dev_hist

def load_inputs(args, weights, device, print0):
    """The training questions (a --prefixes store's alone), the dev questions, the retriever, the tokenizer and
    the --prefixes store (None: gold prefixes); exits with one line on bad data."""
    import retrievers
    from transformers import AutoTokenizer
    try:
        questions = [q for sp in args.split for q in dataio.load_questions(args.data, sp)]
        dev_qs = dataio.load_questions(args.data, "dev")[:args.eval_questions] if args.eval_questions else []
        ret = retrievers.make_retriever(args.retriever, args.data, device)  # one device decision, env_rank's
        tok = AutoTokenizer.from_pretrained(weights)
        store = transcript.load_trajectories(args.prefixes, tok, print0) if args.prefixes != "gold" else None
    except dataio.DataError as e:
        sys.exit(f"error: {e}")
    if store is not None:  # a teacher's trajectories: only the questions it kept are trained on
        questions = [q for q in questions if q["id"] in store]
        print0(f"--prefixes {args.prefixes}: {len(questions)} of its {len(store)} trajectories' questions are "
               "in --split")
    check_questions(questions, args)
    return questions, dev_qs, ret, tok, store

def main(argv=None, close=True):
    """close: shut the engine and the process group down at the end, for a caller in the same process (the command
    line leaves through engines.exit_now instead)."""
    import retrievers  # faiss: not at import (the tests import this module)
    args = get_args(argv)
    rank, world, device, print0 = trainutil.env_rank(args.device)
    check_args(args, world)
    lora = trainutil.lora_of(args.lora_r, args.quant)
    args.dtype = trainutil.resolve_dtype(args.dtype, device)  # the resolved choice is what a checkpoint records
    out = Path(args.out)
    start, weights, resuming = trainutil.resolve_start(args.model, out, args.resume, lora is not None)
    questions, dev_qs, ret, tok, store = load_inputs(args, weights, device, print0)
    own_group = trainutil.init_group(world, device=device)
    judge = load_judge(args, out / f"judge-{rank}.jsonl") if any(args.w_rag) else None
    encode = retrievers.Encoder(device=device).encode  # the sub-question cosine's encoder
    vis = vision.VisionIO.load(weights, args.max_pixels)
    files = vis.proc if vis else tok  # saved beside the weights: a VL model's processor, else the tokenizer
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    p, step, dev_hist = setup_policy(args, start, weights, resuming, lora, rank, world, device, print0)
    run, upd, w = rollout_config(args), update_config(args), reward_weights(args, questions, judge)
    greedy = replace(run.steps, temperature=0.0)  # the dev evaluation's
    if w.route_scale:
        print0("--balance_kb route advantage factors: " +
               ", ".join(f"{c} {v:.2f}" for c, v in sorted(w.route_scale.items())))
    per_epoch = len(questions) // args.batch_questions
    log = trainutil.Log(out, rank, step, resuming, vars(args))
    if args.adv_estimator == "gae":
        critic.check_resumed(out, step, args.critic_warmup)  # a resume past the warm-up meets its gate again
    n_trained = sum(q.numel() for q in p.model.parameters() if q.requires_grad) / 1e6
    print0(f"Step-GRPO ({args.rollout}, reward {args.reward}): world {world} ({trainutil.device_kind(device)}: "
           f"{args.dtype}), {n_trained:.2f}M trained weights{' (LoRA)' if lora else ''}, {len(questions)} "
           f"questions, {args.batch_questions} x {args.group_size} per step, {args.train_steps} steps")
    bar = trainutil.progress(rank, args.train_steps, step, "step-grpo")
    peak, peaks = memory.PeakMemory(device), {}  # peaks: phase -> the highest GiB of each rank over the run
    if dev_qs and step == 0:  # the starting policy's dev score: what the trained checkpoints have to beat
        dev = evaluate.dev_scores(p.engine, ret, dev_qs, greedy, rank, world)
        log(dict(step=0, **dev))
        print0(f"dev ({len(dev_qs)} questions) at the start: F1-Recall {dev['dev_f1_recall']:.1f}, "
               f"routing acc {dev['dev_routing_acc']:.1f}")

    #### training loop
    while step < args.train_steps:
        epoch, pos = divmod(step, per_epoch)
        order = torch.randperm(len(questions), generator=torch.Generator().manual_seed(args.seed + epoch)).tolist()
        mine = [questions[i] for i in order[pos * args.batch_questions:(pos + 1) * args.batch_questions]]
        mine = mine[rank::world]  # this rank's share of the step's questions
        step += 1
        seed = args.seed + 7919 * (step - 1) + 104729 * rank
        saving = (args.save_every and step % args.save_every == 0) or step == args.train_steps
        warmup = p.crit is not None and step <= args.critic_warmup  # PPO: the critic learns alone
        # rollout groups, their step rewards and advantages: the training rows
        t = time.perf_counter()
        with peak("rollout"):
            rows, stats = rollout_rows(p.engine, ret, mine, run, encode, w, seed, store, questions)
        timing = dict(rollout_s=time.perf_counter() - t, retrieve_s=stats.pop("retrieve_s"),
                      rollout_tokens=stats.pop("rollout_tokens"),  # this rank's rollout work (bench/flops.py)
                      rollout_generated=stats.pop("rollout_generated"))
        p.engine.sleep()  # GPU: the engine's memory goes to the update until the sync wakes it
        # the update: the clipped loss over the rows (PPO: GAE from the critic first)
        micro, sums, grad_norm = learner.learn(p.model, p.ref, p.opt, p.crit, rows, upd, pad_id, device,
                                               getattr(p.engine, "vis", None), seed, warmup, peak, timing)
        lengths = [n for m in micro for n in m.lengths]
        timing.update(update_rows=len(lengths), update_tokens=sum(lengths),  # this rank's work (bench/flops.py)
                      update_policy=sum(len(m.logp_sampler) for m in micro if m.weight))
        # the weight sync: the engine samples from the updated policy
        timing.update(sync_weights(p.model, p.engine, rows, pad_id, peak, saving, args.dtype))
        # the log, the dev score and the checkpoint
        rec = log_record(step, epoch, stats, sums, grad_norm, timing, rows, upd)
        rec["memory_gib"] = memory.gather_peaks(peak.gib, world)  # per phase since the last record, a value a rank
        if saving and dev_qs:
            t = time.perf_counter()
            rec.update(evaluate.dev_scores(p.engine, ret, dev_qs, greedy, rank, world),
                       dev_s=time.perf_counter() - t)
            dev_hist[step] = rec["dev_score"]
        log(rec)
        peaks = memory.highest(peaks, rec["memory_gib"])
        if bar:
            bar.update(1)
            bar.set_postfix(route=f"{rec['route_r'] or 0:.3f}", kb_acc=f"{rec['kb_acc'] or 0:.2f}",
                            fmt=f"{rec['format_ok']:.2f}", sync=f"{rec['sync_s']:.2f}s")
        if saving:
            with peak("checkpoint"):
                checkpoint(p, files, out, step, args, dev_hist, rank)
        if args.adv_estimator == "gae":
            critic.check_warmup(rec, step, args.critic_warmup)  # after the checkpoint: the critic is kept
    peaks = memory.highest(peaks, memory.gather_peaks(peak.gib, world))  # the last checkpoint's
    if rank == 0:
        trainutil.link_step(out, step, "final")
        bar.close()
        log.close()
        dataio.write_atomic(out / "curves.png", curves_chart(out / "log.jsonl", "Step-GRPO learning curves"))
    report(out, step, peaks, dev_hist, world, print0)
    if close:
        p.engine.close()  # vLLM's teardown destroys the default process group too (it shares it)
        if own_group and dist.is_initialized():
            dist.destroy_process_group()

def checkpoint(p, files, out, step, args, dev_hist, rank):
    """Save step `step` (the newest KEEP kept, and the best on dev's), and link <out>/best to the best."""
    best = max(dev_hist, key=dev_hist.get) if dev_hist else None  # the earliest of equal scores
    trainutil.save_checkpoint(p.model, p.opt, files, out, step, dict(args=vars(args), dev=dev_hist), rank, KEEP,
                              protect=f"step_{best}" if best else None, crit=p.crit,
                              merged=step == args.train_steps or best == step,  # LoRA: final and best
                              fmt=transcript.format_meta(args))
    if rank == 0 and best:
        trainutil.link_step(out, best, "best")

def report(out, step, peaks, dev_hist, world, print0):
    print0(f"done: {step} steps; final checkpoint {out / 'final'}; learning curves {out / 'curves.png'}")
    print0("peak memory (GiB), rank " + " / ".join(map(str, range(world))) + ": " +
           ", ".join(f"{k} " + " / ".join(f"{v:.1f}" for v in vs) for k, vs in peaks.items()))
    if dev_hist:
        b = max(dev_hist, key=dev_hist.get)
        print0(f"best on dev (mean of F1-Recall and routing accuracy): step {b}, {dev_hist[b]:.1f}; {out / 'best'}")

def load_judge(args, cache):
    """--w_rag's judge (judge.py), its ratings cached in `cache`; a server is asked now."""
    try:
        return judges.Judge.load(args.judge, args.judge_url, cache=cache, seed=args.seed,
                                 max_model_len=args.max_model_len)
    except dataio.DataError as e:
        sys.exit(f"error: {e}")

#### argument checks: one-line errors before anything is loaded

def check_args(args, world):
    """Flag combinations that cannot work. --tis_cap and --quant int8 set --old_logprobs trainer: the IS weights are
    pi_trainer / pi_sampler, and LLM.int8 quantises activations, so the engine's logprobs are not the trainer's."""
    if args.tis_cap > 0:
        args.old_logprobs = "trainer"
    if args.quant == "int8" and args.old_logprobs != "trainer":
        args.old_logprobs = "trainer"
        if int(os.environ.get("RANK", 0)) == 0:
            print("note: --quant int8 uses --old_logprobs trainer (LLM.int8 quantises activations: the engine's "
                  "bf16 logprobs are not the trainer's)", flush=True)
    if args.rollout != "teacher_prefix" and args.prefixes != "gold":
        sys.exit(f"error: --prefixes is a teacher_prefix flag (--rollout {args.rollout} writes its own steps)")
    if args.rollout == "teacher_prefix" and args.reward == "outcome":
        sys.exit("error: --reward outcome needs --rollout onpolicy or branch (a teacher_prefix group holds one "
                 "step, no outcome)")
    if len(args.w_rag) > 2 or min(args.w_rag) < 0 or (any(args.w_rag) and not args.judge) or \
            (args.judge_url and not args.judge):
        sys.exit(f"error: --w_rag {' '.join(map(str, args.w_rag))}: one or two weights >= 0 (relevance, "
                 "groundedness), and --judge MODEL to rate them (--judge_url needs --judge too)")
    if any(args.w_rag) and args.rollout == "teacher_prefix":
        sys.exit("error: --w_rag judges a whole trajectory's evidence and answer: it needs --rollout onpolicy "
                 "or branch")
    if any(args.w_rag) and world > 1 and not args.judge_url:  # two in-process vLLM engines a rank
        sys.exit("error: --judge in-process runs in a single process; under torchrun serve it and pass "
                 "--judge_url")
    if args.branch_steps < 1:
        sys.exit(f"error: --branch_steps {args.branch_steps}: it must be at least 1")
    if args.batch_questions % world:
        sys.exit(f"error: --batch_questions {args.batch_questions} must be divisible by the world size {world}")
    if args.group_size < 1 or (args.group_size < 2 and args.adv_estimator != "gae"):
        sys.exit(f"error: -n {args.group_size}: a group needs at least 2 samples to have a relative advantage "
                 "(--adv_estimator gae: 1 is enough)")
    if not (args.clip_high >= 0 and args.tis_cap >= 0 and args.minibatches >= 1):
        sys.exit(f"error: --clip_high {args.clip_high} --tis_cap {args.tis_cap} --minibatches "
                 f"{args.minibatches}: clip_high >= 0, tis_cap >= 0, minibatches >= 1")
    if args.adv_estimator == "gae":
        check_ppo(args)
    elif args.kl_in_reward:
        sys.exit("error: --kl_in_reward is PPO's (--adv_estimator gae); group advantages take --kl_coef")
    rollout.check_multi_query(args.max_pairs, args.max_rets, args.structure, args.actions)
    if err := transcript.check_format(args.model, args):
        sys.exit(f"error: {err}")

def check_ppo(args):
    """PPO's flags. A --structure released trajectory is several single-turn chats, each valued by the critic
    without the chats before it: PPO refuses it rather than run GAE across states it cannot see."""
    if args.rollout != "onpolicy":
        sys.exit("error: --adv_estimator gae needs --rollout onpolicy: PPO's returns run over whole trajectories")
    if args.structure != "transcript":
        sys.exit(f"error: --adv_estimator gae needs a --structure transcript policy ({args.model}'s is "
                 "released): a released trajectory's chats are valued apart, so GAE cannot run across them")
    if args.actions:
        sys.exit(f"error: --adv_estimator gae needs one chat a trajectory ({args.model} was trained with "
                 "actions, which restart the chat): GAE cannot run across chats valued apart")
    if args.dynamic_sampling:
        sys.exit("error: --dynamic_sampling drops groups whose advantages are all 0: PPO (--adv_estimator gae) "
                 "has no groups")
    if args.critic_warmup < 0 or args.kl_in_reward < 0:
        sys.exit(f"error: --critic_warmup {args.critic_warmup} --kl_in_reward {args.kl_in_reward}: a warm-up "
                 ">= 0, a penalty >= 0")

def check_questions(questions, args):
    """Training questions Step-GRPO cannot use."""
    where = f"--data {args.data} --split {' '.join(args.split)}"
    if len(questions) < args.batch_questions:
        sys.exit(f"error: --batch_questions {args.batch_questions} is more than the {len(questions)} questions "
                 f"of {where}")
    blank = [q["id"] for q in questions if any(not s.get("sub_question", "").strip() for s in q.get("steps", []))]
    if blank:  # the route reward's cosine would compare every sub-question with ""
        sys.exit(f"error: {len(blank)} questions of {where} have gold steps without a sub-question (first: "
                 f"{blank[0]}); the route reward needs gold sub-questions")

if __name__ == "__main__":
    main(close=False)
    engines.exit_now()
