"""
evaluate.py: score R1-Router trajectories and write the report (results.json, table.md, PNG charts).
Each of --methods runs on the same retrievers and model; checkpoints of one policy share an engine.

    python evaluate.py --model models/SmolLM2-135M-Instruct --data data/mini --split test
    python evaluate.py --model out/sft/final out/grpo/final --out out/eval/sft out/eval/grpo
    python evaluate.py --model out/sft/final --methods --probe 8 --n_questions 100   # route probe
    python evaluate.py --paired A/trajectories-routed.jsonl B/trajectories-routed.jsonl   # B - A

The methods, the protocols, resuming, the route probe and every command: docs/scripts.md#evaluatepy.
"""
import json
import math
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

import dataio
import metrics
import prepare
import report
import reward
from dataio import KBS  # ("text", "table", "image")
from metrics import GOLD_LABELS, MISSING, PRED_LABELS, STOP
from clock import CLOCK
from report import write_report

# --------------------------------------------------------------------------------------------------
# dev evaluation during training

def dev_scores(engine, retriever, qs, settings, rank, world):
    """A training run's dev evaluation (stepgrpo.py): greedy routed trajectories of qs, each rank
    its share on its own engine, gathered and scored: the numbers `--methods routed --split dev
    --n_questions N` gives the checkpoint. dev_score, which picks <out>/best, is the mean of
    F1-Recall and routing accuracy. The RNG state is put back afterwards, so a run trains the same
    with or without it. Returns the scores and this rank's trajectories as rollout.Samples, each
    scored by its F1-Recall (the log's table)."""
    import random

    import torch
    import torch.distributed as dist

    import rollout
    rng = torch.get_rng_state(), random.getstate()
    mine = rollout.rollout(engine, retriever, qs[rank::world], 1, settings, seed=0)
    torch.set_rng_state(rng[0])
    random.setstate(rng[1])
    parts = [None] * world
    dist.all_gather_object(parts, [without_tokens(x) for x in mine])
    s = metrics.score([x for p in parts for x in p])
    keys = ("f1_recall", "routing_acc", "routing_macro", "routing_macro0", "route_info0")
    dev = {f"dev_{k}": s[k] for k in keys}
    samples = [rollout.sample_of(x, score=metrics.answer_scores(x)["f1_recall"]) for x in mine]
    return dict(dev, dev_score=(dev["dev_f1_recall"] + dev["dev_routing_acc"]) / 2), samples


def without_tokens(x):
    """A trajectory without its token ids, mask and logprobs (what scoring and the report never
    read)."""
    return {k: v for k, v in x.items() if k not in ("ids", "mask", "logprobs")}


# --------------------------------------------------------------------------------------------------
# Running the methods

METHODS = ("routed", "no_retrieval", "single_rag", "iterretgen", "ircot", "every_kb", "oracle",
           "gold_steps")
STEP_FORMAT = ("routed", "every_kb", "oracle")  # whose model writes R1-Router's step format

def run_method(method, engine, retriever, questions, settings, seed=0, iters=3, shots=None,
               bar=None):
    """One method's trajectories. iters: IterRetGen's iterations; shots: few-shot conversation
    (few_shot_prefix) the step-format methods start from; bar: a tqdm bar the step-format methods
    advance a trajectory at a time."""
    import baselines
    import rollout
    if method in ("no_retrieval", "single_rag", "iterretgen"):
        kbs = () if method == "no_retrieval" else KBS
        rounds = iters if method == "iterretgen" else 1
        return baselines.answer_directly(engine, retriever, questions, kbs, settings, seed, rounds)
    if method == "ircot":
        return baselines.ircot(engine, retriever, questions, KBS, settings, seed)
    if method == "gold_steps":
        return rollout.gold_steps(engine, retriever, questions, settings, seed)
    mode = {"routed": "model", "every_kb": "all", "oracle": "oracle"}[method]
    settings = replace(settings, route_mode=mode)
    return rollout.rollout(engine, retriever, questions, 1, settings, seed, shots=shots, bar=bar)

def run_name(model):
    """A model's row name: its folder, or for a checkpoint of a run (final, best, latest, step_N)
    the run's folder, with the checkpoint unless it is the final one: out/sft/final -> sft,
    out/stepgrpo/best -> stepgrpo-best."""
    p = Path(model)
    if p.name in ("final", "best", "latest") or re.fullmatch(r"step_\d+", p.name):
        return p.parent.name + ("" if p.name == "final" else f"-{p.name}")
    return p.name


def row_label(method, n_shots, protocol):
    """A method's row label: the method, +Kshot for a step-format method run after K worked examples
    (n_shots), +protocol for one run under a protocol other than strict."""
    if method not in STEP_FORMAT:
        return method
    shots = f"+{n_shots}shot" if n_shots else ""
    return method + shots + (f"+{protocol}" if protocol != "strict" else "")


def run_signature(flags, questions, model, name):
    """What a method's scores of one model depend on: every flag (flags: {flag: value}) but where
    they go and which methods run, the model's row name, its weight files (a retrained model at the
    same path differs) and the questions. Two runs with equal signatures score a method alike, so a
    finished method's scores are reused (method_done)."""
    model = Path(model).resolve()
    skip = ("out", "methods", "probe", "combine", "paired")
    weights = [[f.name, f.stat().st_size, f.stat().st_mtime_ns]
               for f in sorted(model.glob("*.safetensors"))]
    return {**{k: v for k, v in sorted(flags.items()) if k not in skip}, "model": str(model),
            "name": name, "weights": weights, "questions": [q["id"] for q in questions]}


def method_done(out, method, signature):
    """The scores {row name: score} of a method that an earlier run with the same signature finished
    into out (method-<method>.json, written after its trajectories), else None: an interrupted
    evaluation, or one given one more method, runs only what is missing."""
    f = Path(out) / f"method-{report.slug(method)}.json"
    try:
        done = json.loads(f.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    same = isinstance(done, dict) and done.get("signature") == signature
    return done["results"] if same else None


def few_shot_examples(questions, k):
    """k questions (of a training split) for few-shot prompts: in order, each one whose gold steps
    use a KB the earlier ones did not, so the examples show every KB they can."""
    chosen, seen = [], set()
    for q in questions:
        kbs = {s["kb"] for s in q["steps"]}
        if len(chosen) < k and kbs - seen and all(s["sub_question"] for s in q["steps"]):
            chosen.append(q)
            seen |= kbs
    return chosen

def route_probe(engine, retriever, questions, settings, n=8, seed=0):
    """Routing as a distribution (--probe): at every golden prefix (the gold trajectory up to one of
    its routing steps, rollout.GoldPolicy through the real loop and retrieval) sample n routes at
    temperature 1 and count them in a gold x sampled matrix over GOLD_LABELS x PRED_LABELS (a
    malformed route, and with --actions a backtrack or a summary, which name no KB, are "missing").
    Greedy routing accuracy moves only when a top choice flips; this moves with every shift of
    probability a policy-gradient step makes, and it is what the route reward is the expectation of.
    Returns {"n", "probe_acc" (% of samples = gold), "choice_entropy" (bits: the spread of the n
    choices at a prefix, averaged over prefixes; 0 = always the same), "by_gold" (that % per gold
    label), "confusion"}."""
    import rollout
    vis = getattr(engine, "vis", None)
    _, prefixes = rollout.golden_prefixes(engine.tok, retriever, questions, settings, seed, vis)
    label = lambda g, t: g[t][0]["kb"] if t < len(g) else STOP  # a multi-query step: its first KB
    # (prompt ids, its images, gold label, key) of each routing prefix
    points = [(ids, images, label(reward.by_step(x["gold_steps"]), sp["step"]),
               rollout.turn_key(x, sp)) for x, sp, ids, images in prefixes if sp["kind"] == "route"]
    repeat = lambda col: [p[col] for p in points for _ in range(n)]  # a column, n times a point
    stop, max_tokens = rollout.route_stop(engine.tok, settings)
    outs = engine.generate(repeat(0), max_tokens, 1.0, 1.0, stop, seed, images=repeat(1),
                           keys=repeat(3))
    counts, spread = [[0] * len(PRED_LABELS) for _ in GOLD_LABELS], [Counter() for _ in points]
    for k, (ids, _) in enumerate(outs):
        text = engine.tok.decode(ids, skip_special_tokens=True)
        r = reward.parse_route(text, settings.max_pairs, settings.max_rets, settings.actions)
        pred = (STOP if r.stop else r.kb) if r.ok and not r.action else MISSING
        counts[GOLD_LABELS.index(points[k // n][2])][PRED_LABELS.index(pred)] += 1
        spread[k // n][pred] += 1
    entropy = [-sum(c / n * math.log2(c / n) for c in sp.values()) for sp in spread]  # bits

    def rate(rows):  # % of the samples at these gold labels that take the gold one
        hits = sum(counts[i][PRED_LABELS.index(GOLD_LABELS[i])] for i in rows)
        return 100 * hits / max(1, sum(sum(counts[i]) for i in rows))
    return {"n": n, "probe_acc": rate(range(len(GOLD_LABELS))),
            "choice_entropy": metrics.mean(entropy),
            "by_gold": {g: rate([i]) if sum(counts[i]) else None
                        for i, g in enumerate(GOLD_LABELS)},
            "confusion": {"rows": list(GOLD_LABELS), "cols": list(PRED_LABELS), "counts": counts}}

def get_args(argv=None):
    import argparse
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", nargs="+", default=[prepare.DEFAULT_MODEL],
                    help="HF causal LM folder(s); several: checkpoints of one policy, one engine")
    ap.add_argument("--name", nargs="+", default=None,
                    help="a model's label in the table (default: run_name)")
    ap.add_argument("--data", default="data/mini")
    ap.add_argument("--split", nargs="+", default=["test"],
                    help="question splits, concatenated (e.g. test visual_test)")
    ap.add_argument("--n_questions", type=int, default=0, help="the first N of each split (0: all)")
    ap.add_argument("--methods", nargs="*", default=list(METHODS), choices=METHODS)
    ap.add_argument("--probe", type=int, default=0,
                    help="route probe: N sampled routes at every golden prefix (0: off)")
    ap.add_argument("--backend", default="vllm", choices=["vllm", "hf", "openai", "chat"],
                    help="in-process vLLM, transformers, a server token-exact (openai), or any "
                         "chat API (chat: not token-exact; docs/serve.md)")
    ap.add_argument("--base_url", default=None,
                    help="--backend openai / chat: the server, e.g. http://localhost:8000/v1")
    ap.add_argument("--api_key", default=None,
                    help="--backend openai / chat: its key (else $OPENAI_API_KEY)")
    ap.add_argument("--served_model", default=None,
                    help="--backend chat: the model's name on the server (default: the one "
                         "/v1/models lists); --model gives the local tokenizer and chat format")
    ap.add_argument("--max_concurrency", type=int, default=8,
                    help="--backend chat: requests in flight")
    ap.add_argument("--timeout", type=float, default=None,
                    help="--backend chat: seconds a request may take (default: 300)")
    ap.add_argument("--retriever", default="dense", help="dense | bm25 | hybrid | http://host:port")
    ap.add_argument("--max_steps", type=int, default=3)
    ap.add_argument("--max_pairs", type=int, default=1,
                    help="sub-questions a routing step may hold")
    ap.add_argument("--max_rets", type=int, default=1, help="retrievers a sub-question may name")
    ap.add_argument("--topk", type=int, default=3)
    ap.add_argument("--actions", action="store_true",
                    help="a routing step may backtrack or summarise (a policy trained on them)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--protocol", default="strict", choices=["strict", "fallback", "released"],
                    help="how a step is sampled and a malformed one scored (docs/scripts.md)")
    ap.add_argument("--iters", type=int, default=3, help="IterRetGen's retrieve-generate rounds")
    ap.add_argument("--structure", default="transcript", choices=["transcript", "released"],
                    help="transcript: one chat grows with every step; released: a chat a step")
    ap.add_argument("--few_shot", type=int, default=0,
                    help="worked gold trajectories (train split) before each step-format question")
    ap.add_argument("--max_active", type=int, default=64,
                    help="trajectories in flight (lower it for long evidence: KV cache)")
    ap.add_argument("--max_model_len", type=int, default=None,
                    help="the engine's context, prompt + new tokens (default: engines.MAX_LEN)")
    ap.add_argument("--max_pixels", type=int, default=None,
                    help="VL policy: cap on a picture's pixels (default: the checkpoint's)")
    ap.add_argument("--judge", default=None, metavar="MODEL",
                    help="an LLM judge of the final answers (judge.py): its model folder, or "
                         "with --judge_url a served model's name (chat)")
    ap.add_argument("--judge_url", default=None,
                    help="--judge's OpenAI-compatible server, e.g. http://host:8000/v1")
    ap.add_argument("--judge_backend", default=None, choices=["openai", "chat"],
                    help="--judge_url's: token-exact or chat (default: openai for a folder, "
                         "chat for a name)")
    ap.add_argument("--judge_api_key", default=None,
                    help="--judge_url's key (else $JUDGE_API_KEY)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", nargs="+", default=None,
                    help="a model's report folder (default out/eval/<name>-<split>)")
    ap.add_argument("--combine", nargs="+", default=None,
                    help="merge these results.json files into one report (--out)")
    ap.add_argument("--paired", nargs="+", default=None, metavar="BASE NEW",
                    help="trajectories-*.jsonl, BASE NEW [...]: paired bootstrap of NEW - BASE")
    return ap.parse_args(argv)


def print_paired(paths):
    """--paired BASE NEW [BASE NEW ...]: the paired bootstrap of NEW - BASE, overall and per
    question type, with its question-level and two-level (seeds, then questions) intervals."""
    if len(paths) % 2:
        sys.exit(f"error: --paired takes BASE NEW pairs: {len(paths)} files given")
    try:
        files = [dataio.read_jsonl(f) for f in paths]
        p = metrics.paired(list(zip(files[::2], files[1::2])))
    except KeyError as e:
        sys.exit(f"error: --paired: a trajectory lacks {e}: give trajectories-*.jsonl written by "
                 f"evaluate.py")
    except (dataio.DataError, OSError, ValueError) as e:
        sys.exit(f"error: --paired: {e}")
    labels = [f"{n} - {b}" for b, n in zip(paths[::2], paths[1::2])]
    print(report.paired_text(p, labels, metrics.PAIRED))

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


def settings_of(protocol, **loop):
    """The step loop's settings: rollout.Settings(**loop), --protocol applied."""
    import rollout
    settings = rollout.Settings(**loop)
    if protocol != "strict":
        settings = replace(settings, fallback=True)
    if protocol == "released":
        settings = replace(settings, temperature=1.0, top_k=20, topk=5, route_tries=5,
                           answer_tries=3)
    return settings


def judge_answers(judge, trajs, out):
    """--judge: each trajectory's "judge", the judge's AnswerAccuracy of its final answer against
    the gold answers (a format failure 0, unasked), cached in out/judge.jsonl."""
    judge.use_cache(out / "judge.jsonl")
    asked = [x for x in trajs if x["format_ok"] and x["final_answer"]]
    scores = judge.accuracy([(x["question"], " or ".join(x["answers"]), x["final_answer"])
                             for x in asked])
    judged = {id(x): s for x, s in zip(asked, scores)}
    for x in trajs:
        x.judge = judged.get(id(x), 0.0)


@dataclass(frozen=True)
class Plan:
    """What each model's evaluation reads of the flags, built once in main."""
    methods: tuple   # --methods, in order
    probe: int       # --probe: routes sampled a golden prefix (0: no probe)
    data: str        # --data, for the report's title
    split: str       # the --split names joined by "+"
    seed: int
    iters: int       # IterRetGen's rounds
    few_shot: int    # worked examples before each step-format question
    protocol: str
    flags: dict      # every flag: what run_signature keys a finished method's scores on


def run_methods(plan, engine, ret, qs, settings, shots, model, name, out, judge=None):
    """Each of plan.methods on qs -> {row name: score}; a method's trajectories and its
    method-<method>.json go to out as it finishes, and one an earlier run with the same signature
    finished is reused. judge: --judge's."""
    from tqdm import tqdm
    results, signature = {}, run_signature(plan.flags, qs, model, name)
    for method in plan.methods:
        if done := method_done(out, method, signature):
            results.update(done)
            print(f"{method}: its scores reused from {out}/method-{report.slug(method)}.json "
                  f"(the same model, questions and flags)")
            continue
        t = time.perf_counter()
        bar = tqdm(total=len(qs), desc=f"{name} {method} ({plan.split})", unit="question")
        trajs = run_method(method, engine, ret, qs, settings, plan.seed, plan.iters, shots, bar)
        bar.update(len(qs) - bar.n)
        bar.close()
        if judge:
            judge_answers(judge, trajs, out)
        label = row_label(method, plan.few_shot if shots else 0, plan.protocol)
        scores = metrics.score(trajs)
        # a served model: which mode scored it; vLLM in-process: the most of its KV cache in use
        # (1.0: full, so trajectories waited)
        said = ({"engine": engine.mode} if hasattr(engine, "mode") else
                {"kv_used": engine.kv_used()} if hasattr(engine, "kv_used") else {})
        row = {f"{name}/{label}": dict(scores, seconds=round(time.perf_counter() - t, 1), **said)}
        results.update(row)
        dataio.write_jsonl(out / f"trajectories-{method}.jsonl", [without_tokens(x) for x in trajs])
        mark = {"signature": signature, "results": row}  # after its trajectories: a finished method
        dataio.write_atomic(out / f"method-{report.slug(method)}.json",
                            json.dumps(mark, indent=1, allow_nan=False) + "\n")
    return results


POLICY_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                "preprocessor_config.json", "processor_config.json")

def same_policy(a, b):
    """None when an engine started on model folder a scores folder b once b's weights are swapped
    in: the same config.json (but for the weights' dtype) and tokenizer and processor files; else
    what differs."""
    def files(m):
        conf = json.loads((Path(m) / "config.json").read_text())
        skip = ("_name_or_path", "transformers_version", "dtype", "torch_dtype")
        return {"config.json": {k: v for k, v in conf.items() if k not in skip},
                **{f: (Path(m) / f).read_bytes() for f in POLICY_FILES if (Path(m) / f).is_file()}}
    fa, fb = files(a), files(b)
    diff = sorted(f for f in fa.keys() | fb.keys() if fa.get(f) != fb.get(f))
    return f"its {', '.join(diff)} differ from {a}'s" if diff else None


def checkpoint_weights(model):
    """A model folder's weights under its transformers class's names (those a weight sync sends), in
    their saved dtype."""
    import engines
    return engines.auto_model(model).from_pretrained(model, dtype="auto").state_dict()


def check_models(models, names, outs, backend, settings, few_shot):
    """Exit with one line for a model folder evaluate.py cannot score (settings: the step loop's,
    whose transcript format each model must have been trained on), or models one engine cannot
    share."""
    import rollout
    import transcript
    if len(names) != len(models) or len(outs) != len(models):
        sys.exit(f"error: --name and --out take one value a model: {len(models)} models, "
                 f"{len(names)} names, {len(outs)} report folders")
    if backend in ("openai", "chat") and len(models) > 1:
        sys.exit(f"error: --backend {backend} scores the one model its server serves: give one "
                 "--model (its tokenizer)")
    if len(set(outs)) < len(outs):
        sys.exit(f"error: --out: two models would share a report folder "
                 f"({', '.join(map(str, outs))})")
    for model in models:
        if not (Path(model) / "config.json").exists():
            why = "run `python prepare.py` for the default"
            if (Path(model) / "adapter").is_dir():
                why = ("LoRA adapters of an unfinished run: evaluate its final or best checkpoint "
                       "(merged weights)")
            sys.exit(f"error: {model}: not a model folder ({why})")
        if err := transcript.check_format(model, settings):
            sys.exit(f"error: {err}")
        if err := same_policy(models[0], model):
            sys.exit(f"error: --model {model}: {err}: one engine scores checkpoints of one policy; "
                     f"evaluate it in a run of its own")
    rollout.check_multi_query(settings.max_pairs, settings.max_rets, settings.structure,
                              settings.actions)
    if few_shot and settings.structure == "released":
        sys.exit("error: --few_shot builds worked examples for --structure transcript only")


def load_inputs(data, splits, n_questions, retriever):
    """The questions (the first n_questions of each split, 0: all) and the retriever; one line on
    bad data."""
    import retrievers
    try:
        qs = [q for sp in splits for q in dataio.load_questions(data, sp)[:n_questions or None]]
        return qs, retrievers.make_retriever(retriever, data)
    except dataio.DataError as e:
        sys.exit(f"error: {e}")


def load_judge(model, url, max_model_len, seed, api_key=None, backend=None):
    """--judge's judge.Judge (None without one): a model folder in-process, or served at url
    (token-exact from the folder, or a served model's name through the chat API)."""
    if (url or backend) and not model:
        sys.exit("error: --judge_url needs --judge: the judge's model folder (its tokenizer and "
                 "chat template) or, through a chat API, its name on the server")
    if backend and not url:
        sys.exit("error: --judge_backend needs --judge_url, the judge's server")
    if not model:
        return None
    import judge
    return judge.Judge.load(model, url, api_key, backend=backend, max_model_len=max_model_len,
                            seed=seed)


def few_shot_prompt(tok, ret, data, k, settings):
    """The conversation of k worked gold trajectories of <data>'s train split (None for k = 0)."""
    import rollout
    if not k:
        return None
    examples = few_shot_examples(dataio.load_questions(data, "train"), k)
    shots = rollout.few_shot_prefix(tok, ret, examples, settings)
    print(f"--few_shot {k}: {len(examples)} train questions as worked examples "
          f"({len(shots)} tokens)")
    return shots


def engine_kv_tokens(model, methods, probe, few_shot, settings, questions):
    """The vLLM engine's KV cache (tokens) for model's evaluation: a text policy's zero-shot step
    loop, rollout.kv_tokens (the baselines search every KB); else engines.CPU_KV_TOKENS (a VL
    policy's pictures, worked examples and the route probe's samples are not in rollout's count)."""
    import engines
    import rollout
    import vision
    if few_shot or probe or vision.has_vision(model):
        return engines.CPU_KV_TOKENS
    one_kb = set(methods) <= {"routed", "oracle", "gold_steps"}
    return rollout.kv_tokens(settings, questions, 1 if one_kb else len(KBS))


def main(args):
    """Score args.methods (and the route probe) of each model in args.model with one engine: a model
    after the first has its weights swapped in (engine.sync_weights, as Step-GRPO syncs); each
    report goes to its own --out."""
    CLOCK.started()
    with CLOCK("imports"):
        import engines  # here, not at the top: --paired and --combine need no engine (nor torch)
        import remote
    if not args.methods and not args.probe:
        sys.exit("error: nothing to do: give --methods and/or --probe N")
    split = "+".join(args.split)
    names = args.name or [run_name(m) for m in args.model]
    outs = [Path(o) for o in args.out or [f"out/eval/{n}-{split}" for n in names]]
    settings = settings_of(args.protocol, max_steps=args.max_steps, topk=args.topk,
                           temperature=args.temperature, max_active=args.max_active,
                           structure=args.structure, max_pairs=args.max_pairs,
                           max_rets=args.max_rets, actions=args.actions)
    check_models(args.model, names, outs, args.backend, settings, args.few_shot)
    with CLOCK("inputs"):
        qs, ret = load_inputs(args.data, args.split, args.n_questions, args.retriever)
    max_len = args.max_model_len or engines.MAX_LEN
    kv = engine_kv_tokens(args.model[0], args.methods, args.probe, args.few_shot, settings,
                          len(qs)) if args.backend == "vllm" else None
    with CLOCK("engine"):
        engine = engines.make_engine(args.backend, args.model[0], seed=args.seed,
                                     max_model_len=max_len, max_pixels=args.max_pixels,
                                     max_images=settings.max_images, kv_tokens=kv,
                                     base_url=args.base_url,
                                     api_key=remote.api_key(args.api_key),
                                     served=args.served_model,
                                     max_concurrency=args.max_concurrency, timeout=args.timeout)
        judge = load_judge(args.judge, args.judge_url, max_len, args.seed,
                           remote.api_key(args.judge_api_key, remote.JUDGE_KEY_ENV),
                           args.judge_backend)
    shots = few_shot_prompt(engine.tok, ret, args.data, args.few_shot, settings)
    plan = Plan(methods=tuple(args.methods), probe=args.probe, data=args.data, split=split,
                seed=args.seed, iters=args.iters, few_shot=args.few_shot, protocol=args.protocol,
                flags=remote.without_keys(vars(args)))
    try:
        for i, (model, name, out) in enumerate(zip(args.model, names, outs)):
            if i:
                with CLOCK("engine"):  # the next checkpoint's weights into the engine
                    engine.sync_weights(checkpoint_weights(model))
            with CLOCK("compute"):
                evaluate_model(plan, engine, ret, qs, settings, shots, model, name, out, judge)
    finally:  # main called as a function (the tests) leaves no engine behind
        engine.close()
        if judge:
            judge.engine.close()
    CLOCK.done()


def evaluate_model(plan, engine, ret, qs, settings, shots, model, name, out, judge=None):
    """The engine, holding model's weights, scores plan.methods (their answers judged by judge,
    --judge's) and the route probe; the report goes to out."""
    results_file = out / "results.json"
    earlier = json.loads(results_file.read_text()) if results_file.is_file() else {}
    if earlier and not any(k.startswith(f"{name}/") for k in earlier):
        print(f"note: {out} holds another model's report ({', '.join(earlier)}); it is replaced "
              f"(--out names another folder)")
    results = run_methods(plan, engine, ret, qs, settings, shots, model, name, out, judge)
    if plan.probe:
        write_probe(plan, engine, ret, qs, settings, model, name, out)
    if results:
        title = f"{name} on {plan.data} {plan.split} ({len(qs)} questions)"
        print(write_report(results, out, title=title))
        written = sorted(f.name for f in out.iterdir() if f.suffix in (".json", ".md", ".png"))
        print(f"report written to {out}/ ({', '.join(written)})")


def write_probe(plan, engine, ret, qs, settings, model, name, out):
    """The route probe of the model the engine holds: out/route_probe.json, its confusion chart, one
    line."""
    out.mkdir(parents=True, exist_ok=True)
    p = dict(route_probe(engine, ret, qs, settings, plan.probe, plan.seed), model=model,
             split=plan.split, questions=len(qs))
    dataio.write_atomic(out / "route_probe.json", json.dumps(p, indent=2) + "\n")
    title = f"route probe ({plan.probe} samples a prefix)"
    chart = report.confusion_chart(p["confusion"], title, name)
    dataio.write_atomic(out / "routing_confusion_probe.png", chart)
    by_gold = ", ".join(f"{g} {v:.1f}%" for g, v in p["by_gold"].items() if v is not None)
    print(f"route probe: {p['probe_acc']:.1f}% of sampled routes take the gold KB, choice entropy "
          f"{p['choice_entropy']:.2f} bits; by gold decision: {by_gold}  ({out}/route_probe.json)")


if __name__ == "__main__":
    args = get_args()
    if args.paired:
        print_paired(args.paired)
    elif args.combine:
        title = f"{args.data} {' '.join(args.split)}"
        combine(args.combine, args.out[0] if args.out else "out/eval/summary", title)
    else:
        import engines
        import retrievers
        try:
            main(args)
        except retrievers.RetrievalError as e:
            sys.exit(f"error: {e}")
        engines.exit_now()
