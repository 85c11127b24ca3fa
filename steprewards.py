"""
steprewards.py: Step-GRPO's rewards on its rollouts. Every policy step is scored by step_reward, the
one function a new per-step reward replaces (teacher-prefix groups and on-policy trajectories both
call it; reward.py holds the formulas it uses).

    step_reward    one step against its target: a route, an intermediate answer or a final answer
    kb_credit      the part of a route's step_reward its KB choice earned (--route_credit split)
    kb_factor      --balance_kb's factor on a step's advantages: a route's class weight, else 1
    kb_balance     --balance_kb's weight N / (C n_c) of each gold route class c in the training set
    span_rewards   an on-policy trajectory's span step_rewards and outcome (--rollout onpolicy)
    log_trajectory what an on-policy trajectory adds to a step's logged means
    Score          a sampled step's scoring: its reward, and what the rollout's metrics are made of
    score_group    the Scores of one step's completions at a prefix (--rollout teacher_prefix)
    log_group      what a group's Scores add to a step's logged means (teacher_prefix, branch)
    branch_reward  a branch: its outcome plus its branched step's reward (--rollout branch)
    score_branches the Scores of a group of branches at one of the policy's own prefixes
    judge_rag      each finished trajectory's judged RAG term, added to its outcome (--w_rag)

A step's target is the prefix trajectory's own step (R1-Router: the teacher's sub-question, KB and
intermediate answer; golden prefixes: the gold's) or, on-policy and in branches, the gold
decomposition's step of the same index; the final answer is scored against the gold answers.
"""
from collections import Counter
from dataclasses import dataclass, replace

import numpy as np

import reward
from grpo import choice_entropy

@dataclass
class Weights:
    format: float = 0.2
    hit: float = 0.0
    route_scale: dict | None = None  # --balance_kb: gold route -> factor on route advantages
                                     # (kb_balance)
    rag: tuple = (0.0, 0.0)  # --w_rag: the judged relevance's and groundedness's weights on the
                             # outcome (judge_rag)
    judge: object = None     # their judge.Judge (None: no judged term)

def kb_factor(w, kind, gold):
    """--balance_kb's factor on the advantages of a step of `kind` judged against the gold route
    class `gold` (kb_balance): a routing step's class weight, 1 for any other step or without
    balancing."""
    return w.route_scale.get(gold, 1.0) if w.route_scale and kind == "route" else 1.0

def step_reward(kind, step, target, w, encode, retrieved=None):
    """The reward of one policy step; 0 for a step that does not parse (step.ok False).
      "route"   step: reward.Route; target: the gold steps of its routing step ([]: the target
                stops here).
                w.format + 0.5 cos(E(sub-question), E(target's)) + 0.5 [KB = target's KB]
                (reward.score_route: R1-Router's route reward, several pairs matched to the
                target's steps) + w.hit x the share of the target's documents among `retrieved`
                (the doc ids its search returned; None: not searched)
      "answer"  step: reward.Answer; target: the gold steps whose answer it gives ([]: none, the
                format term alone).
                w.format + reward.answer_reward(answer, [their answers joined]) (F1-Recall,
                all-or-nothing unless the gold is one answer of more than 5 words)
      "final"   step: reward.Answer; target: the question's gold answers ([]: the format term
                alone, on-policy, where the outcome scores the final answer).
                w.format + reward.answer_reward(answer, target)
      "backtrack"  step: the routing step it popped, as a reward.Route; target: the gold steps of
                that step ([]: the gold stops there).
                w.format + [the popped step's KBs are not the target's]: popping a wrong route
                earns 1, popping a right one nothing
      "summary" step: reward.Answer holding the summary; target: the steps it replaced (with their
                intermediate answers).
                w.format + F1-Recall of their answers joined in the summary: the share of the
                facts found so far that it keeps
    encode(list[str]) -> [n, d] embeddings (retrievers.Encoder.encode); w: Weights (format, hit)."""
    if not step.ok:
        return 0.0
    if kind == "backtrack":
        mine = sorted(kb for _, kbs in step.pairs for kb in kbs)
        return w.format + float(mine != sorted(g["kb"] for g in target))
    if kind == "summary":
        facts = "; ".join(dict.fromkeys(g["answer"] for g in target if g.get("answer")))
        return w.format + (reward.f1_recall(step.answer, [facts]) if facts else 0.0)
    if kind == "route":
        r = reward.score_route(step, target, encode, w.format)
        if retrieved is not None and target and not step.stop:
            r += w.hit * float(np.mean([reward.retrieval_hit_reward(retrieved, g["doc_id"])
                                        for g in target]))
        return r
    golds = target if kind == "final" else [reward.group_answer(target)] if target else []
    return w.format + (reward.answer_reward(step.answer, golds) if golds else 0.0)

def kb_credit(step, target, w, encode, r):
    """--route_credit split: the part of route step's reward r (step_reward's) that its KB choice
    earned, r minus the step_reward of the same step with every KB it names blanked (kb "", which no
    target has; a stop becomes the sub-question "none" searching ""). So the split follows whatever
    step_reward is: for R1-Router's it is exactly 0.5 [KB = target's] (for several pairs, their KB
    terms), for a reward of the KB alone all of r, for one of the wording alone 0. A step that does
    not parse earned nothing."""
    if not step.ok:
        return 0.0
    pairs = [("none", ("",))] if step.stop else [(q, ("",) * len(kbs)) for q, kbs in step.pairs]
    blank = replace(step, stop=False, kb="", sub_question=pairs[0][0], pairs=pairs)
    return r - step_reward("route", blank, target, w, encode)

def gold_route(gold_steps, t):
    """The class of routing step t of grouped gold steps (reward.group_steps): its (first) KB, or
    "stop"."""
    groups = reward.by_step(gold_steps)
    return groups[t][0]["kb"] if t < len(groups) else "stop"

def route_kbs(steps, t):
    """The KBs routing step t of (predicted or grouped gold) steps searched, sorted, or ("stop",)
    past the last."""
    groups = reward.by_step(steps)
    return tuple(sorted(st["kb"] for st in groups[t])) if t < len(groups) else ("stop",)

def kb_balance(questions, max_steps, max_pairs=1):
    """--balance_kb: factor N / (C n_c) for each gold route c over the N route steps of the training
    questions (C classes, n_c steps of class c), so text, table, image and stop steps weigh the same
    in total (a class-balanced loss). A question with k gold routing steps has route steps
    0..min(k, max_steps - 1), the stop at k."""
    golds = [reward.group_steps(q["steps"], max_pairs) for q in questions]
    n = Counter(gold_route(g, t) for g in golds
                for t in range(min(len(reward.by_step(g)) + 1, max_steps)))
    return {c: sum(n.values()) / (len(n) * k) for c, k in n.items()}

def as_route(lookups):
    """The lookups of one routing step ([]: the stop) as the reward.Route the parser read."""
    pairs = reward.pairs_of(lookups)
    return reward.Route(ok=True, stop=not pairs, pairs=pairs,
                        sub_question=pairs[0][0] if pairs else "None",
                        kb=pairs[0][1][0] if pairs else None)

def span_rewards(x, encode, w):
    """onpolicy: the step_reward of every policy span of trajectory x (in x["spans"] order) against
    the gold decomposition's step there (past the gold steps the gold is the stop), and its outcome
    R = f1_recall(final, golds) + x["rag"] (judge_rag's judged term, with --w_rag), 0 if any step
    failed to parse. A span that fails to parse ends its trajectory and gets 0. A trajectory whose
    next step did not fit the context (overflow) keeps the rewards of the spans it wrote and has no
    final answer (R = 0). Actions (rollout.StepLoop.act): a backtrack is scored on the step it
    popped against the gold step there, a summary on the steps it replaced; a popped route and its
    answer are scored as they were written, on the lookups they made."""
    gold, pred, out = reward.by_step(x["gold_steps"]), reward.by_step(x["steps"]), []
    acts = {a["span"]: a for a in x.get("actions", [])}
    popped = {k: a["popped"] for a in acts.values() if a["kind"] == "backtrack"
              for k in a["popped_spans"]}
    for j, sp in enumerate(x["spans"]):
        if not x["format_ok"] and j == len(x["spans"]) - 1:  # the span that failed to parse
            out.append(0.0)
            continue
        t = sp["step"]
        g = gold[t] if t < len(gold) else []
        # [] after a route span: the stop
        mine = popped[j] if j in popped else pred[t] if t < len(pred) else []
        if j in acts and acts[j]["kind"] == "backtrack":
            gt = acts[j]["popped"][0]["step"]  # the popped step, against the gold's step there
            out.append(step_reward("backtrack", as_route(acts[j]["popped"]),
                                   gold[gt] if gt < len(gold) else [], w, encode))
        elif j in acts:
            out.append(step_reward("summary", reward.Answer(ok=True, answer=acts[j]["note"]),
                                   acts[j]["facts"], w, encode))
        elif sp["kind"] == "route":
            out.append(step_reward("route", as_route(mine), g, w, encode,
                                   {d for st in mine for d in st["retrieved"]} if mine else None))
        else:
            answer = mine[0]["answer"] if sp["kind"] == "answer" else x["final_answer"]
            out.append(step_reward(sp["kind"], reward.Answer(ok=True, answer=answer or ""),
                                   g if sp["kind"] == "answer" else [], w, encode))
    return out, (reward.f1_recall(x["final_answer"] or "", x["answers"]) + x.get("rag", 0.0)
                 if x["format_ok"] else 0.0)

def judge_rag(w, trajs):
    """--w_rag: Agentic RAG-R1's judged RAG reward, x["rag"] of each finished trajectory x, added to
    its outcome (span_rewards): w.rag[0] x ContextRelevance(question, x's evidence)
    + w.rag[1] x ResponseGroundedness(final answer, x's evidence), judge.py's ragas prompts rated
    by w.judge (cached). Agentic RAG-R1's rag_reward is the first alone, weight 2.0, beside its
    judged correctness (3.0) and format; the second is the answer's support in the evidence.
    The evidence is every document the trajectory read, in order, a backtrack's popped ones too,
    as Agentic RAG-R1's rag_reward reads every observation in its completion's text.
    A rating the judge did not give counts 0; a trajectory that failed to parse gets 0, as its
    outcome. Returns the terms, one a trajectory."""
    done = [x for x in trajs if x["format_ok"] and x["final_answer"] is not None]
    rel = (w.judge.relevance([(x["question"], x["evidence"]) for x in done]) if w.rag[0]
           else [0.0] * len(done))
    grd = (w.judge.groundedness([(x["final_answer"], x["evidence"]) for x in done]) if w.rag[1]
           else [0.0] * len(done))
    for x in trajs:
        x["rag"] = 0.0
    for x, a, b in zip(done, rel, grd):
        x["rag"] = w.rag[0] * (a or 0.0) + w.rag[1] * (b or 0.0)
    return [x["rag"] for x in trajs]

def log_trajectory(stats, x, r, outcome):
    """Append on-policy trajectory x's logged numbers to stats (lists by name): its route and answer
    rewards r (in spans order), the outcome, KB accuracy a routing step, format, overflow, searches,
    re-asks, policy tokens."""
    stats["route_r"] += [v for sp, v in zip(x["spans"], r) if sp["kind"] == "route"]
    stats["answer_r"] += [v for sp, v in zip(x["spans"], r) if sp["kind"] == "answer"]
    stats["outcome"].append(outcome)
    # a format failure has >= 1 span
    failed_route = not x["format_ok"] and x["spans"][-1]["kind"] == "route"
    n_routes = sum(sp["kind"] == "route" and not sp.get("popped")
                   for sp in x["spans"]) - failed_route
    stats["kb_acc"] += [float(route_kbs(x["steps"], t) == route_kbs(x["gold_steps"], t))
                        for t in range(n_routes)]
    stats["format_ok"].append(float(x["format_ok"]))
    stats["overflow"].append(float(x["overflow"]))
    stats["retrievals"].append(len(x["steps"]))
    stats["reask"] += [float(reward.re_asks(q, [e for e in x["steps"] if e["step"] < g[0]["step"]]))
                       for g in reward.by_step(x["steps"]) for q, _ in reward.pairs_of(g)]
    stats["tokens"].append(x["n_policy_tokens"])
    stats["actions"].append(float(len(x.get("actions", []))))

@dataclass
class Score:
    """One sampled step's scoring (score_group, score_branches): the reward its advantage is of, and
    what the rollout's metrics are made of (log_group)."""
    reward: float                   # teacher_prefix: the step's reward;
                                    # branch: outcome + step reward
    step: float                     # the step's own step_reward
    parsed: bool = True             # the step parsed
    kb_part: float = 0.0            # a route: the part of `step` its KB choice earned (kb_credit)
    kbs: tuple | None = None        # a route: the KBs it chose or ("stop",);
                                    # None where it did not parse
    kb_right: bool = False          # a route that parsed: kbs are those of the step it is judged
                                    # against
    reasks: tuple = ()              # a route: per sub-question, whether it asks one asked before
                                    # (0/1)
    outcome: float | None = None    # branch: the continuation's outcome R

def score_group(kind, x, sp, texts, s, encode, w):
    """The Score of each of one group's completions `texts` of span sp of prefix trajectory x
    (step_reward against the prefix trajectory's own step: R1-Router's teacher's, for golden
    prefixes the gold's; the final answer against the gold answers), and the class of the route it
    is judged against (--balance_kb). kind: route or answer. A route's Score holds its KB choice and
    the part of its reward the KB earned (kb_credit, --route_credit split).
    s: rollout.Settings (the step format)."""
    t = sp["step"]
    steps = reward.by_step(x["steps"])
    target = steps[t] if t < len(steps) else []  # []: the prefix trajectory stops here
    out = []
    for text in texts:
        if kind == "route":
            # an action: the format term alone
            p = reward.parse_route(text, s.max_pairs, s.max_rets, s.actions)
            kbs = (("stop",) if p.stop
                   else tuple(sorted(kb for _, k in p.pairs for kb in k))) if p.ok else None
            r = step_reward("route", p, target, w, encode)
            kb_part = kb_credit(p, target, w, encode, r)
            asked = [e for e in x["steps"] if e["step"] < t]
            reasks = tuple(float(reward.re_asks(q, asked)) for q, _ in p.pairs)
            out.append(Score(r, r, p.ok, kb_part, kbs, kbs == route_kbs(x["steps"], t), reasks))
        else:
            p = reward.parse_answer(text)
            r = step_reward(sp["kind"], p, x["answers"] if sp["kind"] == "final" else target,
                            w, encode)
            out.append(Score(r, r, p.ok))
    return out, gold_route(x["steps"], t)

def log_group(stats, kind, scores, cut, tokens, branches=()):
    """Append one group's logged numbers to stats (lists by name) from its Scores: the steps'
    rewards (route_r, answer_r; a teacher-prefix final answer's: outcome), a route's KB accuracy and
    re-asks, each step's format, the steps cut at their budget (cut) and their tokens, the spread of
    a route group's KB choices (kb_entropy, kb_mixed); for a group of branches (branches.branch
    trajectories) each one's outcome, format, overflow and searches instead of the step's format.
    kind: the sampled span's."""
    for sc in scores:
        if kind == "route":
            stats["kb_acc"] += [float(sc.kb_right)] if sc.parsed else []
            stats["reask"] += list(sc.reasks)
        if kind in ("route", "answer"):
            stats[f"{kind}_r"].append(sc.step)
        elif kind == "final" and not branches:  # a final answer's step reward is its outcome
            stats["outcome"].append(sc.step)
        if not branches:
            stats["format_ok"].append(float(sc.parsed))
    for y, sc in zip(branches, scores):
        for k, v in (("outcome", sc.outcome), ("format_ok", y["format_ok"]),
                     ("overflow", y["overflow"]), ("retrievals", len(y["steps"]))):
            stats[k].append(float(v))
    stats["tokens"] += list(tokens)
    stats["cut"] += [float(c) for c in cut]
    if kind == "route":  # the decision as a distribution: how spread the group's KB choices are
        choices = [sc.kbs for sc in scores]
        stats["kb_entropy"].append(choice_entropy(choices))
        stats["kb_mixed"].append(float(len(set(choices)) > 1))

def branch_reward(x, encode, w, mode="step"):
    """--rollout branch: the reward of branch trajectory x (branches.branch; span x["branch"]
    sampled anew, the rest of the trajectory continued by the policy): its outcome R plus, with mode
    "step", the branched span's step reward, both as span_rewards scores them (step t against the
    gold's step t, past the gold's steps the stop; a final answer's is the format term alone, R
    scores it). mode "outcome": R alone. Returns (reward, step reward, R)."""
    r, outcome = span_rewards(x, encode, w)
    step_r = r[x["branch"]]
    return outcome + (step_r if mode == "step" else 0.0), step_r, outcome

def score_branches(group, encode, w, mode):
    """The Score of each branch of a group at one prefix (branches.branch: the same span sampled
    anew, each continued to the end; branch_reward), and the class of the gold route of a branched
    routing step (--balance_kb; None for another kind). A branched step that fails to parse ends its
    trajectory."""
    sp = group[0]["spans"][group[0]["branch"]]
    t, out = sp["step"], []
    for y in group:
        r, step_r, outcome = branch_reward(y, encode, w, mode)
        parsed = y["format_ok"] or y["branch"] < len(y["spans"]) - 1
        kbs = route_kbs(y["steps"], t) if sp["kind"] == "route" and parsed else None
        earlier = [e for e in y["steps"] if e["step"] < t]
        asked = (reward.pairs_of([e for e in y["steps"] if e["step"] == t]) if sp["kind"] == "route"
                 else [])
        out.append(Score(r, step_r, parsed, kbs=kbs, kb_right=kbs == route_kbs(y["gold_steps"], t),
                         reasks=tuple(float(reward.re_asks(q, earlier)) for q, _ in asked),
                         outcome=outcome))
    return out, gold_route(group[0]["gold_steps"], t) if sp["kind"] == "route" else None
