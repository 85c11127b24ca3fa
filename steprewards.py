"""
steprewards.py: Step-GRPO's rewards on its rollouts, every policy step scored (reward.py holds the formulas).

    span_rewards   an on-policy trajectory: each span's reward and the outcome (--rollout onpolicy)
    score_group    a group of completions of one step at a prefix trajectory (--rollout teacher_prefix)
    label_search   what each sampled search of those groups retrieves (--step_reward labels, labels_kb)
    kb_balance     the class-balancing factor on route advantages (--balance_kb)

Two targets for a step: the prefix trajectory's own step or the gold's (--step_reward teacher, R1-Router's: the
teacher's sub-question, KB and intermediate answer), or what multi-hop datasets label (labels: the supporting
documents a search retrieves, the hop answers). The final answer is scored against the gold answers either way.
"""
from collections import Counter
from dataclasses import dataclass

import numpy as np

import reward

@dataclass
class Weights:
    format: float = 0.2
    hit: float = 0.0
    route_scale: dict | None = None  # --balance_kb: gold route -> factor on route advantages (kb_balance)

def gold_route(gold_steps, t):
    """The class of routing step t of grouped gold steps (reward.group_steps): its (first) KB, or "stop"."""
    groups = reward.by_step(gold_steps)
    return groups[t][0]["kb"] if t < len(groups) else "stop"

def route_kbs(steps, t):
    """The KBs routing step t of (predicted or grouped gold) steps searched, sorted, or ("stop",) past the last."""
    groups = reward.by_step(steps)
    return tuple(sorted(st["kb"] for st in groups[t])) if t < len(groups) else ("stop",)

def kb_balance(questions, max_steps, max_pairs=1):
    """--balance_kb: factor N / (C n_c) for each gold route c over the N route steps of the training questions (C
    classes, n_c steps of class c), so text, table, image and stop steps weigh the same in total (a class-balanced
    loss). A question with k gold routing steps has route steps 0..min(k, max_steps - 1), the stop at k."""
    golds = [reward.group_steps(q["steps"], max_pairs) for q in questions]
    n = Counter(gold_route(g, t) for g in golds for t in range(min(len(reward.by_step(g)) + 1, max_steps)))
    return {c: sum(n.values()) / (len(n) * k) for c, k in n.items()}

def span_rewards(x, encode, w, step_reward="teacher"):
    """onpolicy: the reward of every policy span of trajectory x (in x["spans"] order) and its outcome R.
      route step t   reward.score_route (w_format [parses] + 0.5 cos(sub-question, gold's) + 0.5 [KB = gold KB], its
                     pairs matched to the gold steps of step t) + w_hit * the share of those gold docs retrieved at
                     step t; past the gold steps the gold is "stop" (sub-question None, no KB)
                     labels: w_format + reward.label_route_reward (a search that retrieves a supporting document the
                     trajectory had not found before, a stop once all are found; labels_kb: half of it for naming
                     the KB of a hop not found yet)
      answer step t  w_format + answer_reward(answer, [gold intermediate answer(s), reward.group_answer])
                     labels: against reward.label_answer_golds (the hops whose documents step t newly found; none:
                     w_format alone)
      final answer   w_format
      outcome R      f1_recall(final, golds); 0 if any step failed to parse
    A span that fails to parse ends its trajectory and gets reward 0. A trajectory whose next step did not fit the
    context (overflow) keeps the rewards of the spans it wrote and has no final answer (R = 0)."""
    gold, pred, out = reward.by_step(x["gold_steps"]), reward.by_step(x["steps"]), []
    labels = step_reward != "teacher"
    for j, sp in enumerate(x["spans"]):
        if not x["format_ok"] and j == len(x["spans"]) - 1:  # the span that failed to parse
            out.append(0.0)
            continue
        t, r = sp["step"], w.format
        g = gold[t] if t < len(gold) else []
        took = t < len(pred)  # a route span past the searches was the stop
        found = found_before(x, t)
        new = found_before(x, t + 1) - found
        if sp["kind"] == "route" and labels:
            r += reward.label_route_reward(not took, new, x["gold_steps"], found,
                                           [st["kb"] for st in pred[t]] if took and step_reward == "labels_kb" else None)
        elif sp["kind"] == "route":
            r = reward.score_route(reward.Route(ok=True, stop=not took, pairs=reward.pairs_of(pred[t]) if took else []),
                                   g, encode, w.format)
            if g and took:
                hit = {d for st in pred[t] for d in st["retrieved"]}
                r += w.hit * float(np.mean([reward.retrieval_hit_reward(hit, gs["doc_id"]) for gs in g]))
        elif sp["kind"] == "answer":
            golds = reward.label_answer_golds(new, x["gold_steps"], found) if labels else [reward.group_answer(g)] * bool(g)
            r += reward.answer_reward(pred[t][0]["answer"] or "", golds) if golds else 0.0
        out.append(r)
    return out, (reward.f1_recall(x["final_answer"] or "", x["answers"]) if x["format_ok"] else 0.0)

def found_before(x, t):
    """The doc ids trajectory x retrieved at its routing steps before step t."""
    return {d for st in x["steps"] if st["step"] < t for d in st["retrieved"]}

def label_search(retriever, todo, parsed, args):
    """--step_reward labels: the evidence each sampled search would get, one batched search per KB: [per group: [per
    sample: set of doc ids]] (empty for a stop or a malformed route). A visual question's image goes with the first
    image-KB search of a trajectory, as in the step loop."""
    hits = [[set() for _ in group] for group in parsed]
    for kb in ("text", "table", "image"):
        asks = [(k, i, q, x["image"] if kb == "image" and not any(st["kb"] == "image" for st in x["steps"]
                                                                   if st["step"] < sp["step"]) else None)
                for k, ((x, sp, _, _), group) in enumerate(zip(todo, parsed)) for i, p in enumerate(group)
                if p.ok and not p.stop for q, kbs in p.pairs if kb in kbs]
        if asks:
            images = [im for *_, im in asks]
            docs = retriever.search([q for _, _, q, _ in asks], kb, args.topk, **({"images": images} if any(images) else {}))
            for (k, i, _, _), ds in zip(asks, docs):
                hits[k][i] |= {d["id"] for d in ds}
    return hits

def score_group(kind, x, sp, texts, hits, args, encode, w, stats):
    """The rewards of one group's completions `texts` of span sp of prefix trajectory x, and (routing steps) each
    one's KB choice and the KB half of its reward (route_credit split), and the class of the route it is judged
    against (--balance_kb). --step_reward teacher: against the prefix trajectory's own step (R1-Router: the
    teacher's; for gold prefixes the gold's); labels: reward.label_* against the gold hops, given what the prefix
    found before this step; the final answer against the gold answers either way."""
    t, labels = sp["step"], args.step_reward != "teacher"
    mine = reward.by_step(x["steps"])
    target = mine[t] if t < len(mine) else []  # []: the prefix trajectory stops here
    found = found_before(x, t)
    right = ({g["kb"] for g in reward.open_hops(x["gold_steps"], found)} or {"stop"}) if labels else None
    cls = reward.next_hop_kb(x["gold_steps"], found) if labels else gold_route(x["steps"], t)
    rs, choices, kb_part = [], [], []
    for i, text in enumerate(texts):
        if kind == "route":
            p = reward.parse_route(text, args.max_pairs, args.max_rets)
            kbs = (("stop",) if p.stop else tuple(sorted(kb for _, k in p.pairs for kb in k))) if p.ok else None
            ok_kb = bool(set(kbs) & right) if labels and p.ok else kbs == route_kbs(x["steps"], t)
            named = kbs if args.step_reward == "labels_kb" else None  # a stop or a malformed route: unused
            r = (w.format + reward.label_route_reward(p.stop, hits[i], x["gold_steps"], found, named)) * p.ok if labels \
                else reward.score_route(p, target, encode, w.format)
            stats["route_r"].append(r)
            choices.append(kbs)
            kb_part.append(0.5 * float(ok_kb))  # route_reward's KB half (route_credit split, teacher rewards)
            if p.ok:
                stats["kb_acc"].append(float(ok_kb))
            stats["reask"] += [float(reward.re_asks(q, [e for e in x["steps"] if e["step"] < t])) for q, _ in p.pairs]
        else:
            p = reward.parse_answer(text)
            golds = x["answers"] if sp["kind"] == "final" else \
                reward.label_answer_golds(found_before(x, t + 1) - found, x["gold_steps"], found) if labels \
                else [reward.group_answer(target)]
            r = w.format * p.ok + (reward.answer_reward(p.answer, golds) if p.ok and golds else 0.0)
            stats["answer_r" if sp["kind"] == "answer" else "outcome"].append(r)
        stats["format_ok"].append(float(p.ok))
        rs.append(r)
    return rs, choices, kb_part, cls
