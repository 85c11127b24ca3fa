"""
synth.py: golden step trajectories for SFT, in the policy's exact chat format (rollout.py).
Sources: gold (the gold decomposition through the real step loop and retrieval), teacher (a
teacher's samples kept by R1-Router's filter), r1router (R1-Router's released rows replayed).
Each writes <out>/<split>.jsonl, meta.json and <split>.errors.json (step mistakes against the
world's gold hops).

    python synth.py --data data/mini --out data/mini/traj               # gold, train + dev
    python synth.py --data data/mini --out data/mini/traj-t --teacher out/teacher/final -n 4
    python synth.py --r1router data/r1router/stepgrpo_valid_119.jsonl --out data/r1router/traj
    python synth.py --export_r1router data/mini/traj/train.jsonl --out data/mini/r1r.jsonl

The sources in detail, more commands and the flags' sources: docs/scripts.md#synthpy.
"""
import argparse
import json
import re
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path

import baselines
import dataio
import engines
import remote
import prepare
import prompts
import reward
import rollout
import transcript
import vision
from clock import CLOCK

#### teacher-mode filters

def rejection(x, max_steps, filt="paper"):
    """Why a sampled trajectory is not a usable golden one (None = keep). Checked in order, as
    reported. paper: R1-Router's data_filter.py, which checks the final answer only (its teacher
    re-asked a step that did not parse, here route_tries / answer_tries); strict: also no re-asked
    sub-question, no missing intermediate answer, and a trajectory that ends early must have stopped
    (this repo's stricter filter)."""
    if not x["format_ok"]:
        return "format"  # a step did not parse (the parser also demands one retriever a step)
    if x.get("overflow"):
        return "context"  # the next step did not fit the engine's context
    if filt == "strict":
        steps = reward.by_step(x["steps"])
        asked = [q.lower() for st in steps for q, _ in reward.pairs_of(st)]
        if any(s["answer"] is None for s in x["steps"]) or len(set(asked)) < len(asked):
            return "steps"  # an intermediate answer missing, or the same sub-question asked twice
        stopped = any(sp["kind"] == "route" and sp["step"] == len(steps) for sp in x["spans"])
        if not stopped and len(x["steps"]) < max_steps:
            return "stopping"  # ended without writing <ret>None</ret> before running out of steps
    if reward.f1_recall(x["final_answer"] or "", x["answers"]) < 1.0:
        return "answer"  # the paper keeps only final answers whose token recall is 1
    return None

FILTERS = ("format", "context", "steps", "stopping", "answer")

def teacher_trajectories(engine, retriever, questions, n, settings, seed=0, filt="paper",
                         shots=None):
    """The first sample of each question that passes the filter; all the samples; the filter
    counts. shots: worked examples the teacher's chats start with (rollout.few_shot_prefix), cut
    from every trajectory (without_shots)."""
    from tqdm import tqdm
    with tqdm(total=len(questions) * n, desc="teacher samples", unit="trajectory") as bar:
        trajs = rollout.rollout(engine, retriever, questions, n=n, s=settings, seed=seed, bar=bar,
                                shots=shots)
    if shots:
        fmt = transcript.ChatFormat(engine.tok, rollout.system_text(settings))
        trajs = [without_shots(x, fmt, len(shots), getattr(engine, "vis", None)) for x in trajs]
    kept, counts = [], dict(sampled=len(trajs), **{f: 0 for f in FILTERS})
    for i, q in enumerate(questions):
        group = trajs[i * n:(i + 1) * n]
        reasons = [rejection(x, settings.max_steps, filt) for x in group]
        for r in reasons:
            if r:
                counts[r] += 1
        good = [x for x, r in zip(group, reasons) if r is None]
        if good:
            kept.append(good[0])
    counts["kept_trajectories"] = counts["sampled"] - sum(counts[f] for f in FILTERS)
    counts["kept_questions"] = len(kept)
    return kept, trajs, counts

def without_shots(x, fmt, n_shots, vis=None):
    """Trajectory x, whose transcript began with n_shots ids of worked examples, as if it had begun
    with the system prompt and its question (what the policy sees, and SFT trains on): the head
    replaced, the rest (the teacher's turns and the evidence) kept, its positions moved."""
    head = [fmt.user_open, *([vision.Img(x["image"])] if x.get("image") and vis else []),
            x["question"], fmt.user_close]
    old, _ = fmt.encode(head, vis)
    new, images = fmt.encode([fmt.prefix_tpl[0], *head[1:-1], fmt.prefix_tpl[1]], vis)
    cut, d = n_shots + len(old), len(new) - n_shots - len(old)
    assert x["ids"][n_shots:cut] == old, "the trajectory does not start with its shots"
    move = lambda sp: dict(sp, start=sp["start"] + d, end=sp["end"] + d)
    return replace(x, ids=new + x["ids"][cut:], mask=[0] * len(new) + x["mask"][cut:],
                logprobs=[0.0] * len(new) + x["logprobs"][cut:],
                spans=[move(sp) for sp in x["spans"]],
                images=images + [[s + d, n, p] for s, n, p in x["images"] if s >= cut],
                segments=[[0, len(new) + len(x["ids"]) - cut]])

#### the step mistakes of a trajectory, against the world's gold hops (what a real dataset labels)

def step_errors(x):
    """Counts of one trajectory's step mistakes against the world's gold hops (a hop: a gold step
    {doc_id, kb, answer}; open: its supporting document not retrieved yet):
      steps        routing steps that searched
      wrong_kb     a search in none of the KBs of the hops whose supporting documents are not
                   found yet
      extra        a search after every supporting document was found
      reask        a search repeating an earlier sub-question
      no_progress  a search whose evidence holds no new supporting document (wrong KB, a re-ask,
                   an extra step, a sub-question that retrieves the wrong document, or a
                   retrieval miss: gold trajectories have some)
      checkable    searches that found a new supporting document, whose answer the hop's answer
                   checks
      wrong_answer of those, an intermediate answer whose F1-Recall against the hop's answer is
                   below 1
      missed_hop   1 if the trajectory ended with a supporting document never found (a skipped
                   hop)"""
    found, e = set(), Counter()
    open_hops = lambda: [g for g in x["gold_steps"] if g["doc_id"] not in found]
    for st in reward.by_step(x["steps"]):
        retrieved, kbs = {d for s in st for d in s["retrieved"]}, {s["kb"] for s in st}
        earlier = [s for s in x["steps"] if s["step"] < st[0]["step"]]
        todo = {g["kb"] for g in open_hops()}
        # the hops this search newly found
        golds = [g["answer"] for g in open_hops() if g["doc_id"] in retrieved]
        e["steps"] += 1
        e["extra"] += not todo
        e["wrong_kb"] += bool(todo) and not todo & kbs
        e["reask"] += any(reward.re_asks(q, earlier) for q, _ in reward.pairs_of(st))
        e["no_progress"] += not golds
        if golds:
            e["checkable"] += 1
            e["wrong_answer"] += reward.f1_recall(st[0]["answer"] or "", golds) < 1.0
        found |= retrieved
    e["missed_hop"] = int(bool(open_hops()))
    return e

def error_report(trajs):
    """The step mistakes of a set of trajectories (step_errors): per-step rates, the share of
    trajectories with a missed hop, and the share with any mistake (the teacher's trajectory error
    rate)."""
    es = [step_errors(x) for x in trajs]
    tot = sum(es, Counter())
    rate = lambda k, d: round(tot[k] / max(1, tot[d]), 4)
    mistakes = ("wrong_kb", "extra", "reask", "no_progress", "wrong_answer", "missed_hop")
    any_error = sum(any(e[k] for k in mistakes) for e in es)
    return dict(trajectories=len(es), steps=tot["steps"], wrong_kb=rate("wrong_kb", "steps"),
                extra=rate("extra", "steps"), reask=rate("reask", "steps"),
                no_progress=rate("no_progress", "steps"),
                wrong_answer=rate("wrong_answer", "checkable"),
                missed_hop=round(tot["missed_hop"] / max(1, len(es)), 4),
                any_error=round(any_error / max(1, len(es)), 4))

#### R1-Router's released step-unrolled format

_KB_OF_TAG = {kb.tag: kb.name for kb in dataio.KB_TABLE}  # "ter" -> "text"
_PASSAGE = re.compile(rf"({'|'.join(_KB_OF_TAG)})-(\d+): ")

class RecordedRetriever:
    """Answers each sub-question with the passages recorded in the released data (same search() as
    retrievers.py)."""
    def __init__(self, evidence):
        self.evidence = evidence  # (sub-question, kb) -> [doc dict]

    def search(self, queries, kb, k=3):
        return [self.evidence.get((q, kb), [])[:k] for q in queries]

def read_r1router(path):
    """Released rows -> (questions in corpus.py's format, RecordedRetriever with their passages). A
    ret step naming several retrievers (R1-Router's multi-retriever mode) becomes one gold step per
    KB, with the same sub-question (replay it with --max_rets 3)."""
    questions, evidence = [], {}
    for n, row in enumerate(dataio.read_jsonl(path), 1):
        try:
            question, gold, answers = read_r1router_row(row, n, evidence)
        except (KeyError, IndexError, AttributeError, StopIteration, TypeError) as e:
            raise dataio.DataError(f"{path}:{n}: not an R1-Router step-unrolled row "
                                   f"({type(e).__name__}: {e})") from None
        questions.append(dict(id=f"r1r-{n}", question=question, answers=[str(a) for a in answers],
                              type=f"{len(gold)}hop",
                              pattern=">".join(g["kb"] for g in gold) or "none", steps=gold))
    return questions, RecordedRetriever(evidence)

def read_r1router_row(row, n, evidence):
    """Released row number n -> (question, gold steps, final answers); the passages of each lookup
    go into evidence[(sub-question, kb)]."""
    steps, ret_steps = row["steps"], [s for s in row["steps"] if s["step_type"] == "ret"]
    question = re.match(r"Origin question: (.*?)\n", ret_steps[0]["problem"], re.S).group(1).strip()
    gold, pending, answers = [], None, None
    for s in steps:
        if s["step_type"] == "ret":
            rets = [r.strip().lower() for r in s["answer"]["retriever"]]
            if rets == ["none"]:
                continue
            kbs = [reward.RET_TO_KB[next(r for r in reward.RET_TO_KB if r.lower() == ret)]
                   for ret in rets]
            pending = [dict(sub_question=s["answer"]["query"].strip(), kb=kb, doc_id="", answer="")
                       for kb in kbs]
        elif pending is not None:  # the pending sub-question's intermediate answer and passages
            body = s["problem"].split("Give me the answer")[0]
            parts = _PASSAGE.split(body)[1:]  # [tag, idx, text, tag, idx, text, ...]
            for g in pending:  # several retrievers: a KB's lookup gets the passages tagged with it
                evidence[g["sub_question"], g["kb"]] = [
                    dict(id=f"r1r{n}-{t}-{i}", kb=_KB_OF_TAG[t], title="", contents=txt.strip(),
                         score=0.0)
                    for t, i, txt in zip(parts[0::3], parts[1::3], parts[2::3])
                    if len(pending) == 1 or _KB_OF_TAG[t] == g["kb"]]
                g["answer"] = str(s["answer"]).strip()
            gold += pending
            pending = None
        else:  # the final answer step
            answers = s["answer"] if isinstance(s["answer"], list) else [s["answer"]]
    if answers is None:
        raise KeyError("no final answer step")
    return question, gold, answers

def to_r1router(x, system_route=prompts.SYSTEM_PROMPT, system_answer=baselines.DIRECT_PROMPT):
    """One of our trajectories -> a step-unrolled row as R1-Router's Step-GRPO code reads it: a ret
    and an ans step per sub-question (a multi-query step's sub-questions one after another, each
    with the step's answer), a sub-question sent to several KBs with its retriever list."""
    history, steps, i = f"Origin question: {x['question']}\n", [], 0
    for group in reward.by_step(x["steps"]):
        for q, kbs in reward.pairs_of(group):
            i += 1
            rets = [reward.KB_TO_RET[kb].lower() for kb in kbs]
            steps.append(dict(step_type="ret", problem=history, system=system_route,
                              answer=dict(query=q, retriever=rets)))
            # the passages' ids; their texts are in our transcript
            passages = "".join(f"{dataio.KB_OF[s['kb']].tag}-{j}: {d}\n" for s in group
                               if s["sub_question"] == q for j, d in enumerate(s["retrieved"]))
            problem = (f"According to the related information searched: {passages} Give me the "
                       f"answer(with the format <answer></answer>) to the Question: {q}")
            steps.append(dict(step_type="ans", system=system_answer, answer=group[0]["answer"],
                              problem=problem))
            history += f"Sub-question{i}: {q} Answer{i}: {group[0]['answer']}\n"
    steps.append(dict(step_type="ret", problem=history, system=system_route,
                      answer=dict(query="none", retriever=["none"])))
    steps.append(dict(step_type="ans", system=system_answer, answer=x["answers"],
                      problem=history + f"Now, give me the final answer of the origin question: "
                                        f"{x['question']}"))
    return dict(images=[], steps=steps)

#### writing the trajectories

def slim(x):  # SFT needs ids + mask (the evidence is in the ids); logprobs are RL's business
    return {k: v for k, v in x.items() if k not in ("logprobs", "evidence")}

def unlearn_popped(x):
    """What a backtrack popped (the gold policy's deliberate wrong route, a teacher's own) stays in
    its chat as context, not as a target: SFT learns to backtrack from a wrong step, not to take
    it."""
    for sp in x.get("spans", []):  # (rows written by hand may hold ids and a mask alone)
        if sp.get("popped"):
            x["mask"][sp["start"]:sp["end"]] = [0] * (sp["end"] - sp["start"])
    return x

def write_trajectories(out, split, trajs, tok, fmt, max_pixels=None):
    """<out>/<split>.jsonl, and <out>/meta.json naming the tokenizer of their ids (sft.py refuses
    another's), their format (transcript.format_meta: sft.py passes it on to its checkpoints) and a
    VL policy's picture cap (sft.py builds its processor with it)."""
    dataio.write_jsonl(Path(out) / f"{split}.jsonl", [slim(unlearn_popped(x)) for x in trajs])
    meta = dict(transcript.tokenizer_meta(tok), format=fmt, max_pixels=max_pixels)
    dataio.write_atomic(Path(out) / transcript.META, json.dumps(meta) + "\n")

def gold_split(tok, vis, ret, qs, settings, max_pairs, actions):
    """The gold policy's trajectories of qs, their error report and a summary line's words."""
    policy = rollout.GoldPolicy(tok, qs, vis, max_pairs, actions)
    trajs = rollout.rollout(policy, ret, qs, s=settings)
    summary = f"{sum(x['format_ok'] for x in trajs)} of {len(trajs)} well-formed"
    return trajs, dict(kept=error_report(trajs)), summary

def teacher_split(engine, ret, qs, n, settings, seed, filt, shots=None):
    """The teacher engine's kept trajectories of qs, the error report (filter counts, the questions
    dropped, the mistakes of the kept and of all well-formed samples) and a summary line's words.
    shots: teacher_trajectories'."""
    trajs, sampled, counts = teacher_trajectories(engine, ret, qs, n, settings, seed, filt, shots)
    summary = "teacher filters: " + ", ".join(f"{k} {v}" for k, v in counts.items())
    kept = {x["qid"] for x in trajs}  # dropped: the questions without a kept trajectory
    well_formed = [x for x in sampled if x["format_ok"] and not x["overflow"]]
    errors = dict(filters=counts, dropped=[q["id"] for q in qs if q["id"] not in kept],
                  kept=error_report(trajs), sampled=error_report(well_formed))
    return trajs, errors, summary

def write_split(out, split, trajs, errors, summary, tok, fmt, max_pixels):
    """A split's trajectories and <split>.errors.json written, and two lines on them."""
    write_trajectories(out, split, trajs, tok, fmt, max_pixels)
    dataio.write_atomic(Path(out) / f"{split}.errors.json", json.dumps(errors, indent=1) + "\n")
    mistakes = "; ".join(f"{k}: " + ", ".join(f"{m} {v}" for m, v in e.items())
                         for k, e in errors.items() if k in ("kept", "sampled"))
    print(f"{split}: step mistakes against the world's gold (synth.step_errors), {mistakes}")
    hits = [g["doc_id"] in s["retrieved"]
            for x in trajs for g, s in zip(x["gold_steps"], x["steps"])]
    policy_tokens = sum(sum(x["mask"]) for x in trajs) / max(1, len(trajs))
    tokens = sum(len(x["ids"]) for x in trajs) / max(1, len(trajs))
    print(f"{split}: {len(trajs)} trajectories ({summary}); gold doc retrieved at "
          f"{sum(hits) / max(1, len(hits)):.1%} of steps; {policy_tokens:.0f} policy tokens of "
          f"{tokens:.0f} per trajectory -> {out}/{split}.jsonl")

#### main

def get_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="data/mini", help="corpus.py folder (gold and teacher modes)")
    ap.add_argument("--out", default="data/mini/traj",
                    help="output folder ({split}.jsonl) or file (--export_r1router)")
    ap.add_argument("--splits", nargs="+", default=["train", "dev"])
    ap.add_argument("--model", default=prepare.DEFAULT_MODEL,
                    help="the policy whose tokenizer and chat template are used")
    ap.add_argument("--retriever", default="dense", help="dense | bm25 | hybrid | http://host:port")
    ap.add_argument("--teacher", default=None,
                    help="teacher mode: HF folder of the teacher model (--backend chat: its name "
                         "on the server)")
    ap.add_argument("-n", type=int, default=4, help="teacher mode: samples per question")
    ap.add_argument("--temperature", type=float, default=1.0,
                    help="teacher mode: sampling temperature")
    ap.add_argument("--top_k", type=int, default=20, help="teacher mode: sampling top-k (0: off)")
    ap.add_argument("--tries", type=int, default=2,
                    help="teacher mode: attempts at a step that does not parse")
    ap.add_argument("--filter", default="paper", choices=["paper", "strict"],
                    help="teacher mode: paper: final answer's token recall is 1; strict: + steps")
    ap.add_argument("--backend", default="vllm", choices=["vllm", "hf", "openai", "chat"],
                    help="teacher mode: in-process vLLM, transformers, an OpenAI server "
                         "token-exact, or any chat API (chat: not token-exact)")
    ap.add_argument("--base_url", default=None,
                    help="--backend openai / chat: the server, e.g. http://localhost:8000/v1")
    ap.add_argument("--api_key", default=None,
                    help="--backend openai / chat: its key (else $OPENAI_API_KEY)")
    ap.add_argument("--few_shot", type=int, default=0,
                    help="teacher mode: worked gold trajectories (train split) before each "
                         "question, for a teacher not trained on the step format; cut from what "
                         "is written")
    ap.add_argument("--max_concurrency", type=int, default=8,
                    help="--backend chat: requests in flight")
    ap.add_argument("--timeout", type=float, default=remote.REQUEST_TIMEOUT,
                    help="--backend chat: seconds a request may take")
    ap.add_argument("--r1router", default=None,
                    help="import R1-Router's released step-unrolled JSONL")
    ap.add_argument("--export_r1router", default=None,
                    help="convert one of our trajectory files to R1-Router's format")
    ap.add_argument("--max_steps", type=int, default=3)
    ap.add_argument("--max_pairs", type=int, default=1,
                    help="sub-questions a routing step may hold (> 1: multi-query steps)")
    ap.add_argument("--max_rets", type=int, default=1, help="retrievers a sub-question may name")
    ap.add_argument("--topk", type=int, default=3)
    ap.add_argument("--actions", action="store_true",
                    help="a routing step may backtrack or summarise; the gold policy uses them")
    ap.add_argument("--structure", default="transcript", choices=["transcript", "released"],
                    help="transcript: one chat grows with every step; released: a chat a step")
    ap.add_argument("--limit", type=int, default=0,
                    help="only the first N questions of each split (0 = all)")
    ap.add_argument("--offset", type=int, default=0,
                    help="skip the first N questions of each split (before --limit)")
    ap.add_argument("--max_pixels", type=int, default=None,
                    help="VL policy: cap on a picture's pixels (default: the processor's)")
    ap.add_argument("--max_model_len", type=int, default=engines.MAX_LEN,
                    help="teacher mode: the engine's context")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)

def main(args):
    """Write the trajectories of args' source (gold, a teacher, R1-Router's rows) or convert ours to
    R1-Router's; a DataError ends in one line."""
    try:
        if args.export_r1router:
            rows = dataio.read_jsonl(args.export_r1router)
            dataio.write_jsonl(args.out, [to_r1router(x) for x in rows])
            print(f"wrote {len(rows)} rows in R1-Router's step-unrolled format to {args.out}")
            return
        rollout.check_multi_query(args.max_pairs, args.max_rets, args.structure, args.actions)
        from transformers import AutoTokenizer
        if not (Path(args.model) / "tokenizer_config.json").exists():
            sys.exit(f"error: {args.model}: no tokenizer there (run `python prepare.py` for the "
                     f"default)")
        tok = AutoTokenizer.from_pretrained(args.model)
        # a VL policy's transcripts hold the question image and retrieved pictures
        vis = vision.VisionIO.load(args.model, args.max_pixels)
        settings = rollout.Settings(max_steps=args.max_steps, topk=args.topk,
                                    temperature=args.temperature, structure=args.structure,
                                    max_pairs=args.max_pairs, max_rets=args.max_rets,
                                    actions=args.actions)
        gold_settings = replace(settings, route_tokens=1024, answer_tokens=1024)
        fmt = transcript.format_meta(settings)  # the format flags, which settings hold
        if args.r1router:
            import_r1router(args.r1router, args.out, tok, gold_settings, fmt, args.max_pixels)
            return
        import retrievers
        ret = retrievers.make_retriever(args.retriever, args.data)
        engine = teacher_engine(args, settings.max_images) if args.teacher else None
        teach = replace(settings, top_k=args.top_k, route_tries=args.tries,  # the teacher samples
                        answer_tries=args.tries)
        shots = teacher_shots(engine, ret, args.data, args.few_shot, teach, args.actions)
        try:
            for split in args.splits:
                qs = dataio.load_questions(args.data, split)
                qs = qs[args.offset:args.offset + args.limit] if args.limit else qs[args.offset:]
                if engine is None:
                    made = gold_split(tok, vis, ret, qs, gold_settings, args.max_pairs,
                                      args.actions)
                else:
                    made = teacher_split(engine, ret, qs, args.n, teach, args.seed, args.filter,
                                         shots)
                write_split(args.out, split, *made, tok, fmt, args.max_pixels)
        finally:  # main called as a function (the tests) leaves no engine behind
            if engine:
                engine.close()
    except dataio.DataError as e:
        sys.exit(f"error: {e}")

def teacher_shots(engine, ret, data, k, settings, actions):
    """--few_shot k: the teacher's worked examples (evaluate.few_shot_prompt's), None for k = 0."""
    if not k:
        return None
    if engine is None or settings.structure != "transcript" or actions:
        sys.exit("error: --few_shot is a teacher mode flag (--teacher), for --structure "
                 "transcript without --actions")
    import evaluate
    return evaluate.few_shot_prompt(engine.tok, ret, data, k, settings)

def teacher_engine(args, max_images):
    """The teacher's engine: its folder in-process or token-exact on a server, or with --backend
    chat the served model --teacher names behind the local policy's (--model) tokenizer and chat
    format, in which its trajectories are then written."""
    chat = args.backend == "chat"
    return engines.make_engine(args.backend, args.model if chat else args.teacher, seed=args.seed,
                               max_model_len=args.max_model_len, max_pixels=args.max_pixels,
                               max_images=max_images, base_url=args.base_url,
                               api_key=remote.api_key(args.api_key), served=args.teacher,
                               max_concurrency=args.max_concurrency, timeout=args.timeout)

def import_r1router(path, out, tok, settings, fmt, max_pixels):
    """R1-Router's released rows at path replayed by the gold policy into <out>/train.jsonl."""
    qs, ret = read_r1router(path)
    policy = rollout.GoldPolicy(tok, qs, max_pairs=settings.max_pairs)
    trajs = rollout.rollout(policy, ret, qs, s=settings)
    write_trajectories(out, "train", trajs, tok, fmt, max_pixels)
    print(f"imported {len(trajs)} R1-Router trajectories ({sum(x['format_ok'] for x in trajs)} "
          f"well-formed) -> {out}/train.jsonl")

if __name__ == "__main__":
    import retrievers
    CLOCK.started()
    try:
        with CLOCK("compute"):
            main(get_args())
    except retrievers.RetrievalError as e:
        sys.exit(f"error: {e}")
    CLOCK.done()  # the main job's data stage: its seconds and peak memory (runs/stage.sh)
    engines.exit_now()
