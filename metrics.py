"""
metrics.py: the numbers a method's trajectories get (score: F1-Recall, EM, F1, Acc, answer length,
routing accuracy and its confusion matrices, gold-document hits, the failure a question's points are
lost to) and the paired bootstrap of two methods on the same questions (question-level and
two-level: seeds, then questions). Each metric's definition is in metrics() and decisions().
evaluate.py runs the methods; report.py draws the tables and charts.

    from metrics import score, paired
    s = score(trajs)                          # one score dict a method (results.json's rows)
    p = paired([(sft_trajs, grpo_trajs)])     # NEW - BASE: diff, 95% interval, p_not_above,
                                                per metric

    .venv/bin/python -m pytest tests/test_evaluate.py -q
"""
import math
from collections import Counter, defaultdict

import reward
from dataio import KBS  # ("text", "table", "image")
from report import FAILURES, type_order

STOP, MISSING = "stop", "missing"
GOLD_LABELS = [*KBS, STOP]
PRED_LABELS = [*KBS, STOP, MISSING]
ANSWER_METRICS = {"f1_recall": reward.f1_recall, "em": reward.exact_match, "f1": reward.f1,
                  "acc": reward.acc}

# --------------------------------------------------------------------------------------------------
# one method's scores


def first_samples(trajs):
    """One trajectory per question, the one with the lowest sample index; question order is kept."""
    best = {}
    for x in trajs:
        if x["qid"] not in best or x.get("sample", 0) < best[x["qid"]].get("sample", 0):
            best[x["qid"]] = x
    return list(best.values())


def stopped(x):
    return bool(x["format_ok"]) and x["final_answer"] is not None


def answer_scores(x):
    """The four answer metrics of one trajectory in [0, 1]; a format failure scores 0."""
    if not x["format_ok"]:
        return dict.fromkeys(ANSWER_METRICS, 0.0)
    return {k: fn(x["final_answer"] or "", x["answers"]) for k, fn in ANSWER_METRICS.items()}


def answer_words(x):
    """Words (split at whitespace) of a trajectory's final answer as written; a format failure's
    answer counts as ""."""
    return len((x["final_answer"] or "").split()) if x["format_ok"] else 0


def decisions(x):
    """Aligned (gold, predicted) routing decisions for t = 0..max(G, P); gold is None past the gold
    stop.

    Routing accuracy. A trajectory makes a sequence of routing decisions: the KB of each retrieval
    step, then the stop. It stopped when format_ok is True and it has a final answer (it wrote
    <ret>None</ret> and answered; a final answer forced by rollout.py after --max_steps retrievals
    counts as a stop too). With
    G = len(gold_steps) and P = len(steps):
      - for each t < max(G, P), step t is correct when gold_steps[t] and steps[t] both exist and
        have the same kb;
      - the stop is one more correct decision when the model stopped and P == G;
      - routing_acc = correct decisions / (max(G, P) + 1).
    So a no-retrieval question answered without retrieving scores 1, one that retrieves once 0/2;
    gold text>table answered with text>text then stop scores 2/3, with text then stop 1/3, with
    text>table then a format failure 2/3. Confusion matrix: one entry per gold decision t = 0..G.
    The gold label is gold_steps[t].kb, or "stop" at t = G; the predicted label is steps[t].kb for
    t < P, "stop" at t = P when the model stopped, else "missing" (a format failure, or the
    trajectory had already ended). Retrievals after the gold stop (t > G) have no gold decision, so
    they are not in the matrix (routing_acc and retrievals count them).
    Without gold steps the gold route is "stop at once": right for no-retrieval questions,
    meaningless for data/real's r1_* splits (released without decompositions, pattern "unknown"),
    where only the answer metrics count.
    """
    gold = [s["kb"] for s in x.get("gold_steps") or []]
    pred = [s["kb"] for s in x["steps"]]
    pairs = []
    for i in range(max(len(gold), len(pred)) + 1):
        g = gold[i] if i < len(gold) else STOP if i == len(gold) else None
        p = pred[i] if i < len(pred) else STOP if i == len(pred) and stopped(x) else MISSING
        pairs.append((g, p))
    return pairs


def routing_accuracy(x):
    pairs = decisions(x)
    return sum(g == p for g, p in pairs) / len(pairs)


def gold_hits(x):
    """One bool per gold step: its gold document is among the documents retrieved at the same
    position. A gold step with no sub-question (HotpotQA's supporting paragraphs: no decomposition,
    so no order) counts at any position."""
    steps = x["steps"]
    anywhere = {d for s in steps for d in s["retrieved"]}
    return [s["doc_id"] in anywhere if not s.get("sub_question")
            else i < len(steps) and s["doc_id"] in steps[i]["retrieved"]
            for i, s in enumerate(x.get("gold_steps") or [])]


def failure(x):
    """Where a question's answer went wrong: the first failure in trajectory order, None when its
    F1-Recall is 1.
      format       the trajectory has format_ok False (a malformed step, or cut off)
      route        decisions(x) disagree at some t, and every earlier step was right (a wrong KB, an
                   early or late stop)
      retrieval    step t has the gold KB but not the gold document (gold_hits)
      step_answer  step t retrieved the gold document but its intermediate answer does not recall
                   the gold one (a misread, or a sub-question that asked something else: a skipped
                   hop often lands here)
      final        every step right, the final answer wrong (a comparison, or a no-retrieval
                   question answered wrong)
    Needs a decomposition: a question without gold steps that is not of type "none" (data/real's
    r1_* splits), or with a gold step without a sub-question (HotpotQA's supporting paragraphs), is
    "unattributed"."""
    if answer_scores(x)["f1_recall"] >= 1:
        return None
    if not x["format_ok"]:
        return "format"
    gold = x.get("gold_steps") or []
    if (not gold and x.get("type") != "none") or not all(s.get("sub_question") for s in gold):
        return "unattributed"
    hits = gold_hits(x)
    for t, (g, p) in enumerate(decisions(x)):
        if g != p:
            return "route"
        if t < len(gold):
            if not hits[t]:
                return "retrieval"
            if reward.f1_recall(x["steps"][t]["answer"] or "", [gold[t]["answer"]]) < 1:
                return "step_answer"
    return "final"


def confusion(trajs, step=None):
    """Gold x predicted decision counts over GOLD_LABELS x PRED_LABELS; step t: routing step t's
    decisions only."""
    counts = [[0] * len(PRED_LABELS) for _ in GOLD_LABELS]
    for x in trajs:
        for t, (g, p) in enumerate(decisions(x)):
            if g in GOLD_LABELS and p in PRED_LABELS and step in (None, t):
                counts[GOLD_LABELS.index(g)][PRED_LABELS.index(p)] += 1
    return {"rows": list(GOLD_LABELS), "cols": list(PRED_LABELS), "counts": counts}


def balanced_accuracy(conf):
    """% decided right per gold label, averaged over the gold labels that occur (None if none
    does)."""
    rows = [(row[i], sum(row)) for i, row in enumerate(conf["counts"]) if sum(row)]
    return 100 * mean(right / total for right, total in rows) if rows else None


def route_information(conf):
    """How much the choice depends on what the question needs: I(gold; chosen) / H(gold), in %, from
    a confusion matrix. 0: the chosen KB is independent of the gold one (a router that ignores the
    question, whatever its accuracy); 100: the gold KB can be read off the choice. None when the
    gold label never varies."""
    n = sum(map(sum, conf["counts"]))
    if not n:
        return None
    pg = [sum(row) / n for row in conf["counts"]]
    pp = [sum(col) / n for col in zip(*conf["counts"])]
    h_gold = -sum(p * math.log(p) for p in pg if p)
    mi = sum(c / n * math.log(c / n / (pg[i] * pp[j])) for i, row in enumerate(conf["counts"])
             for j, c in enumerate(row) if c)
    return 100 * mi / h_gold if h_gold > 0 else None


def mean(xs):
    xs = [float(x) for x in xs]
    return sum(xs) / len(xs) if xs else None


def metrics(trajs):
    """Scalar metrics of a non-empty list of trajectories (one per question).

    Metrics of score(trajs), for one method. With several samples per question only the lowest
    sample index (sample 0) counts. All rates are percentages (x100), as the paper reports
    F1-Recall:
      f1_recall, em, f1, acc  R1-Router's F1-Recall and the HotpotQA EM / F1 / Acc of reward.py, max
                              over gold + aliases. A trajectory with format_ok False scores 0 on all
                              four (its final answer counts as "").
      answer_words            mean length of the final answer in words (split at whitespace, as
                              written: not normalised; a format failure's counts as 0): F1-Recall
                              rewards recall, so a longer answer can raise it where EM and F1 fall
      format_fail             % of trajectories with format_ok False
      overflow                % of trajectories cut off because their next step did not fit the
                              engine's context (every span they wrote parsed; no final answer, so
                              the answer metrics are 0)
      retrievals              retrieval calls per question, len(steps) (one per sub-question and KB)
                              and those of the steps a backtrack popped; retrievals_by_kb: the
                              steps' split by KB
      backtracks, summaries   actions per question (a policy with actions, rollout.StepLoop.act);
                              absent without them; routing is scored on the steps that stayed
      steps                   routing steps that searched, per question (= retrievals with one
                              lookup a step; fewer with multi-query steps, --max_pairs: what the
                              policy waits for in sequence)
      reask                   % of questions with a retrieval step whose sub-question repeats an
                              earlier step's (reward.re_asks: case and outer spaces ignored), e.g. a
                              1-hop question asked twice
      routing_acc             routing accuracy (below), averaged over questions
      routing_macro           balanced routing accuracy: the mean over gold decisions (text, table,
                              image, stop; those that occur) of the % of them decided right, from
                              the confusion matrix (below). routing_acc weighs the classes by
                              frequency (text and stop are ~75% of the mini-world's decisions); this
                              counts each class once, which is what --balance_kb in stepgrpo.py
                              optimises
      routing_macro0          balanced routing accuracy of the first routing decision alone
      route_info0             at the first routing decision, I(gold KB; chosen KB) / H(gold KB) in
                              %: whether the choice depends on what the question needs (0: it does
                              not, however accurate; route_information)
      route_exact             % of questions with routing accuracy 1: the KB sequence equals the
                              gold one and the model stopped right after it
      gold_hit                % of gold steps t whose gold doc_id is in steps[t].retrieved
                              (positions aligned, so a comparison whose two lookups come in swapped
                              order misses both); None without gold steps. A gold step with an empty
                              sub_question (data/real's HotpotQA: supporting paragraphs with no
                              order) counts when any step retrieved its doc_id
      policy_tokens           mean n_policy_tokens; time_generate, time_retrieve: mean seconds per
                              question (amortised over the batch; the method's wall clock is
                              `seconds` in results.json, seconds/q the table's)
      lost                    {cause: F1-Recall points lost to it}, one cause a question
                              (failure(x)): the points sum with f1_recall to 100, so they say which
                              ceiling a gain can come from
      judge, judge_em_agree   with evaluate.py --judge: the mean LLM-judge score of the final
                              answers (judge.py: ragas' AnswerAccuracy, 0 / 0.5 / 1 a question, a
                              format failure 0), and the % of questions where the judge
                              (score >= 0.5) and EM agree, both over the judge_n questions the judge
                              rated (no rating parsed: left out); absent without a judge
      confusion               routing confusion matrix (below), counts
      by_type                 the metrics above (without confusion) per question type
    """
    n = len(trajs)
    answers = [answer_scores(x) for x in trajs]
    racc = [routing_accuracy(x) for x in trajs]
    hits = [h for x in trajs for h in gold_hits(x)]
    by_kb = Counter(s["kb"] for x in trajs for s in x["steps"])
    m = {"n": n}
    m.update({k: 100 * mean(a[k] for a in answers) for k in ANSWER_METRICS})
    m["answer_words"] = mean(map(answer_words, trajs))
    m["format_fail"] = 100 * mean(not x["format_ok"] for x in trajs)
    m["overflow"] = 100 * mean(bool(x.get("overflow")) for x in trajs)
    m["routing_acc"] = 100 * mean(racc)
    m["routing_macro"] = balanced_accuracy(confusion(trajs))
    # the first decision: where the question alone must tell the KB
    first = confusion(trajs, step=0)
    m["routing_macro0"], m["route_info0"] = balanced_accuracy(first), route_information(first)
    m["route_exact"] = 100 * mean(r == 1 for r in racc)
    m["gold_hit"] = 100 * mean(hits) if hits else None
    m["retrievals"] = mean(len(x["steps"]) + sum(len(a.get("popped", []))
                                                 for a in x.get("actions", [])) for x in trajs)
    if any(x.get("actions") for x in trajs):
        for kind in reward.ACTIONS:
            m[{"backtrack": "backtracks", "summary": "summaries"}[kind]] = mean(
                sum(a["kind"] == kind for a in x.get("actions", [])) for x in trajs)
    m["steps"] = mean(len(reward.by_step(x["steps"])) for x in trajs)
    m["retrievals_by_kb"] = {kb: by_kb[kb] / n for kb in KBS}
    m["reask"] = 100 * mean(any(reward.re_asks(s["sub_question"], x["steps"][:i])
                                for i, s in enumerate(x["steps"]))
                            for x in trajs)
    lost = Counter()
    for x, a in zip(trajs, answers):
        lost[failure(x)] += 100 * (1 - a["f1_recall"]) / n
    m["lost"] = {k: lost[k] for k in FAILURES if k in lost}
    judged = [(x["judge"], a["em"]) for x, a in zip(trajs, answers) if x.get("judge") is not None]
    if judged:
        m["judge"], m["judge_n"] = 100 * mean(j for j, _ in judged), len(judged)
        m["judge_em_agree"] = 100 * mean((j >= 0.5) == (em == 1) for j, em in judged)
    m["policy_tokens"] = mean(x.get("n_policy_tokens", 0) for x in trajs)
    for k in ("generate", "retrieve"):
        m[f"time_{k}"] = mean((x.get("timings") or {}).get(k, 0.0) for x in trajs)
    return m


def score(trajs):
    """Score one method's trajectories: metrics() over all questions, plus the confusion matrix and
    by_type."""
    trajs = first_samples(trajs)
    if not trajs:
        raise ValueError("score: no trajectories to score")
    out = metrics(trajs)
    out["confusion"] = confusion(trajs)
    depth = max(len(decisions(x)) for x in trajs)
    out["confusion_by_step"] = [confusion(trajs, step=t) for t in range(depth)]
    groups = defaultdict(list)
    for x in trajs:
        groups[x.get("type") or "unknown"].append(x)
    out["by_type"] = {ty: metrics(groups[ty]) for ty in type_order(groups)}
    return out

# --------------------------------------------------------------------------------------------------
# two methods on the same questions: the paired bootstrap

PAIRED = ("f1_recall", "em", "f1", "answer_words", "routing_acc", "steps", "retrievals")

def paired_values(x):
    """The PAIRED metrics of one trajectory (its answer scored once: F1-Recall is the slow one)."""
    a = answer_scores(x)
    return {"f1_recall": 100 * a["f1_recall"], "em": 100 * a["em"], "f1": 100 * a["f1"],
            "answer_words": answer_words(x), "routing_acc": 100 * routing_accuracy(x),
            "steps": len(reward.by_step(x["steps"])), "retrievals": len(x["steps"])}

def two_level(d, n_boot, seed):
    """Two-level bootstrap of d [metrics, pairs, Q] (new - base per metric, pair and
    question) -> [metrics, n_boot]. Each resample draws the pairs (training seeds) with replacement,
    then for each drawn pair, independently, its questions with replacement; its mean is the mean
    over the drawn pairs of the mean over their drawn questions. Both arms of a pair stay paired by
    question, and one resample serves every metric. With one pair it is the question-level bootstrap
    (in distribution: its own draws)."""
    import numpy as np
    # not the question-level stream: its figures stay as they were
    rng = np.random.default_rng([seed, 2])
    n_metrics, n_pairs, n_q = d.shape
    drawn = rng.integers(0, n_pairs, size=(n_boot, n_pairs))  # [n_boot, pairs]
    total = np.zeros((n_metrics, n_boot))
    # one drawn pair at a time: n_boot x Q indices in memory, not n_boot x pairs x Q
    for k in range(n_pairs):
        within = rng.integers(0, n_q, size=(n_boot, n_q))
        for m in range(n_metrics):
            total[m] += d[m][drawn[:, k, None], within].mean(1)
    return total / n_pairs

def paired(pairs, n_boot=10000, seed=0):
    """Paired bootstrap of new - base. pairs: [(base, new), ...], each two methods' trajectories of
    the same questions (by qid), one pair per training seed. For each PAIRED metric (f1_recall, em,
    f1 and routing_acc x100; answer words, routing steps and retrieval calls a question): a
    question's difference is new - base averaged over the pairs; the mean of it, the 2.5 and 97.5
    percentiles of that mean over n_boot resamples of the questions (the question-level 95%
    interval; one resample serves every seed, so seeds stay paired by question, and the spread
    between seeds is not in it), the fraction of resamples where new is not above base, and each
    pair's own mean difference (per_pair); two_level: the same interval and fraction from
    two_level(), which resamples the seeds, then the questions within each; the same per question
    type in by_type."""
    import numpy as np
    sets = [[{x["qid"]: x for x in first_samples(trajs)} for trajs in pair] for pair in pairs]
    qids = sorted(sets[0][0])
    types = defaultdict(list)
    for q in qids:
        types[sets[0][0][q].get("type") or "unknown"].append(q)
    for i, (a, b) in enumerate(sets):
        for side in (a, b):
            if side.keys() != set(qids):
                raise ValueError(f"paired: pair {i + 1}'s trajectories hold other questions than "
                                 f"pair 1's base ({len(side.keys() ^ set(qids))} unmatched)")
    values = [[{q: paired_values(x) for q, x in side.items()} for side in pair] for pair in sets]
    interval = lambda boots: {"lo": float(np.percentile(boots, 2.5)),
                              "hi": float(np.percentile(boots, 97.5)),
                              "p_not_above": float((boots <= 0).mean())}

    def boot(qs):
        # [n_boot, Q]
        idx = np.random.default_rng(seed).integers(0, len(qs), size=(n_boot, len(qs)))
        d = np.array([[[b[q][k] - a[q][k] for q in qs] for a, b in values] for k in PAIRED],
                     dtype=np.float64)  # [metrics, pairs, Q]
        out = {"n": len(qs)}
        for key, dk, two in zip(PAIRED, d, two_level(d, n_boot, seed)):
            out[key] = {"diff": float(dk.mean()), **interval(dk.mean(0)[idx].mean(1)),
                        "per_pair": [float(x) for x in dk.mean(1)], "two_level": interval(two)}
        return out

    return dict(boot(qids), by_type={ty: boot(types[ty]) for ty in type_order(types)})
