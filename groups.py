"""
groups.py: Step-GRPO's rollout modes, the groups of one step and what becomes of them. A group is n
samples compared with each other: n completions of one step at a golden (or a teacher's) prefix
(teacher_prefix, R1-Router's), n whole trajectories of one question (onpolicy), or n completions of
one step at the policy's own state, each continued to the end (branch). Each mode samples its
groups, scores every sample (steprewards.py: records, then the logged numbers from them), takes the
advantages within each group (grpo.advantages, whatever --adv_estimator names) and packs the
training rows (grpo.group_rows). rollout_rows runs the mode, DAPO's dynamic sampling on top.
"""
import random
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch

import branches
import grpo
import reward
import rollout
import steprewards
import vision
from engines import CPU_BLOCK
from learner import TEMPERATURE

DYNAMIC_TRIES = 4  # --dynamic_sampling: rounds of questions drawn at most a step (the first too)

@dataclass(frozen=True)
class RolloutConfig:
    """How a step's groups are sampled, scored and turned into advantages (the flags of the same
    names)."""
    mode: str                  # --rollout
    n: int                     # --group_size
    steps: rollout.Settings    # the step format and budgets, at the sampling temperature
    reward: str = "step"
    estimator: str = "grpo"    # --adv_estimator
    adv_std: bool = False
    teacher_spans: str = "route"
    route_credit: str = "split"
    overlong: str = "none"
    branch_steps: int = 2
    dynamic_sampling: bool = False

    def update_tokens(self, micro_batch):
        """The most policy tokens a micro-batch can hold, the N of the loss's [N, vocabulary]
        logits (memory.check_gpu_budget's): micro_batch rows, each a packed group of n completions
        or a whole trajectory, at the step budgets (a multi-query routing step may write max_pairs
        pairs: rollout.route_stop)."""
        s = self.steps
        route = s.route_tokens * s.max_pairs
        if self.mode == "onpolicy":
            return micro_batch * (s.max_steps * route + s.answer_tokens)
        return micro_batch * self.n * max(route, s.answer_tokens)

    def update_positions(self, micro_batch, max_len):
        """The most tokens, prompts included, a micro-batch can hold (the update's activations:
        memory.activation_bytes): micro_batch rows, each a trajectory within max_len or a packed
        group, its prefix (within max_len) and n completions after the prefix's last token."""
        s = self.steps
        if self.mode == "onpolicy":
            return micro_batch * max_len
        return micro_batch * (max_len + self.n * (1 + max(s.route_tokens * s.max_pairs,
                                                          s.answer_tokens)))

    def kv_tokens(self, questions, dev_questions=0):
        """The KV cache (tokens) that holds a rank's step at once, all of its requests in flight:
        teacher_prefix, each of its `questions`' trajectories once (its golden prefixes share its
        blocks) and the n completions at each step, each in its prefix's last, partial block and
        its own tokens; else its questions x n trajectories, at most steps.max_active in flight; or
        the dev evaluation's `dev_questions` if more. A trajectory: rollout.trajectory_tokens. (The
        engine adds room for one max_model_len request.)"""
        s = self.steps
        trajectory = rollout.trajectory_tokens(s)
        if self.mode == "teacher_prefix":
            completion = CPU_BLOCK + max(s.route_tokens * s.max_pairs, s.answer_tokens)
            need = questions * (trajectory + self.n * (s.max_steps + 1) * completion)
        else:
            need = min(questions * self.n, s.max_active) * trajectory
        return max(need, min(dev_questions, s.max_active) * trajectory)

STATS = ("route_r", "kb_acc", "kb_entropy", "kb_mixed", "answer_r", "outcome", "format_ok",
         "overflow", "retrievals", "tokens", "reask", "cut", "refilled", "informative", "rag",
         "actions")  # the rollout's logged means

def step_questions(questions, step, batch_questions, seed, rank, world):
    """(epoch, this rank's share of the questions of step `step` + 1): an epoch's shuffle seeded by
    its number."""
    epoch, pos = divmod(step, len(questions) // batch_questions)
    gen = torch.Generator().manual_seed(seed + epoch)
    order = torch.randperm(len(questions), generator=gen).tolist()
    order = order[pos * batch_questions:(pos + 1) * batch_questions]
    return epoch, [questions[i] for i in order][rank::world]

def check_questions(questions, batch_questions, where):
    """Training questions (of `where`, the flags that named them) Step-GRPO cannot use: one line."""
    if len(questions) < batch_questions:
        sys.exit(f"error: --batch_questions {batch_questions} is more than the "
                 f"{len(questions)} questions of {where}")
    blank = [q["id"] for q in questions
             if any(not s.get("sub_question", "").strip() for s in q.get("steps", []))]
    if blank:  # the route reward's cosine would compare every sub-question with ""
        sys.exit(f"error: {len(blank)} questions of {where} have gold steps without a sub-question "
                 f"(first: {blank[0]}); the route reward needs gold sub-questions")

def teacher_prefix_batch(engine, retriever, questions, run, encode, w, seed, store=None):
    """R1-Router's groups: a question's trajectory up to each step is a prompt, the n completions of
    that one step a group, A = grpo.advantages(r) within it. The trajectory is the golden one
    (rollout.GoldPolicy, real retrieval), or the one stored for the question (`store`: qid ->
    trajectory, e.g. a teacher's, synth.py --teacher)."""
    t0, s, tok, n = time.perf_counter(), run.steps, engine.tok, run.n
    vis = getattr(engine, "vis", None)
    prompts = rollout.span_prefixes([store[q["id"]] for q in questions]) if store is not None else \
        rollout.golden_prefixes(tok, retriever, questions, s, vis=vis)[1]
    stats = {k: [] for k in STATS}
    stats.update(retrieve_s=time.perf_counter() - t0,  # the gold policy writes at no cost
                 rollout_tokens=0, rollout_generated=0)  # a group's prefix once, its completions
    rows, samples = [], []  # one packed row a group; a Sample a completion
    kinds = (("route", *rollout.route_stop(tok, s)), ("answer", ["</answer>"], s.answer_tokens))
    for kind, stop, max_tok in kinds[:1] if run.teacher_spans == "route" else kinds:
        todo = [t for t in prompts if (t[1]["kind"] == "route") == (kind == "route")]
        fit = [rollout.fits(engine, prefix, max_tok) for _, _, prefix, _ in todo]
        stats["overflow"] += [float(not f) for f in fit]
        todo = [t for t, f in zip(todo, fit) if f]  # a prefix with no room for the step: no group
        outs = engine.generate([prefix for _, _, prefix, _ in todo for _ in range(n)], max_tok,
                               TEMPERATURE, 1.0, stop, seed,
                               images=[images for *_, images in todo for _ in range(n)],
                               keys=[rollout.turn_key(x, sp) for x, sp, *_ in todo
                                     for _ in range(n)])
        for k, (x, sp, prefix, images) in enumerate(todo):
            group = outs[k * n:(k + 1) * n]  # [(ids, logprobs)] of the n completions
            texts = [tok.decode(ids, skip_special_tokens=True) for ids, _ in group]
            scores, gold = steprewards.score_group(kind, x, sp, texts, s, encode, w)
            adds, keep, cut = overlong_group(tok, group, max_tok, stop, run.overlong)
            rs = [sc.reward + add for sc, add in zip(scores, adds)]
            scale = steprewards.kb_factor(w, kind, gold)
            if kind == "route" and run.route_credit == "split":  # per completion, a value a token
                kb_part = [sc.kb_part for sc in scores]
                adv = grpo.split_credit(tok, group, rs, kb_part, run.adv_std, scale, run.estimator)
            else:
                adv = grpo.advantages(rs, run.estimator, run.adv_std, scale)
            rows += [dict(r, group=(x["qid"], len(rows)))
                     for r in grpo.group_rows(prefix, group, adv, images, mrope(engine), keep)]
            samples += [rollout.prefix_sample(x, sp, text, s, r, float(np.mean(a)),
                                              sc.step if sp["kind"] == "final" else None)
                        for text, r, a, sc in zip(texts, rs, adv, scores)]
            steprewards.log_group(stats, sp["kind"], scores, cut, [len(ids) for ids, _ in group])
            generated = sum(len(ids) for ids, _ in group)
            stats["rollout_generated"] += generated
            stats["rollout_tokens"] += len(prefix) + generated
    return rows, stats, samples

def onpolicy_batch(engine, retriever, questions, run, encode, w, seed):
    """n whole trajectories a question form a group; span j of sample i gets A_ij
    (grpo.group_advantages) on its tokens. PPO (--adv_estimator gae): each row carries its token
    rewards (grpo.token_rewards) for the critic."""
    trajs = rollout.rollout(engine, retriever, questions, n=run.n, s=run.steps, seed=seed)
    stats = {k: [] for k in STATS}
    stats.update(retrieve_s=sum(x.timings["retrieve"] for x in trajs),
                 rollout_tokens=sum(len(x.ids) for x in trajs),  # a transcript once (cached)
                 rollout_generated=sum(x.n_policy_tokens for x in trajs))
    if w.judge:
        stats["rag"] = steprewards.judge_rag(w, trajs)
    rows, samples, ppo = [], [], run.estimator == "gae"
    for g, q in enumerate(questions):
        group = trajs[g * run.n:(g + 1) * run.n]
        scored = [overlong_spans(engine.tok, x, *steprewards.span_rewards(x, encode, w), run, stats)
                  for x in group]  # [(span rewards, outcome)] a sample
        gold = group[0].gold_steps
        scale = {("route", t): steprewards.kb_factor(w, "route", steprewards.gold_route(gold, t))
                 for t in range(run.steps.max_steps)}
        adv = grpo.group_advantages([x.spans for x in group], [r for r, _ in scored],
                                    [o for _, o in scored], run.reward, scale, run.adv_std,
                                    run.estimator)
        for x, (r, o), a in zip(group, scored, adv):
            adv_tok = grpo.token_advantages(len(x.ids), x.spans, a)
            tok_r = grpo.token_rewards(len(x.ids), x.spans, r, o, run.reward) if ppo else None
            rows += [dict(ids=x.ids[c:d], mask=x.mask[c:d], old=x.logprobs[c:d],
                          adv=adv_tok[c:d], images=vision.images_in(x.images, c, d),
                          group=(q["id"], g), **({"reward": tok_r[c:d]} if ppo else {}))
                     for c, d in x.segments if any(x.mask[c:d])]  # a row a chat
            samples.append(rollout.sample_of(x, r, a, o))
            steprewards.log_trajectory(stats, x, r, o)
    return rows, stats, samples

def branch_batch(engine, retriever, questions, run, encode, w, seed):
    """Groups at the policy's own states: one trajectory a question, then at up to --branch_steps of
    its spans (branches.branch_points) the n completions of that step from its prefix, each
    continued to the end by the policy (branches.branch); A = grpo.advantages(r) within a group, r =
    steprewards.branch_reward, on the branched step's tokens alone (the prefix and the continuation
    are context)."""
    ret = branches.Memo(retriever)  # a replayed step's search returns what the trajectory's did
    trajs = rollout.rollout(engine, ret, questions, n=1, s=run.steps, seed=seed)
    picks = branches.branch_points(trajs, run.branch_steps, seed)
    ys = branches.branch(engine, ret, questions, trajs, picks, run.n, run.steps, seed + 1)
    stats = {k: [] for k in STATS}
    stats.update(retrieve_s=sum(x.timings["retrieve"] for x in trajs + ys),
                 rollout_tokens=sum(len(x.ids) for x in trajs)  # a branch: from its span on
                 + sum(y.new_tokens for y in ys),
                 rollout_generated=sum(x.n_policy_tokens for x in trajs)
                 + sum(y.generated for y in ys))
    if w.judge:
        stats["rag"] = steprewards.judge_rag(w, ys)  # each branch's outcome
    rows, samples = [], []
    for group in (ys[k:k + run.n] for k in range(0, len(ys), run.n)):
        scores, gold = steprewards.score_branches(group, encode, w, run.reward)
        prefix, images, completions = branches.branch_group(group)
        sp = group[0].spans[group[0].branch]
        budget, stop = step_budget(engine.tok, run.steps, sp["kind"])
        adds, keep, cut = overlong_group(engine.tok, completions, budget, stop, run.overlong)
        rs = [sc.reward + add for sc, add in zip(scores, adds)]
        scale = steprewards.kb_factor(w, sp["kind"], gold)
        adv = grpo.advantages(rs, run.estimator, run.adv_std, scale)
        rows += [dict(r, group=(group[0].qid, len(rows)))
                 for r in grpo.group_rows(prefix, completions, adv, images, mrope(engine), keep)]
        tokens = [float(y.spans[y.branch]["end"] - y.spans[y.branch]["start"])
                  for y in group]
        steprewards.log_group(stats, sp["kind"], scores, cut, tokens, group)
        samples += [branch_sample(y, r, a, sc.outcome)
                    for y, r, a, sc in zip(group, rs, adv, scores)]
    return rows, stats, samples

def branch_sample(y, r, adv, outcome):
    """Branch trajectory y as a rollout.Sample: on its branched step the reward r its advantage adv
    is of (steprewards.branch_reward's), the outcome its score."""
    only = lambda v: [v if j == y.branch else None for j in range(len(y.spans))]  # noqa: E731
    return rollout.sample_of(y, only(r), only(adv), outcome)

def mrope(engine):
    """Whether the policy has 3-D positions (a VL policy's mrope): a group is then a row a
    completion."""
    return getattr(getattr(engine, "vis", None), "mrope", False)

def rollout_rows(engine, retriever, questions, run, encode, w, seed, store=None, pool=()):
    """This rank's training rows, rollout stats and sampled trajectories (rollout.Sample: a
    teacher_prefix completion, an on-policy trajectory, a branch; for the log's tables) from its
    `questions`, by --rollout.
    --dynamic_sampling (DAPO): only the groups whose advantages are not all 0, and while fewer than
    len(questions) questions have one, as many questions again drawn from `pool` (seeded by the
    step's seed: an exact resume), at most DYNAMIC_TRIES rounds. Logged: refilled, the share of the
    trained questions drawn after the first round, and informative, their number over
    len(questions)."""
    def batch(qs, sd):
        if run.mode == "onpolicy":
            return onpolicy_batch(engine, retriever, qs, run, encode, w, sd)
        if run.mode == "branch":
            return branch_batch(engine, retriever, qs, run, encode, w, sd)
        return teacher_prefix_batch(engine, retriever, qs, run, encode, w, sd, store)
    rows, stats, samples = batch(questions, seed)
    if not run.dynamic_sampling:
        return rows, stats, samples
    kept, done = [], []  # done: (round, question id) of the questions trained
    for rnd in range(DYNAMIC_TRIES):
        if rnd:
            extra = random.Random(seed + rnd).sample(pool, len(questions))
            rows, more, drawn = batch(extra, seed + 15485863 * rnd)
            samples += drawn
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
    return kept, stats, samples

def step_budget(tok, s, kind):
    """(new tokens, stop strings) of a step of `kind` under settings s, the budgets evaluation gives
    it, so a step is judged as it will be scored; an action is written where a route is, under a
    route's budget."""
    if kind in ("route", *reward.ACTIONS):
        stop, n = rollout.route_stop(tok, s)
        return n, stop
    return s.answer_tokens, ["</answer>"]

def overlong_group(tok, group, budget, stop, mode):
    """--overlong on completions [(ids, logprobs)] of one step (grpo.overlong): each one's reward
    added, whether it is trained, and whether the engine cut it at the budget."""
    cut = [grpo.was_cut(tok, ids, budget, stop) for ids, _ in group]
    shaped = [grpo.overlong(len(ids), budget, c, mode) for (ids, _), c in zip(group, cut)]
    return [a for a, _ in shaped], [k for _, k in shaped], cut

def overlong_spans(tok, x, r, o, run, stats):
    """--overlong on on-policy trajectory x with span rewards r and outcome o: a span the engine cut
    at its budget leaves the mask, or its reward (the outcome's with --reward outcome) gets the soft
    penalty. Returns r, o."""
    r = list(r)
    for j, sp in enumerate(x.spans):
        ids = x.ids[sp["start"]:sp["end"]]
        budget, stop = step_budget(tok, run.steps, sp["kind"])
        (add,), (keep,), cut = overlong_group(tok, [(ids, None)], budget, stop, run.overlong)
        stats["cut"] += [float(c) for c in cut]
        if run.reward == "outcome":
            o += add
        else:
            r[j] += add
        if not keep:
            x.mask[sp["start"]:sp["end"]] = [0] * (sp["end"] - sp["start"])
    return r, o
