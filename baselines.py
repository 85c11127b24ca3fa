"""
baselines.py: the paper's baselines without a router, on the step loop's Trajectories
(evaluate.py --methods):
    no_retrieval  answer_directly(kbs=()): the question alone
    single_rag    answer_directly(kbs=KBS): the question searches every KB once, all evidence in one
                  turn
    iterretgen    answer_directly(iters=3): IterRetGen (Shao et al., 2023), question + last
                  generation as the next query
    ircot         ircot(): IRCoT (Trivedi et al., 2023), one chain-of-thought sentence, one
                  retrieval with it, in turn
Every search goes to every KB, as in R1-Router's baselines without a router: naming a KB is the
routed policy's skill.

    python evaluate.py --model out/demo/sft/final \\
        --methods no_retrieval single_rag iterretgen ircot --n_questions 200
"""
import re
import time

import reward
from dataio import KBS
from rollout import Settings, Trajectory, fits
from transcript import ChatFormat, Transcript, evidence_parts
from vision import Img

DIRECT_PROMPT = ("Answer the question. {evidence}Write <think>reasoning</think><answer>the short "
                 "final answer</answer>.")

def baseline_trajectory(q, format_ok=True):
    """A baseline's Trajectory for question q (no step format: its searches are its steps)."""
    return Trajectory(qid=q["id"], sample=0, question=q["question"], image=q.get("image"),
                      answers=q["answers"], type=q.get("type", ""), gold_steps=q.get("steps", []),
                      format_ok=format_ok)

def finish(x, tr, n_generated):
    """Trajectory x takes transcript tr's tokens (the last round's) and counts n_generated more."""
    x.ids, x.mask, x.logprobs, x.spans, x.segments = (tr.ids, tr.mask, tr.logprobs, tr.spans,
                                                      tr.segments())
    x.images, x.n_policy_tokens = tr.images, x.n_policy_tokens + n_generated

def answered(x, answer, missing):
    """Trajectory x's final answer (None when empty: a format failure, error `missing`)."""
    x.final_answer, x.format_ok, x.error = answer or None, bool(answer), "" if answer else missing

def untagged(text):
    """A baseline's text with the step format's tags removed and its whitespace collapsed."""
    return " ".join(re.sub(r"</?[a-z-]+>", " ", text).split())

def answer_directly(engine, retriever, questions, kbs=(), s=Settings(), seed=None, iters=1):
    """Baselines without routing: no retrieval (kbs=()), single-shot RAG (the question searches
    every KB in `kbs` once, all evidence in one user turn), or, with iters > 1, IterRetGen (Shao et
    al., 2023): iteration t searches every KB with the question plus iteration t-1's generation and
    answers again from the new evidence; the last answer counts. No step format: every search is a
    step of the trajectory (iters x KBs retrievals) whose sub-question is the query. Trajectories as
    rollout()'s; ids/mask/logprobs are the last iteration's, n_policy_tokens all of them."""
    evidence_hint = "Use the retrieved evidence. " if kbs else ""
    fmt, vis = (ChatFormat(engine.tok, DIRECT_PROMPT.format(evidence=evidence_hint)),
                getattr(engine, "vis", None))
    trajs = [baseline_trajectory(q) for q in questions]
    queries, images = [q["question"] for q in questions], [q.get("image") for q in questions]
    for it in range(iters):
        # a visual question's image goes with every image-KB search (the retriever looks)
        t0 = time.perf_counter()
        hits = {kb: retriever.search(queries, kb, s.topk,
                                     **({"images": images} if kb == "image" and any(images)
                                        else {}))
                for kb in kbs}
        t_ret, todo = (time.perf_counter() - t0) / max(1, len(questions)), []
        for i, (q, x) in enumerate(zip(questions, trajs)):
            x.timings["retrieve"] += t_ret
            x.steps += [dict(sub_question=queries[i], kb=kb,
                             retrieved=[d["id"] for d in hits[kb][i]], answer=None, step=it)
                        for kb in kbs]
            tr = Transcript()
            head = [Img(q["image"])] if q.get("image") else []
            tr.add_context(*fmt.encode([fmt.prefix_tpl[0], *head, q["question"]] + [
                p for kb in kbs for p in ["\n\n"] + evidence_parts(kb, hits[kb][i], bool(vis))]
                + [fmt.prefix_tpl[1]], vis))
            if x.overflow:
                continue
            if fits(engine, tr.ids, s.answer_tokens):
                todo.append((i, tr))
            else:  # the evidence does not fit the context: no answer
                x.overflow, x.final_answer, x.ids, x.mask, x.logprobs, x.spans, x.segments = (
                    True, None, [], [], [], [], [])
                x.error = (f"{len(tr.ids)} context + {s.answer_tokens} new tokens exceed the "
                           f"engine's max_len {engine.max_len}")
        t = time.perf_counter()
        outs = engine.generate([tr.ids for _, tr in todo], s.answer_tokens, s.temperature, s.top_p,
                               ["</answer>"], seed, images=[tr.images for _, tr in todo])
        for (i, tr), (ids, lps) in zip(todo, outs):
            x = trajs[i]
            x.timings["generate"] += (time.perf_counter() - t) / len(trajs)
            tr.add_policy(ids, lps, "final", 0)
            text = engine.tok.decode(ids, skip_special_tokens=True)
            a = reward.parse_answer(text)
            # a baseline has no step format to fail: without <answer> tags its whole text (tags
            # removed) is the answer
            plain = untagged(text)
            answer = a.answer if a.ok else plain
            answered(x, answer, "empty answer")
            finish(x, tr, len(ids))
            # IterRetGen's next query: question + generation
            queries[i] = f"{questions[i]['question']} {plain}".strip()
    return trajs

IRCOT_PROMPT = ("Answer the question by reasoning one sentence at a time from the retrieved "
                "evidence. When you know the answer, write: So the answer is: the short answer.")
ANSWER_IS = re.compile(r"answer is:?\s*(.*)", re.IGNORECASE | re.DOTALL)
READER = " So the answer is:"  # IRCoT's chain-of-thought reader: a chain that reached the cap is
                               # asked for its answer

def ircot(engine, retriever, questions, kbs=KBS, s=Settings(), seed=None):
    """IRCoT (Trivedi et al., 2023): one chain-of-thought sentence, one retrieval with that sentence
    as the query, in turn. The question retrieves first; then, at most s.max_steps times, the policy
    writes the chain's next sentence from the question, every paragraph retrieved so far and the
    chain so far (tags a model writes removed): one that says "answer is" ends the chain with its
    answer, any other is the next query. A chain still open after s.max_steps retrievals, or whose
    next sentence is empty, is asked for its answer (READER). Every search goes to every KB in
    `kbs`. Each lookup is a step of the trajectory (its query the sub-question); Trajectories as
    rollout()'s, ids/mask/logprobs the last round's."""
    fmt, vis = ChatFormat(engine.tok, IRCOT_PROMPT), getattr(engine, "vis", None)
    trajs = [baseline_trajectory(q, format_ok=False) for q in questions]
    chains = [[] for _ in questions]  # each question's chain of thought so far
    # its paragraphs retrieved so far: kb -> id -> doc
    docs = [{kb: {} for kb in kbs} for _ in questions]
    read = [False] * len(questions)  # asked for its answer (READER)
    open_, queries = list(range(len(questions))), [q["question"] for q in questions]
    for r in range(s.max_steps + 1):  # rounds 0 .. max_steps - 1 retrieve, the last one only reads
        if not open_:
            break
        searching = [i for i in open_ if not read[i]]
        if r < s.max_steps:
            ircot_search(retriever, [trajs[i] for i in searching], [docs[i] for i in searching],
                         [queries[i] for i in searching], kbs, s, r)
        todo = []
        for i in open_:
            x, q = trajs[i], questions[i]
            evidence = [p for kb in kbs if docs[i][kb]
                        for p in ["\n\n",
                                  *evidence_parts(kb, list(docs[i][kb].values()), bool(vis))]]
            tr = Transcript()
            head = [Img(q["image"])] if q.get("image") else []
            tr.add_context(*fmt.encode([fmt.prefix_tpl[0], *head, f"Question: {q['question']}",
                                        *evidence, fmt.prefix_tpl[1]], vis))
            read[i] = read[i] or r == s.max_steps
            chain = " ".join(chains[i]) + (READER if read[i] else "")
            if chain.strip():
                tr.add_context(fmt.ids(chain.strip()))
            if fits(engine, tr.ids, s.answer_tokens):
                todo.append((i, tr))
            else:
                x.overflow = True
                x.error = (f"round {r + 1}: {len(tr.ids)} context + {s.answer_tokens} new tokens "
                           f"exceed the engine's max_len {engine.max_len}")
        t = time.perf_counter()
        outs = engine.generate([tr.ids for _, tr in todo], s.answer_tokens, s.temperature, s.top_p,
                               ["\n", ". "], seed,
                               images=[tr.images for _, tr in todo]) if todo else []
        open_ = []
        for (i, tr), (ids, lps) in zip(todo, outs):
            x = trajs[i]
            x.timings["generate"] += (time.perf_counter() - t) / len(trajs)
            tr.add_policy(ids, lps, "final" if read[i] else "answer", r)
            finish(x, tr, len(ids))
            sentence = untagged(engine.tok.decode(ids, skip_special_tokens=True))
            said = ANSWER_IS.search(sentence)
            answer = (said.group(1) if said
                      else sentence if read[i] else "").strip().rstrip(".").strip()
            if answer or read[i]:
                answered(x, answer, "no answer")
                continue
            if not sentence:  # the chain has nothing more to say: its answer next round
                read[i] = True
                open_.append(i)
                continue
            chains[i].append(sentence)
            queries[i] = sentence  # the sentence is the next query
            open_.append(i)
    return trajs

def ircot_search(retriever, trajs, collected, queries, kbs, s, r):
    """IRCoT's round r retrieval: each query searches every KB; new paragraphs join the trajectory's
    collection (`collected`: kb -> id -> doc, one a trajectory; the question's image goes with its
    first image-KB search)."""
    t0 = time.perf_counter()
    for kb in kbs:
        images = [x.image if kb == "image" and r == 0 else None for x in trajs]
        hits = retriever.search(queries, kb, s.topk,
                                **({"images": images} if any(images) else {})) if trajs else []
        for x, seen, q, docs in zip(trajs, collected, queries, hits):
            x.steps.append(dict(sub_question=q, kb=kb, retrieved=[d["id"] for d in docs],
                                answer=None, step=r))
            seen[kb].update((d["id"], d) for d in docs if d["id"] not in seen[kb])
    for x in trajs:
        x.timings["retrieve"] += (time.perf_counter() - t0) / max(1, len(trajs))
