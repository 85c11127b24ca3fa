"""
rollout.py: step-wise routed reasoning, batched: the step loop and the step structures. The prompts
are in prompts.py, engines (vLLM, HF) in engines.py, the transcript in transcript.py, image input in
vision.py, the baselines without a router (single-shot RAG, IterRetGen, IRCoT) in baselines.py.

For a batch of questions x n samples, every trajectory runs its own step loop:
    route   the policy writes <think>..</think><sub-question>..</sub-question><ret>KB|None</ret>
            (Settings max_pairs K > 1: up to K sub-question / KB pairs, RAG-R1's parallel queries,
            and the step ends with the policy's end of turn; max_rets R > 1: a pair may name up to R
            KBs, R1-Router's multi-retriever mode)
    search  every lookup (sub-question, KB) routed to one KB goes to retrievers.py in one batch; the
            top-k come back as a user turn, grouped by sub-question when the step asked several
    answer  the policy writes <think>..</think><answer>..</answer> (the intermediate answer,
            covering all lookups)
... at most --max_steps times (3, as the paper); after <ret>None</ret> (or the last step) the policy
writes the final <think>..</think><answer>..</answer>. With Settings actions (--actions: Agentic
RAG-R1's memory stack), a routing step may instead backtrack (<backtrack>why</backtrack>: the last
routing step, its evidence and its answer leave the context, and its step is asked again) or
summarise (<summary>S</summary>: every step so far leaves the context, S stays), at most max_actions
times; either starts a new chat of what stays, the action's own turn closing it. A step that does
not parse ends its trajectory with a format failure (or, with Settings route_tries / answer_tries /
fallback, R1-Router's released evaluation: tries again, then stops or takes the raw text).
The loop is event-driven (StepLoop): on vLLM a trajectory's next request enters the running batch as
soon as its previous one finishes (and its search returns), so short steps never wait for the
longest one of a phase. Engines that run a batch at a time (HF, GoldPolicy) advance phase by phase
through the same code. branches.py runs the same loop from a sampled trajectory's own states
(stepgrpo.py --rollout branch). What a trajectory holds is the Trajectory dataclass (its JSONL row:
the same fields); while the loop runs it, a Live holds it with its transcript, its phase and the
loop's other working state; a row of stepgrpo.py's wandb tables shows it as a Sample, a line a step.

The transcript is a chat: system prompt, question, then alternating assistant turns (the policy's,
mask 1) and user turns (retrieved evidence and template tokens, mask 0). --structure released is
R1-Router's released step structure instead: each step is its own single-turn chat (ReleasedSteps),
and a trajectory's `segments` mark its chats.
A VL policy sees a visual question's image in its first user turn and retrieved pictures next to
their captions; whatever the policy, the question's image goes to the image KB with the trajectory's
first image-KB search.

    python rollout.py --model models/SmolLM2-135M-Instruct --data data/mini --split dev \\
        -n 2 --n_questions 3
    python rollout.py ... --backend hf          # plain transformers generate instead of vLLM
    python rollout.py ... --max_pairs 2         # multi-query steps (a policy trained on them:
                                                  synth.py)
    python rollout.py ... --structure released  # R1-Router's released structure (a policy trained
                                                  on it)
"""
import argparse
import itertools
import os
import sys
import time
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import torch

import reward
from dataio import KB_OF, KBS
from engines import CPU_KV_TOKENS, Batched, make_engine
from prepare import DEFAULT_MODEL
from prompts import (ACTIONS_NOTE, LAST_STEP_NOTE, RELEASED_ANSWER_PROMPT, RELEASED_FINAL_PROMPT,
                     RELEASED_REMINDER, RELEASED_ROUTE_PROMPT, SYSTEM_PROMPT)
from transcript import ChatFormat, Transcript, evidence_parts, next_turn, start_transcript
from vision import Img, images_in

os.environ.setdefault("HF_HUB_OFFLINE", "1")

@dataclass(eq=False)
class Trajectory(Mapping):
    """One sampled attempt at a question, as the step loop (or a baseline) leaves it: what the
    rewards, the trainers, the metrics and the JSONL files read. Its JSONL row is its fields in this
    order, the extras at the end only when set. It reads as that row too (x["steps"], x.get("rag"),
    x.items(); like transformers' ModelOutput), so the metrics and the report read a Trajectory and
    a row loaded from disk alike; x[key] = v sets a field (an unknown key is a KeyError)."""
    qid: str
    sample: int               # k of the question's n samples
    question: str
    image: str | None         # the question's picture (a path), or None
    answers: list             # the gold answers (empty for a served question)
    type: str                 # the question's kind (1hop, 2hop, ...)
    gold_steps: list          # the gold steps, grouped as the policy writes them
                              # (reward.group_steps)
    steps: list = field(default_factory=list)  # a lookup each: sub_question, kb, retrieved, answer,
                                               # step
    final_answer: str | None = None
    format_ok: bool = True    # every turn parsed
    error: str = ""           # why it ended without an answer, or what a fallback took
    overflow: bool = False    # its next request did not fit the context: ended without an answer
    evidence: list = field(default_factory=list)  # every retrieved document's contents, as seen
    actions: list = field(default_factory=list)   # backtracks and summaries taken (StepLoop.act)
    ids: list = field(default_factory=list)       # [T] the transcript's token ids
    mask: list = field(default_factory=list)      # [T] 1 where the policy wrote the token
    logprobs: list = field(default_factory=list)  # [T] the sampler's logprob of each policy token
    spans: list = field(default_factory=list)     # the policy's turns: kind, step, start, end
    segments: list = field(default_factory=list)  # [[start, end]] of each chat
    images: list = field(default_factory=list)   # [[position, tokens, path]] of its pictures
    n_policy_tokens: int = 0
    timings: dict = field(default_factory=lambda: dict(generate=0.0, retrieve=0.0))
    # extras, set by what reads the trajectory (None: not set, not in the row)
    rag: float | None = None         # the judged RAG reward (steprewards.judge_rag)
    judge: float | None = None       # the judge's rating of the final answer (evaluate.py)
    base: int | None = None          # branches.branch: the sampled trajectory it replays,
    branch: int | None = None        # the span it branches at,
    new_tokens: int | None = None    # its tokens from that span on,
    generated: int | None = None     # and the policy's among them

    def __getitem__(self, key):
        if key not in FIELDS or key in EXTRAS and getattr(self, key) is None:
            raise KeyError(key)
        return getattr(self, key)

    def __setitem__(self, key, value):
        if key not in FIELDS:
            raise KeyError(f"{key}: not a field of a Trajectory")
        setattr(self, key, value)

    def __iter__(self):
        return (k for k in FIELDS if k not in EXTRAS or getattr(self, k) is not None)

    def __len__(self):
        return sum(1 for _ in self)

FIELDS = tuple(f.name for f in fields(Trajectory))
EXTRAS = FIELDS[FIELDS.index("rag"):]

@dataclass(eq=False)
class Live:
    """A trajectory in the step loop, and what the loop keeps only while it runs."""
    traj: Trajectory
    tr: Transcript
    head: int                 # tokens of the system prompt and the question: every chat starts so
    phase: str = "route"      # route | search | answer | final | done: what it asks for next
    frames: list = field(default_factory=list)  # the routing steps in the context: step, span,
                                                # start
    tries: int = 0            # malformed attempts at this turn so far
    image_sent: bool = False  # the question's picture went with an image-KB search
    cancelled: bool = False   # its client left (StepLoop.cancel)
    temperature: float | None = None  # a request's own sampling (serve.py); None: the Settings'
    top_p: float | None = None
    hits: list = field(default_factory=list)  # this search's (lookup, sub_question, kb, docs)

class GoldPolicy(Batched):
    """Writes the gold decomposition as policy turns (templated <think>), through the real step loop
    and retrieval: synth.py's golden trajectories, and a known-good policy for tests. Each request's
    key says where its trajectory stands: (trajectory, question id, the policy turns it has had)
    from the step loop, turn_key at a stored prefix; the turns alternate route, answer (R1-Router's
    order in both structures), the phase asked for is in the stop string (a final answer may follow
    a route: max_steps reached)."""
    # the routing <think> names no KB: the choice is made at <ret>, after the sub-question
    THINK = "The next fact to look up."

    def __init__(self, tok, questions, vis=None, max_pairs=1, actions=False):
        self.tok, self.vis, self.max_pairs, self.actions = tok, vis, max_pairs, actions
        self.by_id = {q["id"]: q for q in questions}

    def plan(self, q):
        """The routing steps written for q, grouped by step (reward.by_step): the gold
        decomposition."""
        return reward.by_step(reward.group_steps(q["steps"], self.max_pairs))

    def script(self, q):
        """q's policy turns in order, [(phase, text)]: each gold step's route and intermediate
        answer, the stop, the final answer. With actions, where they help: a quarter of the
        questions (by a hash of the id) first ask their first sub-question of a wrong KB, answer
        that the evidence does not say, and backtrack; a question with a third hop summarises the
        first two steps' evidence before it."""
        gold, turns = self.plan(q), []
        for t, g in enumerate(gold):
            if self.actions and t == 0 and zlib.crc32(q["id"].encode()) % 4 == 0:
                wrong = KBS[(KBS.index(g[0]["kb"]) + 1) % len(KBS)]
                turns += [
                    ("route", reward.format_route(self.THINK, [(g[0]["sub_question"], wrong)])),
                    ("answer", reward.format_answer("The evidence does not say.", "not found")),
                    ("route",
                     reward.format_action(f"The {reward.KB_TO_RET[wrong]} did not have it.",
                                          "backtrack", f"No answer to: {g[0]['sub_question']}"))]
            if self.actions and t == 2:
                facts = " ".join(f"{st['sub_question']} {st['answer']}."
                                 for h in gold[:2] for st in h)
                turns.append(("route", reward.format_action("The facts so far.", "summary", facts)))
            turns += [("route", reward.format_route(self.THINK, reward.pairs_of(g))),
                      ("answer", reward.format_answer("From the evidence.",
                                                      reward.group_answer(g)))]
        return turns + [("route", reward.format_route("I can answer now.", [])),
                        ("answer", reward.format_answer("Combining the answers.", q["answers"][0]))]

    def step_text(self, q, turn, phase):
        """The scripted step's text at policy turn `turn` (0: the first) of question q, phase route
        or answer: an answer asked where the script routes is the final answer (the loop asks for it
        at max_steps)."""
        turns = self.script(q)
        kind, text = turns[turn] if turn < len(turns) else turns[-2]
        return turns[-1][1] if phase == "answer" and kind == "route" else text

    def generate(self, prompts, max_tokens, temperature=1.0, top_p=1.0, stop=(), seed=None, top_k=0,
                 images=None, keys=None):
        if keys is None:
            raise ValueError("GoldPolicy writes from each request's key (trajectory, question id, "
                             "turn): pass keys")
        phase = "answer" if "</answer>" in stop else "route"
        res = []
        for _, qid, turn in keys:
            ids = self.tok.encode(self.step_text(self.by_id[qid], turn, phase),
                                  add_special_tokens=False)
            # a multi-query route (max_pairs > 1) ends with the end-of-turn token, ids not text
            ids = (ids + [self.tok.eos_token_id]
                   * (phase == "route" and self.max_pairs > 1))[:max_tokens]
            res.append((ids, [0.0] * len(ids)))
        return res

def turn_key(x, sp):
    """The request key of the prompt before span `sp` of trajectory `x` (a Trajectory or its row),
    as the step loop names its requests."""
    return (None, x["qid"], x["spans"].index(sp))

# --------------------------------------------------------------------------------------------------
# The step loop

class TranscriptSteps:
    """--structure transcript (default): one chat grows with every step. What follows the policy's
    turn at each point of the loop (both structures have these five methods)."""
    def __init__(self, tok, system_prompt, shots=None, vis=None):
        self.fmt, self.shots, self.vis = ChatFormat(tok, system_prompt), shots, vis

    def start(self, x):
        """Trajectory x's transcript: the system prompt and its question."""
        return start_transcript(self.fmt, x.question, self.shots, x.image, self.vis)

    def restart(self, live, keep, turn):
        """An action (backtrack, summary): the chat is closed and a new one holds its tokens up to
        the absolute position `keep`, then the action's turn `turn` (ids) as context, then the next
        assistant turn."""
        tr = live.tr
        a = tr.starts[-1]
        tr.add_context(self.fmt.ids(self.fmt.end_assistant))
        tr.new_chat(tr.ids[a:keep], images_in(tr.images, a, keep))
        tr.add_context(turn + self.fmt.ids(next_turn(self.fmt)))

    def close(self, live, ids, images=()):
        """Template tokens after a turn; a turn the policy ended itself (a multi-query route stops
        at its end-of-turn token) does not get the template's end of turn twice."""
        tr = live.tr
        if tr.mask[-1] and ids and tr.ids[-1] == ids[0] == self.fmt.tok.eos_token_id:
            ids, images = ids[1:], [[a - 1, n, path] for a, n, path in images]
        tr.add_context(ids, images)

    def after_stop(self, live):
        self.close(live, self.fmt.ids(next_turn(self.fmt)))

    def after_search(self, live, hits):
        """hits: [(sub_question, kb, docs)] of the lookups of the last routing step, in the order
        asked; the evidence is the next user turn (a VL policy sees image documents' pictures too),
        under a "Sub-question k:" line per sub-question when the step asked several."""
        subs = list(dict.fromkeys(q for q, _, _ in hits))
        parts = []
        for j, (q, kb, d) in enumerate(hits):
            head = len(subs) > 1 and (j == 0 or q != hits[j - 1][0])
            parts += (["\n\n"] * (j > 0) + [f"Sub-question {subs.index(q) + 1}: {q}\n"] * head
                      + evidence_parts(kb, d, bool(self.vis)))
        self.close(live, *self.fmt.encode(next_turn(self.fmt, parts), self.vis))

    def after_answer(self, live, last):
        live.tr.add_context(self.fmt.ids(next_turn(self.fmt, LAST_STEP_NOTE if last else None)))

    def after_final(self, live):
        # a complete chat, as sft.py trains on
        live.tr.add_context(self.fmt.ids(self.fmt.end_assistant))

    def remind(self, live, text):
        self.close(live, self.fmt.ids(next_turn(self.fmt, text)))

class ReleasedSteps:
    """--structure released: every step is its own single-turn chat, as R1-Router's released
    inference code builds it. route: the original question and the earlier sub-question / answer
    pairs, no passages; answer: the passages and the sub-question only; final: the question and the
    pairs. A chat ends with the template's end of turn. A VL policy gets a visual question's image
    at the head of every chat (the released code gives each step the image)."""
    def __init__(self, tok, vis=None):
        self.route, self.answer, self.final = (ChatFormat(tok, p) for p in
                                               (RELEASED_ROUTE_PROMPT, RELEASED_ANSWER_PROMPT,
                                                RELEASED_FINAL_PROMPT))
        self.vis = vis

    def chat(self, fmt, x, *parts):
        """(ids, images) of a single-turn chat of trajectory x whose user turn is parts."""
        head = [Img(x.image)] if x.image and self.vis else []
        return fmt.encode([fmt.prefix_tpl[0], *head, *parts, fmt.prefix_tpl[1]], self.vis)

    @staticmethod
    def history(x):
        return f"Origin question: {x.question}\n" + "".join(
            f"Sub-question{k + 1}: {st['sub_question']}\nAnswer{k + 1}: {st['answer']}\n"
            for k, st in enumerate(x.steps))

    def next_chat(self, live, chat):
        live.tr.add_context(self.final.ids(self.final.end_assistant))
        live.tr.new_chat(*chat)

    def final_chat(self, x):
        return self.chat(self.final, x,
                         self.history(x) + "Based on the information above, give me the final "
                                           f"answer of the origin question: {x.question}")

    def start(self, x):
        tr = Transcript()
        tr.new_chat(*self.chat(self.route, x, self.history(x)))
        return tr

    def after_stop(self, live):
        self.next_chat(live, self.final_chat(live.traj))

    def after_search(self, live, hits):
        found = [p for _, kb, docs in hits for i, d in enumerate(docs)
                 for p in [f"{KB_OF[kb].tag}-{i}: "]
                 + ([Img(d["path"])] if self.vis and d.get("path") else [])
                 + [f"{d['contents']}\n"]]
        x = live.traj
        self.next_chat(live, self.chat(self.answer, x,
                                       "According to the related information searched, `ter` means "
                                       "this info is from text retriever, `tir` means this info is "
                                       "from text image retriever, `tar` means this info is from "
                                       "table retriever:", *found,
                                       "\n\n Give me the answer(with the format <answer></answer>) "
                                       f"to the Question: {x.steps[-1]['sub_question']}"))

    def after_answer(self, live, last):
        x = live.traj
        self.next_chat(live, self.final_chat(x) if last
                       else self.chat(self.route, x, self.history(x)))

    def after_final(self, live):
        live.tr.add_context(self.final.ids(self.final.end_assistant))

    def remind(self, live, text):
        live.tr.add_context(self.route.ids(next_turn(self.route, text)))

TRAJECTORY_TOKENS = 1024  # the KV cache a trajectory in flight is given, one document a search:
                          # the mini-world's golden ones hold 504 tokens on average, 786 at most;
                          # past the cache vLLM queues, never refuses
EVIDENCE_TOKENS = 128  # a further document a search returns (the mini-world's, numbered: text 45
                       # tokens on average, tables 105, captions 34; 171 at most)

def trajectory_tokens(s, kbs=1):
    """The KV cache a text policy's trajectory in flight is given: TRAJECTORY_TOKENS with one
    document a search, EVIDENCE_TOKENS a step more for each further one (topk x max_pairs x
    max_rets from each of `kbs` KBs)."""
    docs = s.topk * s.max_pairs * s.max_rets * kbs
    return TRAJECTORY_TOKENS + (docs - 1) * s.max_steps * EVIDENCE_TOKENS

def kv_tokens(s, trajectories, kbs=1):
    """The KV cache (tokens) for `trajectories` of a text policy, at most s.max_active in flight
    (trajectory_tokens each); at most CPU_KV_TOKENS (evaluate.py's engine)."""
    return min(min(trajectories, s.max_active) * trajectory_tokens(s, kbs), CPU_KV_TOKENS)

@dataclass
class Settings:
    max_steps: int = 3          # sub-questions before the final answer is forced (paper: 3)
    topk: int = 3               # evidence documents per sub-question
    route_tokens: int = 96      # max new tokens of a routing step
    answer_tokens: int = 96     # max new tokens of an answer step
    temperature: float = 1.0
    top_p: float = 1.0
    route_mode: str = "model"   # model | oracle (gold KB at each gold step) | all (every KB:
                                # evaluate.py every_kb)
    structure: str = "transcript"  # transcript (one growing chat) | released (a single-turn chat a
                                   # step: ReleasedSteps)
    top_k: int = 0              # sampling top-k (0: off)
    route_tries: int = 1        # attempts at a routing step (R1-Router's released evaluation: 5)
    answer_tries: int = 1       # attempts at an answer step (released: 3)
    fallback: bool = False      # out of attempts: stop routing / take the raw text as the answer
                                # (released), not a format failure
    max_active: int = 64        # trajectories in flight at once: more overflow the KV cache, and
                                # vLLM then recomputes
    max_pairs: int = 1          # sub-question / retriever pairs a routing step may hold (RAG-R1's
                                # parallel queries)
    max_rets: int = 1           # retrievers a pair may name (R1-Router's multi-retriever mode)
    actions: bool = False       # a routing step may backtrack or summarise (Agentic RAG-R1's memory
                                # stack)
    max_actions: int = 2        # of them a trajectory

    @property
    def max_images(self):
        """Pictures one prompt can hold: the question's and every evidence document of every step (a
        VL engine is built for this many: vLLM refuses a prompt with more than its
        limit_mm_per_prompt)."""
        return 1 + self.max_steps * self.topk * self.max_pairs * self.max_rets

def check_multi_query(max_pairs, max_rets, structure, actions):
    """One-line errors for --max_pairs / --max_rets (every script that takes them)."""
    if max_pairs < 1 or max_rets < 1:
        sys.exit(f"error: --max_pairs {max_pairs} --max_rets {max_rets}: each must be at least 1")
    if max_rets > len(KBS):
        sys.exit(f"error: --max_rets {max_rets}: there are {len(KBS)} retrievers")
    if structure == "released" and (max_pairs > 1 or max_rets > 1):
        sys.exit("error: --max_pairs / --max_rets > 1 (multi-query steps) work with --structure "
                 "transcript only")
    if structure == "released" and actions:
        sys.exit("error: --actions (backtrack, summary) work with --structure transcript only")

def route_stop(tok, s):
    """(stop strings, max new tokens) of a routing step: R1-Router's step ends at </ret>; a
    multi-query step, which may write up to max_pairs pairs, ends when the policy ends its turn (the
    end-of-turn token)."""
    acts = [f"</{a}>" for a in reward.ACTIONS] if s.actions else []
    if s.max_pairs == 1:
        return ["</ret>", *acts], s.route_tokens
    return [tok.eos_token, *acts], s.route_tokens * s.max_pairs

def fits(engine, ids, max_tokens):
    """Whether a prompt plus max_tokens new tokens fits the engine's context (engines without
    max_len: always)."""
    return getattr(engine, "max_len", None) is None or len(ids) + max_tokens <= engine.max_len

class StepLoop:
    """The step loop of one rollout() call: what happens when a request finishes (on_route,
    on_answer, on_final), the batched search between steps, and the event loop that keeps the engine
    busy (run). It works on Live trajectories. events(live, kind, hits): a callback after each step
    of a trajectory, kind route | search (hits: [(sub_question, kb, docs)]) | answer | final |
    overflow | cancel (serve.py streams them). live: index -> each Live of the running loop not yet
    ended."""
    def __init__(self, engine, retriever, s, chat, bar=None, events=None):
        self.engine, self.retriever, self.s, self.chat, self.bar = engine, retriever, s, chat, bar
        self.events = events or (lambda live, kind, hits=None: None)
        self.live = {}

    @staticmethod
    def cancel(live):
        """End a Live trajectory at its next turn, before its next request or when the one in flight
        returns (a server's client left); safe from another thread. It ends as an error, with an
        event (cancel)."""
        live.cancelled = True

    def cancelled(self, live):
        """Whether `live` was cancelled; the first time the loop asks, it ends (its event:
        cancel)."""
        if live.cancelled and live.phase != "done":
            live.phase, live.traj.error = "done", "cancelled: the client left"
            self.events(live, "cancel")
        return live.cancelled

    def fail(self, live, what):
        live.traj.format_ok, live.traj.error, live.phase = False, what, "done"

    def retry(self, live, tries):
        """Whether to sample a malformed step again (route_tries / answer_tries > 1: R1-Router's
        released evaluation). The attempt is dropped; a third malformed route stays as context,
        followed by the released reminder."""
        live.tries += 1
        if live.tries >= tries:
            live.tries = 0
            return False
        ids = live.tr.undo()
        if live.phase == "route" and live.tries == 3:
            live.tr.add_context(ids)
            self.chat.remind(live, RELEASED_REMINDER)
        return True

    @staticmethod
    def n_steps(x):
        """Routing steps trajectory x has taken (a multi-query step's lookups share one)."""
        return x.steps[-1]["step"] + 1 if x.steps else 0

    def on_route(self, live, ids, lps):
        x, s, step = live.traj, self.s, self.n_steps(live.traj)
        live.tr.add_policy(ids, lps, "route", step)
        r = reward.parse_route(self.engine.tok.decode(ids, skip_special_tokens=True), s.max_pairs,
                               s.max_rets, s.actions)
        if not r.ok:
            if self.retry(live, s.route_tries):
                return
            if not s.fallback:
                return self.fail(live, f"step {step + 1} route: {r.error}")
            x.error += f"step {step + 1} route: {r.error} (stopped after {s.route_tries} tries); "
            r = reward.Route(ok=True, stop=True)  # out of tries: stop routing
        live.tries = 0
        if r.action:
            return self.act(live, r, step)
        if r.stop:
            self.chat.after_stop(live)
            live.phase = "final"
            return
        live.frames.append(dict(step=step, span=len(live.tr.spans) - 1,
                                start=live.tr.spans[-1]["start"]))
        gold = reward.by_step(x.gold_steps)
        gold = gold[step] if step < len(gold) else []
        # one lookup per (sub-question, KB); oracle: the gold step's KB
        for j, (q, kbs) in enumerate(r.pairs):
            for kb in (gold[j]["kb"],) if s.route_mode == "oracle" and j < len(gold) else kbs:
                x.steps.append(dict(sub_question=q, kb=kb, retrieved=[], answer=None, step=step))
        live.phase = "search"

    def act(self, live, r, step):
        """A backtrack pops the last routing step in the context (its lookups move to the action's
        `popped`, its spans are marked popped, and its step is asked again); a summary drops every
        step in the context (the action's `facts`: the steps it should hold). Either restarts the
        chat (TranscriptSteps.restart). Too many actions, or one with no step in the context to act
        on, is a format failure."""
        x, tr, frames = live.traj, live.tr, live.frames
        sp = tr.spans[-1]
        sp["kind"] = r.action
        if len(x.actions) >= self.s.max_actions:
            return self.fail(live, f"step {step + 1} {r.action}: more than {self.s.max_actions} "
                                   "actions")
        if not frames:
            return self.fail(live, f"step {step + 1} {r.action}: no step in the context to act on")
        act = dict(kind=r.action, step=step, span=len(tr.spans) - 1, note=r.note)
        if r.action == "backtrack":
            f = frames.pop()
            act["popped"] = [st for st in x.steps if st["step"] == f["step"]]
            x.steps = [st for st in x.steps if st["step"] != f["step"]]
            act["popped_spans"] = list(range(f["span"], len(tr.spans) - 1))
            for other in tr.spans[f["span"]:-1]:
                other["popped"] = True
            keep = f["start"]
        else:
            act["facts"] = [dict(st) for st in x.steps]
            frames.clear()
            keep = tr.starts[-1] + live.head
        x.actions.append(act)
        a = tr.starts[-1]
        self.chat.restart(live, keep, tr.ids[sp["start"]:sp["end"]])
        for f in frames:  # the steps that stay are at the head of the new chat
            f["start"] += tr.starts[-1] - a

    def answer_or_retry(self, live, ids, where):
        """The parsed answer, or None after a retry or a format failure; out of tries with
        Settings.fallback, the whole raw text is the answer (as answer_generation.py returns it; its
        second try's dropped system prompt is not reproduced)."""
        text = self.engine.tok.decode(ids, skip_special_tokens=True)
        a = reward.parse_answer(text)
        if a.ok:
            live.tries = 0
            return a
        if self.retry(live, self.s.answer_tries):
            return None
        if not self.s.fallback:
            return self.fail(live, f"{where}: {a.error}")
        live.traj.error += f"{where}: {a.error} (raw text after {self.s.answer_tries} tries); "
        return reward.Answer(ok=True, answer=text.strip())

    def on_answer(self, live, ids, lps):
        step = self.n_steps(live.traj) - 1
        live.tr.add_policy(ids, lps, "answer", step)
        a = self.answer_or_retry(live, ids, f"step {step + 1} answer")
        if a is None:
            return
        for st in live.traj.steps:
            if st["step"] == step:  # the answer covers every lookup of the step
                st["answer"] = a.answer
        last = step + 1 == self.s.max_steps  # out of sub-questions: ask for the final answer
        self.chat.after_answer(live, last)
        live.phase = "final" if last else "route"

    def on_final(self, live, ids, lps):
        live.tr.add_policy(ids, lps, "final", len(live.traj.steps))
        a = self.answer_or_retry(live, ids, "final answer")
        if a is None:
            return
        live.traj.final_answer, live.phase = a.answer, "done"
        self.chat.after_final(live)

    def query_image(self, live, kb):
        """A visual question's image goes with the trajectory's first image-KB search (R1-Router's
        first step: what is shown?), whatever the policy: the retriever, not the policy, looks."""
        if kb != "image" or not live.traj.image or live.image_sent:
            return None
        live.image_sent = True
        return live.traj.image

    def search(self, batch):
        """Every lookup of the last routing step of every Live in `batch`: one batched search per
        KB (every KB for every lookup in route_mode=all)."""
        todo = [(live, j, st) for live in batch for j, st in enumerate(live.traj.steps)
                if st["step"] == self.n_steps(live.traj) - 1]
        for kb in KBS:
            group = [(live, j, st) for live, j, st in todo
                     if self.s.route_mode == "all" or st["kb"] == kb]
            if group:
                images = [self.query_image(live, kb) for live, _, _ in group]
                hits = self.retriever.search([st["sub_question"] for _, _, st in group], kb,
                                             self.s.topk,
                                             **({"images": images} if any(images) else {}))
                for (live, j, st), docs in zip(group, hits):
                    live.hits.append((j, st["sub_question"], kb, docs))
                    st["retrieved"] += [d["id"] for d in docs]
                    live.traj.evidence += [d["contents"] for d in docs]
        for live in batch:
            # in the order asked (stable: KB order within a lookup)
            hits = [h[1:] for h in sorted(live.hits, key=lambda h: h[0])]
            live.hits = []
            self.chat.after_search(live, hits)
            live.phase = "answer"
            self.events(live, "search", hits)

    def request(self, i, live):
        """Send Live `i`'s next request, or end it (False) when it was cancelled or its prompt
        plus the new tokens do not fit the engine's context (long evidence, tables: the batch goes
        on; not a format failure: every span written so far parsed, and is scored so; no final
        answer)."""
        if self.cancelled(live):
            return False
        s, x = self.s, live.traj
        stop, max_tokens = route_stop(self.engine.tok, s) if live.phase == "route" else \
            (["</answer>"], s.answer_tokens)
        prompt = live.tr.prompt()  # the whole transcript, or (released) this step's chat
        if not fits(self.engine, prompt, max_tokens):
            x.overflow = True
            x.error = (f"step {len(x.steps) + 1} {live.phase}: {len(prompt)} context + "
                       f"{max_tokens} new tokens exceed the engine's max_len {self.engine.max_len}")
            live.phase = "done"
            self.events(live, "overflow")
            return False
        temperature = s.temperature if live.temperature is None else live.temperature
        top_p = s.top_p if live.top_p is None else live.top_p
        self.engine.submit((i, x.qid, len(live.tr.spans)), prompt, max_tokens, temperature, top_p,
                           stop, s.top_k, live.tr.prompt_images())
        return True

    def run(self, lives, more=None):
        """Every Live's step loop, event-driven (module docstring); the finished Trajectories.
        Lives in `ready` need their next request (after a search, if their route named a KB). more:
        a callable that returns Lives arrived since its last call (a server's), admitted while the
        others run; they are the caller's (their events told it everything), so the loop lets go of
        each as it ends (a long-running server holds only the trajectories in flight) and returns
        those of `lives` only."""
        handlers = dict(route=self.on_route, answer=self.on_answer, final=self.on_final)
        live = self.live = dict(enumerate(lives))  # index -> Live, until it ends
        n = len(lives)
        waiting = iter(range(n))  # a new trajectory starts whenever one ends
        ready, busy, t_gen, t_ret = list(itertools.islice(waiting, self.s.max_active)), 0, 0., 0.
        t0 = time.perf_counter()
        while True:
            new = more() if more is not None else []
            if new:  # arrivals queue behind the trajectories still waiting
                live.update(zip(range(n, n + len(new)), new))
                waiting = itertools.chain(waiting, range(n, n + len(new)))
                n += len(new)
                ready += list(itertools.islice(waiting,
                                               max(0, self.s.max_active - busy - len(ready))))
            if not (ready or busy):
                break
            t = time.perf_counter()
            self.search([live[i] for i in ready
                         if live[i].phase == "search" and not live[i].cancelled])
            t_ret += time.perf_counter() - t
            sent = [i for i in ready if self.request(i, live[i])]
            for i in set(ready) - set(sent):
                del live[i]
            busy, t = busy + len(sent), time.perf_counter()
            ready = list(itertools.islice(waiting, len(ready) - len(sent)))
            for (i, *_), ids, lps in self.engine.poll():
                busy -= 1
                if not self.cancelled(live[i]):
                    kind = live[i].phase
                    handlers[kind](live[i], ids, lps)
                    self.events(live[i], kind)
                if live[i].phase != "done":
                    ready.append(i)
                else:
                    del live[i]
                    ready += list(itertools.islice(waiting, 1))
            t_gen += time.perf_counter() - t
            if self.bar is not None:  # a tqdm bar counting finished trajectories
                self.bar.update(sum(lv.phase == "done" for lv in lives) - self.bar.n)
        for lv in lives:
            tr, x = lv.tr, lv.traj
            x.ids, x.mask, x.logprobs, x.spans = tr.ids, tr.mask, tr.logprobs, tr.spans
            x.segments, x.images, x.n_policy_tokens = tr.segments(), tr.images, sum(tr.mask)
            # amortised over the batch
            x.timings = dict(generate=t_gen / len(lives), retrieve=t_ret / len(lives))
        if lives:
            lives[0].traj.timings["batch_wall"] = time.perf_counter() - t0
        return [lv.traj for lv in lives]

def rollout(engine, retriever, questions, n=1, s=Settings(), seed=None, system_prompt=SYSTEM_PROMPT,
            shots=None, bar=None):
    """questions: rows of dataio.load_questions. Returns len(questions) * n Trajectories
    (question-major). shots: token ids of worked examples every transcript starts with
    (few_shot_prefix; prompting baselines); bar: a tqdm bar, advanced as trajectories finish."""
    if s.structure == "released" and shots:
        raise ValueError("few-shot examples are built for the transcript structure only")
    if s.structure == "released" and (s.max_pairs > 1 or s.max_rets > 1 or s.actions):
        raise ValueError("multi-query steps (max_pairs / max_rets > 1) and actions are built "
                         "for the transcript structure only")
    chat = step_chat(engine, s, system_prompt, shots)
    lives = [begin(q, k, chat, s) for q in questions for k in range(n)]
    if seed is not None:  # engines sample with torch's default generator (see VLLMEngine.generate)
        torch.manual_seed(seed)
    return StepLoop(engine, retriever, s, chat, bar).run(lives)

def step_chat(engine, s, system_prompt=SYSTEM_PROMPT, shots=None):
    """The step structure's chat builder for engine's policy (a VL policy sees the question image
    and image evidence as pixels)."""
    vis = getattr(engine, "vis", None)
    prompt = system_text(s, system_prompt)
    return (ReleasedSteps(engine.tok, vis) if s.structure == "released"
            else TranscriptSteps(engine.tok, prompt, shots, vis))

def system_text(s, system_prompt=SYSTEM_PROMPT):
    """The transcript's system prompt under settings s: its step budget, and the actions' note when
    they are on."""
    return (system_prompt.format(max_steps=s.max_steps)
            + ACTIONS_NOTE.format(max_actions=s.max_actions) * s.actions)

def begin(q, k, chat, s):
    """Sample k of question q (a dataio.load_questions row; answers and steps may be empty) as a
    Live trajectory of the step loop, its transcript started."""
    x = Trajectory(qid=q["id"], sample=k, question=q["question"], image=q.get("image"),
                   answers=q.get("answers", []), type=q.get("type", ""),
                   gold_steps=reward.group_steps(q.get("steps", []), s.max_pairs))
    tr = chat.start(x)
    return Live(x, tr, head=len(tr.ids))

def golden_prefixes(tok, retriever, questions, s=Settings(), seed=None, vis=None):
    """The gold trajectory of each question (GoldPolicy through the real loop and retrieval,
    whatever its lengths), and span_prefixes of them. Step-GRPO's teacher_prefix groups and
    evaluate.py's route probe start from these."""
    golds = rollout(GoldPolicy(tok, questions, vis, s.max_pairs, s.actions), retriever, questions,
                    1, replace(s, route_tokens=1024, answer_tokens=1024, route_mode="model"), seed)
    return golds, span_prefixes(golds)

def span_prefixes(trajs):
    """Every point where the policy writes a route or an answer in trajectories `trajs` (gold or a
    teacher's), but for what a backtrack popped: [(trajectory, span, prompt ids up to that span, the
    images in them)]."""
    # no actions, nothing backtracked
    return [(x, sp, *span_prefix(x, sp)) for x in trajs for sp in x["spans"]
            if sp["kind"] in ("route", "answer", "final") and not sp.get("popped")]

def span_prefix(x, sp):
    """(prompt ids before span sp of finished trajectory x (a Trajectory or its row), the images in
    them): its chat's tokens up to the span (released: the step's own chat)."""
    a = max(a for a, _ in x["segments"] if a <= sp["start"])
    return x["ids"][a:sp["start"]], images_in(x["images"], a, sp["start"])

def gold_steps(engine, retriever, questions, s=Settings(), seed=None):
    """The ceiling of the steps (evaluate.py's gold_steps): each question's gold trajectory
    (golden_prefixes: gold sub-questions and KBs, real retrieval, gold intermediate answers) up to
    its final answer, which the engine writes. Returns the gold Trajectories, final_answer (and
    format_ok) the engine's."""
    golds, prefixes = golden_prefixes(engine.tok, retriever, questions, s, seed,
                                      getattr(engine, "vis", None))
    finals = [(x, ids, images, turn_key(x, sp)) for x, sp, ids, images in prefixes
              if sp["kind"] == "final"]
    # a gold trajectory that did not fit the context has no final span: no answer (scored 0)
    for x in golds:
        x.final_answer = None
    for x, ids, *_ in finals:
        if not fits(engine, ids, s.answer_tokens):
            x.overflow = True
            x.error = (f"final answer: {len(ids)} context + {s.answer_tokens} new tokens "
                       f"exceed the engine's max_len {engine.max_len}")
    finals = [f for f in finals if not f[0].overflow]
    outs = engine.generate([ids for _, ids, *_ in finals], s.answer_tokens, s.temperature, s.top_p,
                           ["</answer>"], seed, s.top_k,
                           images=[images for *_, images, _ in finals],
                           keys=[k for *_, k in finals])
    for (x, *_), (ids, _) in zip(finals, outs):
        a = reward.parse_answer(engine.tok.decode(ids, skip_special_tokens=True))
        x.final_answer, x.format_ok = a.answer if a.ok else None, a.ok
        x.error = "" if a.ok else f"final answer: {a.error}"
    return golds

def few_shot_prefix(tok, retriever, examples, s=Settings(), system_prompt=SYSTEM_PROMPT):
    """Token ids of a chat that opens with the gold trajectories of `examples` (GoldPolicy through
    the real loop and retrieval) as earlier exchanges: the system prompt, then each example's
    question, steps, evidence and answer. rollout(..., shots=...) puts each question after it, so a
    model never trained on the step format sees it done."""
    # the examples' own (with --actions they do not act)
    fmt = ChatFormat(tok, system_text(s, system_prompt))
    golds = rollout(GoldPolicy(tok, examples, max_pairs=s.max_pairs), retriever, examples, 1,
                    replace(s, route_mode="model"), 0, system_prompt)
    ids = []
    for k, (q, x) in enumerate(zip(examples, golds)):
        # system prompt + question (outside text: encode)
        head = len(start_transcript(fmt, q["question"]).ids)
        ids += x.ids if k == 0 else (fmt.encode([fmt.user_open, q["question"], fmt.user_close])[0]
                                     + x.ids[head:])
    return ids

def show(x, tok):
    print(f"\n=== {x.qid} sample {x.sample} [{x.type}]: {x.question}   gold: {x.answers}")
    for st in x.steps:  # one line per lookup; a multi-query step's lookups share its number
        print(f"  step {st['step'] + 1}: [{st['kb']}] {st['sub_question']!r} -> retrieved "
              f"{st['retrieved']} -> {st['answer']!r}")
    if not x.format_ok and x.spans:  # what the model wrote where the step format broke
        sp = x.spans[-1]
        text = tok.decode(x.ids[sp["start"]:sp["end"]], skip_special_tokens=True)
        print(f"  wrote ({sp['kind']} step {sp['step'] + 1}): "
              f"{text[:300]!r}{' ...' if len(text) > 300 else ''}")
    f1 = reward.f1_recall(x.final_answer or "", x.answers)
    print(f"  final: {x.final_answer!r}  format_ok={x.format_ok} {x.error}  "
          f"({x.n_policy_tokens} policy tokens of {len(x.ids)}, F1-Recall {f1:.2f})")

# --------------------------------------------------------------------------------------------------
# A trajectory as a table row (stepgrpo.py's wandb tables)

@dataclass
class Sample:
    """One trajectory as a row of stepgrpo.py's wandb tables (a training step's samples, a dev
    evaluation's): the question and its gold answers, a readable line for each policy step
    (step_line), the reward each step's advantage is of and that advantage (the mean over its
    tokens, where --route_credit split gives a route's wording and its KB choice their own), None
    where a step has none (a teacher's prefix, a branch's steps but the branched one, a dev
    trajectory's), the final answer and its score: the outcome (F1-Recall, + the judged term with
    --w_rag; a teacher_prefix final answer: its step reward; dev: F1-Recall)."""
    COLUMNS = ("question", "gold", "steps", "rewards", "advantages", "final_answer", "score")
    question: str
    gold: list            # the gold answers
    steps: list           # a line a policy step
    rewards: list         # a value or None a step
    advantages: list
    final_answer: str | None
    score: float | None

    def row(self):
        """The cells under COLUMNS: the steps one text cell, a line a step, the rewards and
        advantages lists aligned with its lines."""
        num = lambda vs: [None if v is None else round(float(v), 4) for v in vs]  # noqa: E731
        return [self.question, " | ".join(self.gold), "\n".join(self.steps), num(self.rewards),
                num(self.advantages), self.final_answer, self.score]

def step_line(kind, t, step):
    """A policy step as one readable line (its whitespace runs one space each, so a Sample's lines
    stay one a step): its kind and routing step (t, from 0), then a route's sub-questions and KBs or
    the stop, an action's note, an answer; a step that did not parse, its error. step: what the
    parser read (a reward.Route or reward.Answer)."""
    head = "final" if kind == "final" else f"{kind} {t + 1}"
    if not step.ok:
        text = f"(did not parse) {step.error}"
    elif isinstance(step, reward.Answer):
        text = step.answer
    elif step.action:
        text = step.note
    elif step.stop:
        text = "stop"
    else:
        text = "; ".join(f"{q} -> {', '.join(kbs)}" for q, kbs in step.pairs)
    return " ".join(f"{head}: {text}".split())

def span_steps(x):
    """Each policy span of finished trajectory x (a Trajectory or its row) as (kind, routing step,
    the step the parser read), from x's fields as steprewards.span_rewards reads them: a route's
    lookups (a backtracked route's from its backtrack), an action's note, an answer, the final
    answer; the span a format failure ended on fails with x's error."""
    pred, acts = reward.by_step(x["steps"]), {a["span"]: a for a in x.get("actions", [])}
    popped = {k: a["popped"] for a in acts.values() if a["kind"] == "backtrack"
              for k in a["popped_spans"]}
    out = []
    for j, sp in enumerate(x["spans"]):
        t = sp["step"]
        mine = popped[j] if j in popped else pred[t] if t < len(pred) else []
        if not x["format_ok"] and j == len(x["spans"]) - 1:
            step = reward.Answer(ok=False, error=x["error"])
        elif j in acts:
            step = reward.Route(ok=True, action=acts[j]["kind"], note=acts[j]["note"])
        elif sp["kind"] == "route":
            step = reward.Route(ok=True, stop=not mine, pairs=reward.pairs_of(mine))
        else:
            answer = x["final_answer"] if sp["kind"] == "final" else mine[0]["answer"]
            step = reward.Answer(ok=True, answer=answer or "")
        out.append((sp["kind"], t, step))
    return out

def sample_of(x, rewards=None, advantages=None, score=None):
    """Finished trajectory x as a Sample; rewards and advantages: one a span (None: none)."""
    lines = [step_line(*st) for st in span_steps(x)]
    none = [None] * len(lines)
    return Sample(x["question"], list(x["answers"]), lines, rewards or none, advantages or none,
                  x["final_answer"], score)

def prefix_sample(x, sp, text, s, r, adv, score=None):
    """A step sampled at a prefix of trajectory x (teacher_prefix) as a Sample: x's steps before
    span sp (no rewards: not sampled), then `text` written for sp (parsed as the step loop parses
    it, under Settings s) with its reward r and advantage adv."""
    j = x["spans"].index(sp)
    step = (reward.parse_route(text, s.max_pairs, s.max_rets, s.actions) if sp["kind"] == "route"
            else reward.parse_answer(text))
    lines = [step_line(*st) for st in span_steps(x)[:j]] + [step_line(sp["kind"], sp["step"], step)]
    final = step.answer if sp["kind"] == "final" and step.ok else None
    return Sample(x["question"], list(x["answers"]), lines, [None] * j + [r], [None] * j + [adv],
                  final, score)

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL,
                    help="any HF causal LM or image-text-to-text folder")
    ap.add_argument("--data", default="data/mini")
    ap.add_argument("--split", default="dev")
    ap.add_argument("--n_questions", type=int, default=4)
    ap.add_argument("-n", type=int, default=2, help="samples per question")
    ap.add_argument("--backend", default="vllm", choices=["vllm", "hf", "openai"])
    ap.add_argument("--base_url", default=None,
                    help="--backend openai: the server, e.g. http://localhost:8000/v1")
    ap.add_argument("--api_key", default=None, help="--backend openai: its key, if it wants one")
    ap.add_argument("--max_steps", type=int, default=3)
    ap.add_argument("--max_pairs", type=int, default=1,
                    help="sub-questions a routing step may hold (RAG-R1's parallel queries)")
    ap.add_argument("--max_rets", type=int, default=1,
                    help="retrievers a sub-question may name (R1-Router's multi-retriever mode)")
    ap.add_argument("--actions", action="store_true",
                    help="a routing step may backtrack or summarise (a policy trained on them)")
    ap.add_argument("--topk", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--structure", default="transcript", choices=["transcript", "released"],
                    help="one growing chat, or a single-turn chat a step (R1-Router's released "
                         "code)")
    ap.add_argument("--retriever", default="dense",
                    help="dense | bm25 | hybrid | http://host:port of retrievers.py serve")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="also write the trajectories as JSONL here")
    args = ap.parse_args()
    check_multi_query(args.max_pairs, args.max_rets, args.structure, args.actions)
    import dataio
    import retrievers
    try:
        qs = dataio.load_questions(args.data, args.split)[:args.n_questions]
        ret = retrievers.make_retriever(args.retriever, args.data)
    except dataio.DataError as e:
        sys.exit(f"error: {e}")
    if not (Path(args.model) / "config.json").exists():
        sys.exit(f"error: {args.model}: not a model folder (run `python prepare.py` for the "
                 "default)")
    s = Settings(max_steps=args.max_steps, topk=args.topk, temperature=args.temperature,
                 structure=args.structure, max_pairs=args.max_pairs, max_rets=args.max_rets,
                 actions=args.actions)
    engine = make_engine(args.backend, args.model, seed=args.seed, max_images=s.max_images,
                         base_url=args.base_url, api_key=args.api_key)
    t = time.perf_counter()
    trajs = rollout(engine, ret, qs, n=args.n, s=s, seed=args.seed)
    dt = time.perf_counter() - t
    for x in trajs:
        show(x, engine.tok)
    if not any(x.format_ok for x in trajs):
        print("\nno trajectory kept the step format: a model never trained on it needs worked "
              "examples (evaluate.py --few_shot 3 --protocol fallback) or SFT on golden "
              "trajectories (sft.py)")
    print(f"\n{len(trajs)} trajectories in {dt:.1f}s: "
          f"{sum(x.n_policy_tokens for x in trajs) / dt:.0f} policy tokens/s")
    if args.out:
        dataio.write_jsonl(args.out, trajs)
