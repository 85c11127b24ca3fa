"""
report.py: evaluate.py's report (results.json, table.md, PNG charts) and the side-by-side view of
one question's trajectories beside its gold steps. Imports nothing of evaluate.py: it reads score
dicts and trajectory rows.

    python report.py --show out/demo/eval/sft/trajectories-routed.jsonl \
        out/demo/eval/stepgrpo/trajectories-routed.jsonl \
        --data data/mini                        # the first question whose gold steps use the most
                                                  KBs (--qid: another; --answered right: of those
                                                  the last file answered right through the gold KBs)
    python report.py --stages out/demo/stages.log   # where the main job's minutes went

    from metrics import score
    from report import write_report
    md = write_report({"sft/routed": score(trajs)}, "out/eval/x", title="mini-world dev")

Outline: display orders -> tables -> charts -> write_report -> learning curves -> the trajectory
view -> the stages' minutes.
"""
import argparse
import io
import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import dataio
import reward
from clock import PHASES
from dataio import KBS  # ("text", "table", "image")

TYPES = ("none", "1hop", "2hop", "3hop", "comparison", "visual")  # display order; other types
                                                                   # follow, sorted
# metrics.failure's, in order
FAILURES = ("format", "route", "retrieval", "step_answer", "final", "unattributed")


def type_order(types):
    return [ty for ty in TYPES if ty in types] + sorted(ty for ty in types if ty not in TYPES)


def _fmt(x, digits=1):
    return "-" if x is None else f"{x:.{digits}f}"


def _table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(map(str, r)) + " |" for r in rows]


def markdown(results, title):
    """The report as markdown: main table, routing details, F1-Recall and answer words per question
    type."""
    main = _table(["method", "n", "F1-Recall", "EM", "F1", "Acc", "answer words", "routing acc",
                   "steps/q", "retrievals/q", "s/q", "format fail %", "overflow %"],
                  [[m, s["n"], *(_fmt(s[k]) for k in ("f1_recall", "em", "f1", "acc")),
                    _fmt(s.get("answer_words"), 2),
                    _fmt(s["routing_acc"]), _fmt(s.get("steps"), 2),
                    _fmt(s["retrievals"], 2),
                    _fmt(s["seconds"] / s["n"] if "seconds" in s else None, 3),
                    _fmt(s["format_fail"]), _fmt(s.get("overflow"))] for m, s in results.items()])
    # .get: --combine may read a results.json written before answer_words, routing_macro and reask
    # existed
    routing = _table(["method", "routing macro", "macro, step 1", "info, step 1", "route exact %",
                      "gold-doc hit %", *(f"{kb}/q" for kb in KBS), "re-ask %", "policy tokens/q"],
                     [[m, _fmt(s.get("routing_macro")), _fmt(s.get("routing_macro0")),
                       _fmt(s.get("route_info0")), _fmt(s["route_exact"]), _fmt(s["gold_hit"]),
                       *(_fmt(s["retrievals_by_kb"][kb], 2) for kb in KBS), _fmt(s.get("reask")),
                       _fmt(s["policy_tokens"], 0)]
                      for m, s in results.items()])
    # only rows with "lost": --combine may read older results.json
    lost = _table(["method", *FAILURES],
                  [[m, *(_fmt(s["lost"].get(k, 0.0)) for k in FAILURES)] for m, s in results.items()
                   if "lost" in s])
    # evaluate.py --judge's rows only
    judged = _table(["method", "LLM judge", "EM", "judge = EM %", "rated"],
                    [[m, _fmt(s["judge"]), _fmt(s["em"]), _fmt(s["judge_em_agree"]),
                      f"{s['judge_n']} of {s['n']}"]
                     for m, s in results.items()
                     if s.get("judge") is not None])
    judge = ["## LLM judge (ragas' AnswerAccuracy of the final answer; its agreement with EM)", "",
             *judged, ""] \
        if len(judged) > 2 else []
    # a policy with --actions only
    acted = _table(["method", "backtracks/q", "summaries/q", "retrievals/q"],
                   [[m, _fmt(s["backtracks"], 2), _fmt(s["summaries"], 2), _fmt(s["retrievals"], 2)]
                    for m, s in results.items() if "backtracks" in s])
    actions = ["## Actions (backtrack, summary: Agentic RAG-R1's; routing is scored on the steps "
               "that stayed)", "", *acted, ""] if len(acted) > 2 else []
    types = type_order({ty for s in results.values() for ty in s["by_type"]})
    by_type = lambda k, digits: _table(["method", *types],
                                       [[m, *(_fmt(s["by_type"][ty].get(k), digits)
                                              if ty in s["by_type"] else "-" for ty in types)]
                                        for m, s in results.items()])
    # evaluate.py --backend openai / chat: which mode scored each row (chat is not token-exact)
    served = [f"- {m}: {s['engine']}" for m, s in results.items() if s.get("engine")]
    served = ["Scored through a server:", "", *served, ""] if served else []
    return "\n".join([f"# {title}", "",
                      "All rates in %; answer metrics count a format failure as 0; answer words: "
                      "the mean length of the final answer in words (a format failure's: 0).", "",
                      *served, *main, "",
                      "## Routing", "", *routing, "",
                      *judge, *actions,
                      "## Where F1-Recall is lost (points, the first failure of each question)", "",
                      *lost, "",
                      "## F1-Recall by question type", "", *by_type("f1_recall", 1), "",
                      "## Answer words by question type", "", *by_type("answer_words", 2), ""])


def seed_table(results):
    """Rows named '<row>@s<seed>/<method>' (one training seed each) -> markdown of mean +- sample
    std over seeds."""
    groups = defaultdict(list)
    for name, s in results.items():
        groups[re.sub(r"@s\d+", "", name)].append(s)
    rows = []
    for name, ss in groups.items():
        cells = []
        for k, digits in (("f1_recall", 1), ("em", 1), ("f1", 1), ("answer_words", 2),
                          ("routing_acc", 1), ("steps", 2), ("retrievals", 2), ("s/q", 3)):
            v = [x["seconds"] / x["n"] if k == "s/q" else x.get(k) for x in ss
                 if k != "s/q" or "seconds" in x]
            v = [y for y in v if y is not None]
            sd = f" ± {_fmt(statistics.stdev(v), digits)}" if len(v) > 1 else ""
            cells.append(_fmt(statistics.mean(v), digits) + sd if v else "-")
        rows.append([name, len(ss), *cells])
    return _table(["row", "seeds", "F1-Recall", "EM", "F1", "answer words", "routing acc",
                   "steps/q", "retrievals/q", "s/q"], rows)


def _png(fig, tight=True):
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight" if tight else None)
    return buf.getvalue()


def _figure(figsize):
    # Agg, no pyplot state: safe in any process
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=figsize, dpi=120)
    FigureCanvasAgg(fig)
    return fig, fig.subplots()


CHART_METRICS = [("f1_recall", "F1-Recall"), ("em", "EM"), ("routing_acc", "routing acc")]


def metrics_chart(results, title):
    """Grouped bars: one group per method, one bar per metric of CHART_METRICS, value on each
    bar."""
    import numpy as np
    methods = list(results)
    fig, ax = _figure((max(6.0, 1.9 * len(methods) + 2), 4.8))
    x, width = np.arange(len(methods)), 0.8 / len(CHART_METRICS)
    for i, (key, label) in enumerate(CHART_METRICS):
        bars = ax.bar(x + (i - (len(CHART_METRICS) - 1) / 2) * width,
                      [results[m][key] or 0 for m in methods], width, label=label)
        ax.bar_label(bars, fmt="%.1f", padding=2, fontsize=8)
    long_names = max(map(len, methods)) > 12
    ax.set_xticks(x, methods, rotation=20 if long_names else 0,
                  ha="right" if long_names else "center")
    ax.set_ylim(0, 112)
    ax.set_ylabel("score (%)")
    ax.set_xlabel("method")
    ax.set_title(f"{title}: answer quality and routing")
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), title="metric")
    return _png(fig)


def confusion_chart(conf, method, title):
    """Heatmap of the routing confusion matrix: colour = share of the gold row, text = count and
    share."""
    import numpy as np
    counts = np.array(conf["counts"], dtype=float)
    totals = counts.sum(axis=1, keepdims=True)
    share = np.divide(counts, totals, out=np.zeros_like(counts), where=totals > 0)
    fig, ax = _figure((7.5, 5.2))
    im = ax.imshow(share, cmap="Blues", vmin=0, vmax=1)
    for i, j in np.ndindex(counts.shape):
        ax.text(j, i, f"{int(counts[i, j])}\n{100 * share[i, j]:.0f}%", ha="center", va="center",
                fontsize=9, color="white" if share[i, j] > 0.55 else "black")
    ax.set_xticks(range(len(conf["cols"])), conf["cols"])
    ax.set_yticks(range(len(conf["rows"])),
                  [f"{r} (n={int(t)})" for r, t in zip(conf["rows"], totals[:, 0])])
    ax.set_xlabel("predicted decision  (missing = format failure or trajectory already ended)")
    ax.set_ylabel("gold decision")
    ax.set_title(f"{title}\nrouting confusion: {method}  (count, % of gold row)")
    fig.colorbar(im, ax=ax, label="share of gold row")
    return _png(fig)


def slug(name):
    return re.sub(r"[^\w.-]+", "_", name).strip("_") or "method"


def write_report(results, out_dir, title="R1-Router evaluation"):
    """Write results.json, table.md, metrics.png and routing_confusion_<method>.png (for each method
    that made at least one retrieval) into out_dir, each atomically; return the markdown."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    md = markdown(results, title)
    if any(re.search(r"@s\d+", name) for name in results):  # training seeds: mean +- std first
        md = "\n".join([f"# {title}: mean ± std over training seeds", "", *seed_table(results), "",
                        md])
    dataio.write_atomic(out / "results.json", json.dumps(results, indent=2, allow_nan=False) + "\n")
    dataio.write_atomic(out / "table.md", md)
    dataio.write_atomic(out / "metrics.png", metrics_chart(results, title))
    for method, s in results.items():
        if s["retrievals"] > 0:
            dataio.write_atomic(out / f"routing_confusion_{slug(method)}.png",
                                confusion_chart(s["confusion"], method, title))
    return md


# the learning curves of a training log (stepgrpo.py's log.jsonl: a record a step, dev scores at
# step 0 too): a fixed set of panels, each (title, its keys, the y label), a line a key; a panel
# none of whose keys the log holds a number for is left out (kl without --kl_coef; the critic's,
# which a PPO trainer logs)
CURVE_PANELS = [("rewards", ("route_r", "answer_r", "outcome"), "mean reward"),
                ("KB choice", ("kb_acc", "kb_entropy", "kb_mixed"), ""),
                ("entropy", ("entropy",), "nats / token"),
                ("clip fraction", ("clip_frac",), "share of tokens"),
                ("KL to reference (k3)", ("kl",), "per token"),
                ("dev (greedy; dev_score picks best)",
                 ("dev_score", "dev_f1_recall", "dev_routing_acc"), "%"),
                ("seconds a step",
                 ("rollout_s", "update_s", "critic_s", "sync_s", "retrieve_s", "dev_s"), "s"),
                ("critic", ("value_loss", "explained_var"), "")]
CURVE_LABELS = dict(kb_acc="kb_acc (= gold's)", kb_entropy="kb_entropy (bits, in a group)",
                    # a legend's line: its key, what it counts
                    kb_mixed="kb_mixed (groups of mixed choices)")


def paired_text(p, pairs, keys):
    """evaluate.py --paired's printout of metrics.paired's result p: NEW - BASE for each metric in
    keys, overall and per question type, with the question-level and two-level (seeds, then
    questions) intervals; pairs: 'NEW - BASE'."""
    lines = [f"{'; '.join(pairs)}, {p['n']} questions (paired bootstrap, 10000 resamples"
             f"{f', averaged over {len(pairs)} pairs' if len(pairs) > 1 else ''}):",
             "  question-level: resamples the questions, each question's difference averaged over "
             "the pairs (not the spread between seeds)\n  two-level: resamples the pairs (seeds), "
             "then the questions within each drawn pair"
             + (" (one pair: the question-level interval, in distribution)" if len(pairs) == 1
                else "")]
    for k in keys:
        each = (f"; per pair {', '.join(f'{x:+.2f}' for x in p[k]['per_pair'])}" if len(pairs) > 1
                else "")
        two = p[k]["two_level"]
        lines.append(f"  {k}: {p[k]['diff']:+.2f} (question-level 95% interval "
                     f"{p[k]['lo']:+.2f} .. {p[k]['hi']:+.2f}; "
                     f"not above base in {100 * p[k]['p_not_above']:.1f}% of resamples{each})\n"
                     f"      two-level 95% interval {two['lo']:+.2f} .. {two['hi']:+.2f}; "
                     f"not above base in {100 * two['p_not_above']:.1f}% of resamples")
    lines.append("  per question type: difference (question-level interval | two-level interval)")
    for ty, q in p["by_type"].items():
        lines.append(f"  {ty} ({q['n']}): " + ", ".join(
            f"{k} {q[k]['diff']:+.2f} ({q[k]['lo']:+.2f} .. {q[k]['hi']:+.2f} | "
            f"{q[k]['two_level']['lo']:+.2f} .. {q[k]['two_level']['hi']:+.2f})" for k in keys))
    return "\n".join(lines)


def curve_panels(recs):
    """[(title, y label, [(key, [(step, value)])])]: CURVE_PANELS' panels that have a number in
    recs, each with the keys that do, a point at each step whose record holds one (dev scores: only
    the steps that were scored)."""
    panels = []
    for title, keys, ylabel in CURVE_PANELS:
        lines = [(k, [(r["step"], r[k]) for r in recs if isinstance(r.get(k), (int, float))
                      and not isinstance(r.get(k), bool)]) for k in keys]
        lines = [(k, pts) for k, pts in lines if pts]
        if lines:
            panels.append((title, ylabel, lines))
    return panels


def curves_chart(log_path, title, cols=3):
    """PNG bytes: one panel per curve_panels of the JSONL log at log_path, a line a key, against
    whole-number steps."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator
    panels = curve_panels([json.loads(l) for l in open(log_path)])
    rows = max(1, -(-len(panels) // cols))
    height = 3.3 * rows + 0.6  # inches: the panels, and a band for the title
    fig = Figure(figsize=(14, height), dpi=90)
    FigureCanvasAgg(fig)
    # laid out by hand: tight_layout and a tight bounding box each lay out every panel's ticks once
    # more
    fig.subplots_adjust(left=0.05, right=0.99, bottom=0.5 / height, top=1 - 1.0 / height,
                        wspace=0.2, hspace=0.55)
    axes = fig.subplots(rows, cols, squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    for ax, (name, ylabel, lines) in zip(axes.flat, panels):
        for key, pts in lines:
            ax.plot(*zip(*pts), marker="o", ms=3, label=CURVE_LABELS.get(key, key))
        if len(lines) > 1:
            ax.legend(fontsize=7, loc="best")
        ax.set_title(name)
        ax.set_xlabel("step")
        if ylabel:
            ax.set_ylabel(ylabel, fontsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        # 0.0014: 1.4 x 10^-3
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 4), useMathText=True)
        ax.grid(alpha=0.3)
    fig.suptitle(f"{title} ({log_path})", y=1 - 0.3 / height)
    return _png(fig, tight=False)


# --------------------------------------------------------------------------------------------------
# the trajectory view


def answered_as(x):
    """"right": the final answer's F1-Recall is 1 and each step searched its gold step's KB;
    "wrong": F1-Recall below 1; else "lucky" (right through other KBs)."""
    if reward.f1_recall(x["final_answer"] or "", x["answers"]) < 1:
        return "wrong"
    gold = [g["kb"] for g in x.get("gold_steps") or []]
    return "right" if [s["kb"] for s in x["steps"]] == gold else "lucky"


def pick_question(trajs, qid=None, answered=None):
    """qid, or the first question whose gold steps search the most KBs (routing decisions to
    see); answered "right" or "wrong": of those trajs answered so (answered_as)."""
    if qid is None:
        pool = [x for x in trajs if answered in (None, answered_as(x))]
        if not pool:
            raise ValueError(f"no question is answered {answered}")
        return max(pool, key=lambda x: len({g["kb"] for g in x.get("gold_steps") or []}))["qid"]
    if qid not in {x["qid"] for x in trajs}:
        raise ValueError(f"question {qid!r} is not in the trajectories")
    return qid


def step_lines(steps, titles, gold=None):
    """One line per lookup: its sub-question, KB (x where it is not the gold step's), evidence
    titles, answer."""
    lines = []
    for t, st in enumerate(steps):
        g = gold[t] if gold is not None and t < len(gold) else None
        mark = "" if gold is None else (" ok" if g and g["kb"] == st["kb"] else " x")
        found = st.get("retrieved", [st.get("doc_id")])
        lines.append(f"  {t + 1}. [{st['kb']}{mark}] {st['sub_question']}\n"
                     f"       evidence: {'; '.join(titles.get(d, d) for d in found if d)}\n"
                     f"       answer: {st['answer']}")
    return lines


def show(paths, data, qid=None, answered=None):
    """The question's gold steps, then each file's trajectory for it: the routed steps and the final
    answer; answered: pick_question's, judged on the last file; then the line that asks it."""
    try:
        files = [{x["qid"]: x for x in dataio.read_jsonl(p)} for p in paths]
        qid = pick_question(list(files[-1].values()), qid, answered)
        titles = {d["id"]: d["title"] for kb in KBS for d in dataio.load_kb(data, kb)}
        xs = [f[qid] for f in files]
    except KeyError as e:
        sys.exit(f"error: --show: question {e} is missing from one of {', '.join(map(str, paths))}")
    except (dataio.DataError, OSError, ValueError) as e:
        sys.exit(f"error: --show: {e}")
    x0 = xs[0]
    out = [f"question {qid} ({x0['type']}): {x0['question']}   gold answer: "
           f"{' | '.join(x0['answers'])}",
           "gold steps:", *step_lines(x0["gold_steps"], titles)]
    for p, x in zip(paths, xs):
        f1r = reward.f1_recall(x["final_answer"] or "", x["answers"])
        out += [f"{p}:", *step_lines(x["steps"], titles, x["gold_steps"]),
                f"  final answer: {x['final_answer']}   (F1-Recall {100 * f1r:.0f}"
                f"{'' if x['format_ok'] else ', ' + x['error']})"]
    out.append(f"ask it yourself: python serve.py ask {json.dumps(x0['question'])}")
    return "\n".join(out)


def stage_minutes(stages_log):
    """The main job's stages (runs/stage.sh's log: "NAME SECONDS" a line), each stage's seconds by
    clock.py phase (times.jsonl beside the log, the scripts' CLOCK.done lines; a stage of several
    processes sums them) and its largest process's peak resident memory, as a markdown table, and
    the phases' share of the whole."""
    took = dict(line.split() for line in Path(stages_log).read_text().splitlines()[1:])
    times = Path(stages_log).with_name("times.jsonl")
    by, peak = defaultdict(lambda: defaultdict(float)), {}
    for rec in dataio.read_jsonl(times) if times.is_file() else []:
        for k in rec.keys() & set(PHASES):
            by[rec["stage"]][k] += rec[k]
        if "peak_gib" in rec:
            peak[rec["stage"]] = max(peak.get(rec["stage"], 0.0), rec["peak_gib"])
    rows, sums = [], defaultdict(float)
    for name, sec in took.items():
        phases = by.get(name, {})
        for k in PHASES:
            sums[k] += phases.get(k, 0.0)
        rows.append([name, f"{int(sec) / 60:.1f}",
                     *(f"{phases[k]:.0f}" if k in phases else "" for k in PHASES),
                     f"{peak[name]:.1f}" if name in peak else ""])
    total = sum(int(v) for v in took.values())
    rows.append(["all", f"{total / 60:.1f}", *(f"{sums[k]:.0f}" for k in PHASES),
                 f"{max(peak.values()):.1f}" if peak else ""])
    share = ", ".join(f"{k} {sums[k] / max(total, 1):.0%}" for k in PHASES)
    return "\n".join(_table(["stage", "minutes", *(f"{k} s" for k in PHASES), "peak GiB"], rows) +
                     [f"(the phases by the scripts' own clock, clock.py: {share}; peak GiB: the "
                      "stage's largest process's peak resident memory)"])

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--show", nargs="+", metavar="TRAJECTORIES",
                    help="evaluate.py's trajectories-*.jsonl")
    ap.add_argument("--stages", metavar="LOG", help="runs/stage.sh's log: the stages' minutes")
    ap.add_argument("--data", default="data/mini",
                    help="the world the questions come from (its KB titles)")
    ap.add_argument("--qid", default=None,
                    help="the question (default: the first whose gold steps search the most KBs)")
    ap.add_argument("--answered", choices=["right", "wrong"],
                    help="pick a question the last file answered right (F1-Recall 1, the gold "
                         "steps' KBs) or wrong")
    args = ap.parse_args()
    if bool(args.show) == bool(args.stages):
        ap.error("give one of --show and --stages")
    print(show(args.show, args.data, args.qid, args.answered) if args.show
          else stage_minutes(args.stages))
