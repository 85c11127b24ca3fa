"""
evaluate.py: score R1-Router trajectories and write the report (results.json, table.md, PNG charts).

    python evaluate.py --model models/SmolLM2-135M-Instruct --data data/mini --split test     # all methods below
    python evaluate.py --methods routed oracle --n_questions 100 --backend hf --out out/eval/quick
    python evaluate.py --model out/sft/final --methods --probe 8 --n_questions 100    # the route probe alone
    python evaluate.py --model out/sft/final out/grpo/final --out out/eval/sft out/eval/grpo  # one engine for both
    python evaluate.py --paired out/eval/sft-test/trajectories-routed.jsonl out/eval/grpo-test/trajectories-routed.jsonl
    python evaluate.py --paired s1/sft/trajectories-routed.jsonl s1/grpo/trajectories-routed.jsonl \
        s2/sft/trajectories-routed.jsonl s2/grpo/trajectories-routed.jsonl    # a pair per seed: two-level intervals too
    python evaluate.py ... --structure released --protocol released   # R1-Router's released step structure and evaluation
    python evaluate.py --model out/sft-k2/final --methods routed --max_pairs 2   # multi-query steps (RAG-R1)
    python evaluate.py --model models/Qwen2.5-7B-Instruct --backend openai --base_url http://localhost:8000/v1 \
        --methods routed iterretgen --few_shot 3 --protocol fallback      # a model a vLLM or SGLang server serves

Methods (each on the same retrievers and model): routed (the model routes: R1-Router), no_retrieval, single_rag
(the question searches every KB once; all evidence in one prompt), iterretgen (IterRetGen, Shao et al. 2023: a fixed
pipeline, --iters rounds of searching every KB with the question plus the previous round's generation, then
answering; no step format), ircot (IRCoT, Trivedi et al. 2023: one chain-of-thought sentence, one retrieval of
every KB with it as the query, in turn, at most --max_steps retrievals after the question's; the sentence that says
"answer is" answers), every_kb (the step format, but every sub-question searches every KB: routing removed),
oracle (the model's sub-questions, the gold KB at each gold step: the routing ceiling), gold_steps (the gold
trajectory, its intermediate answers included; the model writes only the final answer: the ceiling of the steps).
--few_shot K starts the step-format methods' prompts with K worked gold trajectories of the train split (prompting
baselines; the rows are named method+Kshot).
--protocol: strict (default: greedy, one try a step, a malformed step is a format failure and scores 0), fallback
(one try, then a malformed route stops and a malformed answer counts as its raw text: what lets a prompted model
that cannot always write the step format be scored), released (R1-Router's released evaluation, answer_generation.py:
temperature 1, top-k 20, top-5 passages, 5 tries a route with its reminder after the third, 3 tries an answer, then
the fallbacks). Rows of the step-format methods are named method+fallback / method+released.

Several --model folders (checkpoints of one policy: the same config and tokenizer) are scored in one process: one
engine, each later model's weights swapped in as Step-GRPO's sync does (engine starts dominate small evaluations), each
to its own report folder (--out: one a model), as if scored alone.

Resumable: each finished method leaves method-<method>.json beside its trajectories; a rerun into the same --out
with the same model weights, questions and flags reuses it, so an interrupted evaluation (or one given one more
method) runs only what is missing.

--probe N: routing as a distribution (route_probe below): N routes sampled at every golden prefix, counted against
the gold decision there; written to route_probe.json and routing_confusion_probe.png.

Trajectories come from rollout.py (one dict per question sample:
qid, sample, question, answers, type, gold_steps, steps [{sub_question, kb, retrieved, answer, step}] (one per lookup;
step: the routing step it was asked in), final_answer,
format_ok, error, n_policy_tokens, timings, ...); metrics.py scores them (score, paired: each metric's definition is
there). Use it from Python:

    from metrics import score
    from report import write_report
    results = {"r1-router": score(trajs), "direct": score(direct_trajs)}   # one score dict per method
    md = write_report(results, "out/eval_dev", title="mini-world dev")   # results.json, table.md, *.png (report.py)
    print(md)

    .venv/bin/python -m pytest tests/test_evaluate.py -q                  # the tests (~2 s)

Outline: a training run's dev evaluation -> the methods and the route probe -> main. The report's tables and
charts: report.py.
"""
import json
import math
import re
import sys
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import dataio
import metrics
import prepare
import report
import reward
from dataio import KBS  # ("text", "table", "image")
from metrics import GOLD_LABELS, MISSING, PRED_LABELS, STOP
from report import write_report

# ----------------------------------------------------------------------------------------------------------------
# dev evaluation during training

def dev_scores(engine, retriever, qs, settings, rank, world):
    """A training run's dev evaluation (stepgrpo.py): greedy routed trajectories of qs, each rank its share on its own
    engine, gathered and scored: the numbers `--methods routed --split dev --n_questions N` gives the checkpoint.
    dev_score, which picks <out>/best, is the mean of F1-Recall and routing accuracy. The RNG state is put back
    afterwards, so a run trains the same with or without it."""
    import random

    import torch
    import torch.distributed as dist

    import rollout
    rng = torch.get_rng_state(), random.getstate()
    mine = rollout.rollout(engine, retriever, qs[rank::world], 1, settings, seed=0)
    torch.set_rng_state(rng[0])
    random.setstate(rng[1])
    parts = [None] * world
    dist.all_gather_object(parts, [{k: v for k, v in x.items() if k not in ("ids", "mask", "logprobs")} for x in mine])
    s = metrics.score([x for p in parts for x in p])
    dev = {f"dev_{k}": s[k] for k in ("f1_recall", "routing_acc", "routing_macro", "routing_macro0", "route_info0")}
    return dict(dev, dev_score=(dev["dev_f1_recall"] + dev["dev_routing_acc"]) / 2)


# ----------------------------------------------------------------------------------------------------------------
# Running the methods

METHODS = ("routed", "no_retrieval", "single_rag", "iterretgen", "ircot", "every_kb", "oracle", "gold_steps")
STEP_FORMAT = ("routed", "every_kb", "oracle")  # the methods whose model writes R1-Router's step format

def run_method(method, engine, retriever, questions, settings, seed=0, iters=3, shots=None, bar=None):
    """One method's trajectories. iters: IterRetGen's iterations; shots: few-shot conversation (few_shot_prefix) the
    step-format methods start from; bar: a tqdm bar the step-format methods advance a trajectory at a time."""
    import baselines
    import rollout
    if method in ("no_retrieval", "single_rag", "iterretgen"):
        kbs = () if method == "no_retrieval" else KBS
        return baselines.answer_directly(engine, retriever, questions, kbs, settings, seed, iters if method == "iterretgen" else 1)
    if method == "ircot":
        return baselines.ircot(engine, retriever, questions, KBS, settings, seed)
    if method == "gold_steps":
        return rollout.gold_steps(engine, retriever, questions, settings, seed)
    mode = {"routed": "model", "every_kb": "all", "oracle": "oracle"}[method]
    return rollout.rollout(engine, retriever, questions, 1, replace(settings, route_mode=mode), seed, shots=shots, bar=bar)

def run_name(model):
    """A model's row name: its folder, or for a checkpoint of a run (final, best, latest, step_N) the run's folder,
    with the checkpoint unless it is the final one: out/sft/final -> sft, out/stepgrpo/best -> stepgrpo-best."""
    p = Path(model)
    if p.name in ("final", "best", "latest") or re.fullmatch(r"step_\d+", p.name):
        return p.parent.name + ("" if p.name == "final" else f"-{p.name}")
    return p.name


def run_signature(args, questions, model, name):
    """What a method's scores of one model depend on: every flag but where they go and which methods run, the model's
    row name, its weight files (a retrained model at the same path differs) and the questions. Two runs with equal
    signatures score a method alike, so a finished method's scores are reused (method_done)."""
    model = Path(model).resolve()
    skip = ("out", "methods", "probe", "combine", "paired")
    return {**{k: v for k, v in sorted(vars(args).items()) if k not in skip}, "model": str(model), "name": name,
            "weights": [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in sorted(model.glob("*.safetensors"))],
            "questions": [q["id"] for q in questions]}


def method_done(out, method, signature):
    """The scores {row name: score} of a method that an earlier run with the same signature finished into out
    (method-<method>.json, written after its trajectories), else None: an interrupted evaluation, or one given one
    more method, runs only what is missing."""
    f = Path(out) / f"method-{report.slug(method)}.json"
    try:
        done = json.loads(f.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return done["results"] if isinstance(done, dict) and done.get("signature") == signature else None


def few_shot_examples(questions, k):
    """k questions (of a training split) for few-shot prompts: in order, each one whose gold steps use a KB the
    earlier ones did not, so the examples show every KB they can."""
    chosen, seen = [], set()
    for q in questions:
        kbs = {s["kb"] for s in q["steps"]}
        if len(chosen) < k and kbs - seen and all(s["sub_question"] for s in q["steps"]):
            chosen.append(q)
            seen |= kbs
    return chosen

def route_probe(engine, retriever, questions, settings, n=8, seed=0):
    """Routing as a distribution (--probe): at every golden prefix (the gold trajectory up to one of its routing
    steps, rollout.GoldPolicy through the real loop and retrieval) sample n routes at temperature 1 and count them in
    a gold x sampled matrix over GOLD_LABELS x PRED_LABELS (a malformed route, and with --actions a backtrack or a
    summary, which name no KB, are "missing"). Greedy routing accuracy moves only when a top choice flips; this moves
    with every shift of probability a policy-gradient step makes, and it is what the route reward is the expectation
    of. Returns {"n", "probe_acc" (% of samples = gold),
    "choice_entropy" (bits: the spread of the n choices at a prefix, averaged over prefixes; 0 = always the same),
    "by_gold" (that % per gold label), "confusion"}."""
    import rollout
    _, prefixes = rollout.golden_prefixes(engine.tok, retriever, questions, settings, seed, getattr(engine, "vis", None))
    label = lambda g, t: g[t][0]["kb"] if t < len(g) else STOP  # a multi-query step: its first pair's KB
    points = [(ids, images, label(reward.by_step(x["gold_steps"]), sp["step"]), rollout.turn_key(x, sp))
              for x, sp, ids, images in prefixes if sp["kind"] == "route"]  # (prompt ids, its images, gold label, key)
    stop, max_tokens = rollout.route_stop(engine.tok, settings)
    outs = engine.generate([ids for ids, *_ in points for _ in range(n)], max_tokens, 1.0, 1.0, stop, seed,
                           images=[im for _, im, *_ in points for _ in range(n)], keys=[k for *_, k in points for _ in range(n)])
    counts, spread = [[0] * len(PRED_LABELS) for _ in GOLD_LABELS], [Counter() for _ in points]
    for k, (ids, _) in enumerate(outs):
        r = reward.parse_route(engine.tok.decode(ids, skip_special_tokens=True), settings.max_pairs, settings.max_rets,
                               settings.actions)
        pred = (STOP if r.stop else r.kb) if r.ok and not r.action else MISSING
        counts[GOLD_LABELS.index(points[k // n][2])][PRED_LABELS.index(pred)] += 1
        spread[k // n][pred] += 1
    entropy = [-sum(c / n * math.log2(c / n) for c in sp.values()) for sp in spread]  # bits, per prefix
    rate = lambda rows: 100 * sum(counts[i][PRED_LABELS.index(GOLD_LABELS[i])] for i in rows) / max(1, sum(sum(counts[i]) for i in rows))
    return {"n": n, "probe_acc": rate(range(len(GOLD_LABELS))), "choice_entropy": metrics.mean(entropy),
            "by_gold": {g: rate([i]) if sum(counts[i]) else None for i, g in enumerate(GOLD_LABELS)},
            "confusion": {"rows": list(GOLD_LABELS), "cols": list(PRED_LABELS), "counts": counts}}

def get_args(argv=None):
    import argparse
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", nargs="+", default=[prepare.DEFAULT_MODEL],
                    help="HF causal LM folder(s); several: checkpoints of one policy, scored by one engine")
    ap.add_argument("--name", nargs="+", default=None, help="a model's label in the table (default: run_name)")
    ap.add_argument("--data", default="data/mini")
    ap.add_argument("--split", nargs="+", default=["test"], help="question splits, concatenated (e.g. test visual_test)")
    ap.add_argument("--n_questions", type=int, default=0, help="the first N of each split (0: all)")
    ap.add_argument("--methods", nargs="*", default=list(METHODS), choices=METHODS)
    ap.add_argument("--probe", type=int, default=0, help="route probe: N sampled routes at every golden prefix (0: off)")
    ap.add_argument("--backend", default="vllm", choices=["vllm", "hf", "openai"],
                    help="the engine: in-process vLLM, transformers, or an OpenAI-compatible server (--base_url; the "
                         "--model folder gives the tokenizer and chat format)")
    ap.add_argument("--base_url", default=None, help="--backend openai: the server, e.g. http://localhost:8000/v1")
    ap.add_argument("--api_key", default=None, help="--backend openai: its key, if it wants one")
    ap.add_argument("--retriever", default="dense", help="dense | bm25 | hybrid | http://host:port")
    ap.add_argument("--max_steps", type=int, default=3)
    ap.add_argument("--max_pairs", type=int, default=1, help="sub-questions a routing step may hold (RAG-R1's parallel queries)")
    ap.add_argument("--max_rets", type=int, default=1, help="retrievers a sub-question may name (R1-Router's multi-retriever mode)")
    ap.add_argument("--topk", type=int, default=3)
    ap.add_argument("--actions", action="store_true", help="a routing step may backtrack or summarise (a policy trained on them)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--protocol", default="strict", choices=["strict", "fallback", "released"],
                    help="strict: one try a step, a malformed step is a format failure; fallback: one try, then a "
                         "malformed route stops and a malformed answer is its raw text (prompting baselines); "
                         "released: R1-Router's evaluation (temperature 1, top-k 20, top-5 passages, 5 tries a route "
                         "with a reminder after the third, 3 an answer, then the fallbacks; sets --temperature, --topk)")
    ap.add_argument("--iters", type=int, default=3, help="IterRetGen's retrieve-generate rounds")
    ap.add_argument("--structure", default="transcript", choices=["transcript", "released"],
                    help="transcript: one chat grows with every step; released: each step its own single-turn chat (R1-Router's released code)")
    ap.add_argument("--few_shot", type=int, default=0,
                    help="worked gold trajectories (train split) before each question in the step-format methods")
    ap.add_argument("--max_active", type=int, default=64, help="trajectories in flight (lower it for long evidence: KV cache)")
    ap.add_argument("--max_model_len", type=int, default=None,
                    help="the engine's context (prompt + new tokens): a longer trajectory ends as an overflow "
                         "(default: engines.MAX_LEN, 4096)")
    ap.add_argument("--max_pixels", type=int, default=None,
                    help="VL policy: cap on a picture's pixels (default: the checkpoint's processor's, which sft.py "
                         "and stepgrpo.py save with the cap they trained with; a base Qwen2.5-VL needs it: see "
                         "stepgrpo.py --max_pixels)")
    ap.add_argument("--judge", default=None, metavar="MODEL",
                    help="an LLM judge of the final answers beside EM / F1 / F1-Recall (judge.py: ragas' "
                         "AnswerAccuracy, temperature 0, cached in each report folder's judge.jsonl): a model folder, "
                         "run in-process, or its tokenizer with --judge_url")
    ap.add_argument("--judge_url", default=None, help="--judge's OpenAI-compatible server, e.g. http://host:8000/v1")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", nargs="+", default=None, help="a model's report folder (default out/eval/<name>-<split>)")
    ap.add_argument("--combine", nargs="+", default=None, help="merge these results.json files into one report (--out)")
    ap.add_argument("--paired", nargs="+", default=None, metavar="BASE NEW",
                    help="trajectories-*.jsonl of the same questions, BASE NEW [BASE NEW ...] (one pair per seed): "
                         "paired bootstrap of NEW - BASE, averaged over the pairs: the question-level interval "
                         "and the two-level one (seeds, then questions)")
    return ap.parse_args(argv)


def print_paired(paths):
    """--paired BASE NEW [BASE NEW ...]: the paired bootstrap of NEW - BASE, overall and per question type, with its
    question-level and two-level (seeds, then questions) intervals."""
    if len(paths) % 2:
        sys.exit(f"error: --paired takes BASE NEW pairs: {len(paths)} files given")
    try:
        files = [dataio.read_jsonl(f) for f in paths]
        p = metrics.paired(list(zip(files[::2], files[1::2])))
    except KeyError as e:
        sys.exit(f"error: --paired: a trajectory lacks {e}: give trajectories-*.jsonl written by evaluate.py")
    except (dataio.DataError, OSError, ValueError) as e:
        sys.exit(f"error: --paired: {e}")
    print(report.paired_text(p, [f"{n} - {b}" for b, n in zip(paths[::2], paths[1::2])], metrics.PAIRED))

def combine(paths, out, title):
    """--combine: results.json files merged into one report in out."""
    results = {}
    for f in paths:
        try:
            part = json.loads(Path(f).read_text())
            assert all("f1_recall" in v for v in part.values())
        except (OSError, AttributeError, TypeError, AssertionError, json.JSONDecodeError) as e:
            sys.exit(f"error: {f}: not a results.json written by evaluate.py ({type(e).__name__})")
        results.update(part)
    print(write_report(results, out, title=title))


def settings_of(args):
    """The step loop's settings for args, --protocol applied."""
    import rollout
    settings = rollout.Settings(max_steps=args.max_steps, topk=args.topk, temperature=args.temperature,
                                max_active=args.max_active, structure=args.structure, max_pairs=args.max_pairs,
                                max_rets=args.max_rets, actions=args.actions)
    if args.protocol != "strict":
        settings = replace(settings, fallback=True)
    if args.protocol == "released":
        settings = replace(settings, temperature=1.0, top_k=20, topk=5, route_tries=5, answer_tries=3)
    return settings


def judge_answers(judge, trajs, out):
    """--judge: each trajectory's "judge", the judge's AnswerAccuracy of its final answer against the gold answers (a
    format failure 0, unasked), cached in out/judge.jsonl."""
    judge.use_cache(out / "judge.jsonl")
    asked = [x for x in trajs if x["format_ok"] and x["final_answer"]]
    scores = judge.accuracy([(x["question"], " or ".join(x["answers"]), x["final_answer"]) for x in asked])
    judged = {id(x): s for x, s in zip(asked, scores)}
    for x in trajs:
        x["judge"] = judged.get(id(x), 0.0)

def run_methods(args, engine, ret, qs, settings, shots, model, name, out, judge=None):
    """Each of args.methods on qs -> {row name: score}; a method's trajectories and its method-<method>.json go to
    out as it finishes, and one an earlier run with the same signature finished is reused. judge: --judge's."""
    from tqdm import tqdm
    results, signature, split = {}, run_signature(args, qs, model, name), "+".join(args.split)
    for method in args.methods:
        if done := method_done(out, method, signature):
            results.update(done)
            print(f"{method}: its scores reused from {out}/method-{report.slug(method)}.json (the same model, questions and flags)")
            continue
        t = time.perf_counter()
        bar = tqdm(total=len(qs), desc=f"{name} {method} ({split})", unit="question")
        trajs = run_method(method, engine, ret, qs, settings, args.seed, args.iters, shots, bar)
        bar.update(len(qs) - bar.n)
        bar.close()
        if judge:
            judge_answers(judge, trajs, out)
        label = method + (f"+{args.few_shot}shot" if shots and method in STEP_FORMAT else "") + \
            (f"+{args.protocol}" if args.protocol != "strict" and method in STEP_FORMAT else "")
        row = {f"{name}/{label}": dict(metrics.score(trajs), seconds=round(time.perf_counter() - t, 1))}
        results.update(row)
        dataio.write_jsonl(out / f"trajectories-{method}.jsonl",
                           [{k: v for k, v in x.items() if k not in ("ids", "mask", "logprobs")} for x in trajs])
        dataio.write_atomic(out / f"method-{report.slug(method)}.json",  # after its trajectories: the mark of a finished method
                            json.dumps({"signature": signature, "results": row}, indent=1, allow_nan=False) + "\n")
    return results


POLICY_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "preprocessor_config.json",
                "processor_config.json")

def same_policy(a, b):
    """None when an engine started on model folder a scores folder b once b's weights are swapped in: the same
    config.json (but for the weights' dtype) and tokenizer and processor files; else what differs."""
    def files(m):
        conf = json.loads((Path(m) / "config.json").read_text())
        skip = ("_name_or_path", "transformers_version", "dtype", "torch_dtype")
        return {"config.json": {k: v for k, v in conf.items() if k not in skip},
                **{f: (Path(m) / f).read_bytes() for f in POLICY_FILES if (Path(m) / f).is_file()}}
    fa, fb = files(a), files(b)
    diff = sorted(f for f in fa.keys() | fb.keys() if fa.get(f) != fb.get(f))
    return f"its {', '.join(diff)} differ from {a}'s" if diff else None


def checkpoint_weights(model):
    """A model folder's weights under its transformers class's names (those a weight sync sends), in their saved dtype."""
    import engines
    return engines.auto_model(model).from_pretrained(model, dtype="auto").state_dict()


def check_models(args, names, outs):
    """Exit with one line for a model folder evaluate.py cannot score, or models one engine cannot share."""
    import rollout
    import transcript
    if len(names) != len(args.model) or len(outs) != len(args.model):
        sys.exit(f"error: --name and --out take one value a model: {len(args.model)} models, {len(names)} names, "
                 f"{len(outs)} report folders")
    if args.backend == "openai" and len(args.model) > 1:
        sys.exit("error: --backend openai scores the one model its server serves: give one --model (its tokenizer)")
    if len(set(outs)) < len(outs):
        sys.exit(f"error: --out: two models would share a report folder ({', '.join(map(str, outs))})")
    for model in args.model:
        if not (Path(model) / "config.json").exists():
            why = "LoRA adapters of an unfinished run: evaluate its final or best checkpoint (merged weights)" \
                if (Path(model) / "adapter").is_dir() else "run `python prepare.py` for the default"
            sys.exit(f"error: {model}: not a model folder ({why})")
        if err := transcript.check_format(model, args):
            sys.exit(f"error: {err}")
        if err := same_policy(args.model[0], model):
            sys.exit(f"error: --model {model}: {err}: one engine scores checkpoints of one policy; evaluate it in a "
                     f"run of its own")
    rollout.check_multi_query(args.max_pairs, args.max_rets, args.structure, args.actions)
    if args.few_shot and args.structure == "released":
        sys.exit("error: --few_shot builds worked examples for --structure transcript only")


def main(args):
    """Score args.methods (and the route probe) of each model in args.model with one engine: a model after the first
    has its weights swapped in (engine.sync_weights, as Step-GRPO syncs); each report goes to its own --out."""
    import engines  # here, with the retrievers and the step loop: --paired and --combine need none of them (nor torch)
    import retrievers
    import rollout
    if not args.methods and not args.probe:
        sys.exit("error: nothing to do: give --methods and/or --probe N")
    split = "+".join(args.split)
    names = args.name or [run_name(m) for m in args.model]
    outs = [Path(o) for o in args.out] if args.out else [Path(f"out/eval/{n}-{split}") for n in names]
    check_models(args, names, outs)
    try:
        qs = [q for sp in args.split for q in dataio.load_questions(args.data, sp)[:args.n_questions or None]]
        ret = retrievers.make_retriever(args.retriever, args.data)
    except dataio.DataError as e:
        sys.exit(f"error: {e}")
    settings, shots = settings_of(args), None
    max_len = args.max_model_len or engines.MAX_LEN
    engine = engines.make_engine(args.backend, args.model[0], seed=args.seed, max_model_len=max_len,
                                 max_pixels=args.max_pixels, max_images=settings.max_images, base_url=args.base_url,
                                 api_key=args.api_key)
    judge = None
    if args.judge_url and not args.judge:
        sys.exit("error: --judge_url needs --judge, the judge's model folder (its tokenizer and chat template)")
    if args.judge:
        import judge as judges
        judge = judges.Judge.load(args.judge, args.judge_url, max_model_len=max_len, seed=args.seed)
    if args.few_shot:
        examples = few_shot_examples(dataio.load_questions(args.data, "train"), args.few_shot)
        shots = rollout.few_shot_prefix(engine.tok, ret, examples, settings)
        print(f"--few_shot {args.few_shot}: {len(examples)} train questions as worked examples ({len(shots)} tokens)")
    try:
        for i, (model, name, out) in enumerate(zip(args.model, names, outs)):
            if i:
                engine.sync_weights(checkpoint_weights(model))
            evaluate_model(args, engine, ret, qs, settings, shots, model, name, out, judge)
    finally:  # main called as a function (the tests) leaves no engine behind
        engine.close()
        if judge:
            judge.engine.close()


def evaluate_model(args, engine, ret, qs, settings, shots, model, name, out, judge=None):
    """The engine, holding model's weights, scores args.methods (their answers judged by judge, --judge's) and the
    route probe; the report goes to out."""
    split = "+".join(args.split)
    earlier = json.loads((out / "results.json").read_text()) if (out / "results.json").is_file() else {}
    if earlier and not any(k.startswith(f"{name}/") for k in earlier):
        print(f"note: {out} holds another model's report ({', '.join(earlier)}); it is replaced (--out names another "
              f"folder)")
    results = run_methods(args, engine, ret, qs, settings, shots, model, name, out, judge)
    if args.probe:
        out.mkdir(parents=True, exist_ok=True)
        p = dict(route_probe(engine, ret, qs, settings, args.probe, args.seed), model=model, split=split, questions=len(qs))
        dataio.write_atomic(out / "route_probe.json", json.dumps(p, indent=2) + "\n")
        dataio.write_atomic(out / "routing_confusion_probe.png", report.confusion_chart(p["confusion"], f"route probe ({args.probe} samples a prefix)", name))
        print(f"route probe: {p['probe_acc']:.1f}% of sampled routes take the gold KB, choice entropy "
              f"{p['choice_entropy']:.2f} bits; by gold decision: "
              + ", ".join(f"{g} {v:.1f}%" for g, v in p["by_gold"].items() if v is not None) + f"  ({out}/route_probe.json)")
    if results:
        print(write_report(results, out, title=f"{name} on {args.data} {split} ({len(qs)} questions)"))
        print(f"report written to {out}/ ({', '.join(sorted(f.name for f in out.iterdir() if f.suffix in ('.json', '.md', '.png')))})")


if __name__ == "__main__":
    args = get_args()
    if args.paired:
        print_paired(args.paired)
    elif args.combine:
        combine(args.combine, args.out[0] if args.out else "out/eval/summary", f"{args.data} {' '.join(args.split)}")
    else:
        import engines
        main(args)
        engines.exit_now()
