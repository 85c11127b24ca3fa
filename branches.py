"""
branches.py: branches at the policy's own states (stepgrpo.py --rollout branch). A trajectory the
policy sampled is replayed up to one of its steps (Replay: its recorded turns, token for token;
Memo: its searches, answered as they were), and that step and everything after it are sampled anew
through the real step loop (rollout.StepLoop), n times: the branches of one group share their prefix
exactly (checked).

    trajs = rollout.rollout(engine, Memo(retriever), qs, s=s)
    ys = branch(engine, ret, qs, trajs, branch_points(trajs, 2, seed), n=8, s=s, seed=seed)
"""
import random

import torch

from rollout import Settings, StepLoop, begin, span_prefix, step_chat


class Replay:
    """The engine of branch(): branch trajectory i of plan[i] = (recorded trajectory, b) gets its
    recorded trajectory's first b policy turns verbatim (ids and logprobs; the step loop's request
    key (i, question id, turn) says which turn is asked for), and its turn b and later from `engine`
    (submit and poll pass through, so the engine batches every branch's new turns). Has an engine's
    tok, vis and max_len."""
    def __init__(self, engine, plan):
        self.engine, self.plan, self.done = engine, plan, []
        self.tok, self.vis, self.max_len = (engine.tok, getattr(engine, "vis", None),
                                            getattr(engine, "max_len", None))

    def submit(self, key, prompt, *rest):
        x, b = self.plan[key[0]]
        if key[2] >= b:
            return self.engine.submit(key, prompt, *rest)
        sp = x.spans[key[2]]
        self.done.append((key, x.ids[sp["start"]:sp["end"]], x.logprobs[sp["start"]:sp["end"]]))

    def poll(self):
        """The replayed turns at once; else the engine's finished requests."""
        done, self.done = self.done, []
        return done or self.engine.poll()

class Memo:
    """A retriever that answers a query it was asked before (text, KB, k, query image) as it did
    then: a branch's replayed steps see their trajectory's evidence exactly, in whatever batch their
    search runs (a GPU encoder's embeddings may change in the last bits with the batch), and
    branches asking the same sub-question search once."""
    def __init__(self, retriever):
        self.retriever, self.seen = retriever, {}

    def search(self, queries, kb, k=3, images=None):
        keys = [(q, kb, k, im) for q, im in zip(queries, images or [None] * len(queries))]
        todo = list(dict.fromkeys(key for key in keys if key not in self.seen))
        if todo:
            ims = [im for *_, im in todo]
            self.seen.update(zip(todo, self.retriever.search(
                [q for q, *_ in todo], kb, k, **({"images": ims} if any(ims) else {}))))
        return [self.seen[key] for key in keys]

def branch_points(trajs, k, seed):
    """[(trajectory index, span index)]: every span of a trajectory with at most k of them, else k
    of its spans drawn without replacement by a generator seeded with `seed` alone (reproducible,
    and the same on any rank)."""
    rng = random.Random(seed)
    return [(j, b) for j, x in enumerate(trajs)
            for b in (range(len(x["spans"])) if len(x["spans"]) <= k
                      else sorted(rng.sample(range(len(x["spans"])), k)))]

def branch(engine, retriever, questions, trajs, picks, n, s=Settings(), seed=None):
    """For each (j, b) of picks, n trajectories that replay trajs[j] (rollout() of `questions` with
    settings s) up to its span b, sample that step anew from its prefix and go on to the end
    (retrieval, the next steps, the final answer) through the real step loop: a Replay of `engine`,
    and `retriever` (a Memo, which rollout() used too, so the replay is token-exact: checked).
    Returns len(picks) * n Trajectories (pick-major), each with base j, branch b, new_tokens (its
    tokens from span b on) and generated (the policy tokens among them)."""
    chat, by_id = step_chat(engine, s), {q["id"]: q for q in questions}
    plan = [(trajs[j], b) for j, b in picks for _ in range(n)]
    lives = [begin(by_id[trajs[j].qid], k, chat, s) for j, b in picks for k in range(n)]
    if seed is not None:  # engines sample with torch's default generator (see VLLMEngine.generate)
        torch.manual_seed(seed)
    ys = StepLoop(Replay(engine, plan), retriever, s, chat).run(lives)
    for y, (j, b) in zip(ys, [p for p in picks for _ in range(n)]):
        x, start = trajs[j], trajs[j].spans[b]["start"]
        if y.ids[:start] != x.ids[:start] or y.spans[:b] != x.spans[:b] or len(y.spans) <= b:
            raise RuntimeError(f"{x.qid}: the replay of its trajectory up to span {b} is not the "
                               "trajectory (a retriever that answers a query two ways?)")
        y.base, y.branch, y.new_tokens, y.generated = j, b, len(y.ids) - start, sum(y.mask[start:])
    return ys

def branch_group(group):
    """(prompt ids before the branched span, the images in them, [(the span's ids, logprobs)] a
    branch) of a group of rollout.branch trajectories at one prefix (their tokens before the span
    are one trajectory's: branch checks)."""
    spans = [y.spans[y.branch] for y in group]
    return (*span_prefix(group[0], spans[0]),
            [(y.ids[sp["start"]:sp["end"]], y.logprobs[sp["start"]:sp["end"]])
             for y, sp in zip(group, spans)])
