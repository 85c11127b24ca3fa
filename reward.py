r"""
Step format, a parser that never raises, answer metrics and step rewards.

The step format (R1-Router), one model turn per step:

    routing step  <think>T</think>\n<sub-question>Q</sub-question>\n<ret>R</ret>
    answer step   <think>T</think>\n<answer>A</answer>

R is a KB's retriever name (dataio.KB_TABLE: "Text Retriever", "Table Retriever", "Text Image
Retriever") or "None".

Actions (Agentic RAG-R1's Backtrack and Summary on its memory stack), off by default: with actions
on, a routing step may instead be

    backtrack     <think>T</think>\n<backtrack>why</backtrack>    the last routing step and its
                                                                  evidence leave the context
    summary       <think>T</think>\n<summary>S</summary>          the steps so far are replaced
                                                                  by S in the context

(parse_route's Route.action; rollout.StepLoop carries them out). Without actions these tags are
plain text, as in R1-Router's format.

Multi-query steps (RAG-R1's parallel queries, R1-Router's multi-retriever mode), off by default:
with max_pairs K > 1 a routing step may hold up to K sub-question / retriever pairs, retrieved in
parallel,

    <think>T</think>\n<sub-question>Q1</sub-question>\n<ret>R1</ret>\n
        <sub-question>Q2</sub-question>\n<ret>R2</ret>

and with max_rets R > 1 a <ret> may name up to R retrievers, comma-separated ("Text Retriever, Table
Retriever"). K = R = 1 is R1-Router's format, exactly.
<ret>None</ret> (with <sub-question>None</sub-question>) means "stop retrieving
and give the final answer"; here that is kb=None, stop=True. Inside this repo
the knowledge bases are dataio.KBS, "text", "table", "image" (KB_TO_RET).

Parsing rules (parse_route / parse_answer return ok=False plus an error string):
  - every required tag appears exactly once (the sub-question / ret pair 1..K
    times), opened then closed, in the order above, with only whitespace
    between consecutive tags; tags of the other kind of step (e.g. <answer> in
    a routing step) may not appear at all; more than K pairs is a format failure;
  - tag names match case-insensitively (the reference lower-cases the whole
    generation before parsing); values are stripped of surrounding whitespace;
  - the retriever name matches case-insensitively with runs of whitespace
    collapsed, and is reported canonically; with R = 1, lists like "Text
    Retriever, Table Retriever" are rejected (the reference reward accepts them
    and gives the retriever half 0); with R > 1 a list of up to R distinct
    retrievers is accepted, None never among others;
  - <ret>None</ret> needs the sub-question "None" and is the step's only pair
    (the stop); any other retriever needs a
    non-empty sub-question that is not "None" (what the reference inference
    loop, src/answer_generation.py, checks); <answer> must be non-empty;
  - text before the first tag or after the last one is ignored, including chat
    end tokens such as "<|im_end|>" and a model that runs on after </ret>. The
    reference reward finds each tag with re.search and ignores it too.

Metrics (pred: str; golds: list[str] = answer + aliases; max over the golds):
  exact_match, f1  the official HotpotQA eval script (normalize_answer; F1 is 0
                   when either side is yes/no/noanswer and they differ)
  acc              1 if a (non-empty) normalised gold is a substring of the
                   normalised prediction
  f1_recall        R1-Router's F1-Recall: VQA-normalise, tokenise, take the
                   gold with the best token F1 and return its recall

Step rewards (R1-Router Step-GRPO, see route_reward / answer_reward):
  route_reward  = 0.5 * cos(E(q_pred), E(q_gold)) + 0.5 * [kb_pred == kb_gold]
                  raw cosine, not clamped, so the reward lies in [-0.5, 1];
                  0 for a malformed step. Multi-query steps (see route_reward):
                  the predicted pairs are matched one-to-one with the gold
                  steps of that step (best total cosine), each match scores
                  the above (retriever term [kb_gold in kbs] / |kbs|), and the
                  sum is divided by max(#pred, #gold); a repeated sub-question
                  earns nothing. One pair against one gold: the formula above
  answer_reward = R         if there is one gold with more than 5 words
                  [R == 1]  otherwise (short gold, or several golds)
                  where R = f1_recall(pred, golds)
  score_route   = w_format [the step parses] + route_reward (this repo's
                  format term: --w_format in stepgrpo.py, 0 gives R1-Router's)
  retrieval_hit_reward = [the gold doc id is among the retrieved ids]
  re_asks       whether a sub-question repeats an earlier step's (the re-ask
                rate of evaluate.py and stepgrpo.py's log)

Steps as data: a question's gold steps and a trajectory's steps are flat lists,
one dict per (sub-question, KB) lookup, each with "step", the routing step it
was asked in (group_steps gives gold steps theirs; by_step regroups them).
"""

import itertools
import re
import string
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from dataio import KB_TABLE

KB_TO_RET = {kb.name: kb.retriever for kb in KB_TABLE}
RET_TO_KB = {ret: kb for kb, ret in KB_TO_RET.items()}
STOP_RET = "None"
_CANONICAL_RET = {name.lower(): name for name in [*KB_TO_RET.values(), STOP_RET]}

ROUTE_TAGS = ("think", "sub-question", "ret")
ANSWER_TAGS = ("think", "answer")
# a routing step's other moves (actions on): the tag is the action's name
ACTIONS = ("backtrack", "summary")
STEP_TAGS = ("think", "sub-question", "ret", "answer")
_TAG = re.compile(r"<(/?)(think|sub-question|ret|answer|backtrack|summary)>", re.IGNORECASE)

# -----------------------------------------------------------------------------
# step format


@dataclass
class Route:
    ok: bool
    think: str = ""
    sub_question: str = ""
    kb: str | None = None  # "text" | "image" | "table"; None when stopping
    stop: bool = False
    error: str = ""
    # [(sub_question, (kb, ...))] all pairs; sub_question, kb: the first
    pairs: list = field(default_factory=list)
    # "backtrack" | "summary" (actions on), with its text in note; "" for a route or the stop
    action: str = ""
    note: str = ""


@dataclass
class Answer:
    ok: bool
    think: str = ""
    answer: str = ""
    error: str = ""


def _tag_values(text, tags, repeat=1, known=STEP_TAGS):
    """Stripped contents of `tags` (which must appear once each, in order; the group tags[1:] up to
    `repeat` times), or an error. Tags outside `known` are plain text."""
    if not isinstance(text, str):
        return None, f"expected a str, got {type(text).__name__}"
    found = [(m.group(1) == "/", m.group(2).lower(), m) for m in _TAG.finditer(text)
             if m.group(2).lower() in known]
    for name in known:
        n_open = sum(1 for close, tag, _ in found if tag == name and not close)
        n_close = sum(1 for close, tag, _ in found if tag == name and close)
        if name not in tags:
            if n_open or n_close:
                return None, f"unexpected <{name}> tag"
        elif n_open == n_close == 0:
            return None, f"missing <{name}>...</{name}>"
        elif max(n_open, n_close) > (repeat if name in tags[1:] else 1):
            n = max(n_open, n_close)
            if name in tags[1:] and repeat > 1:
                return None, (f"{n} <{name}> tags, at most {repeat} sub-question/retriever pairs "
                              f"allowed")
            return None, f"{'two' if n == 2 else n} <{name}> tags, expected one"
        elif n_close == 0:
            return None, f"unclosed <{name}>"
        elif n_open == 0:
            return None, f"</{name}> without <{name}>"
    n = sum(1 for close, tag, _ in found if tag == tags[-1] and not close)
    expected = [tags[0], *tags[1:] * max(1, n)]
    if ([(close, tag) for close, tag, _ in found]
            != [(c, t) for t in expected for c in (False, True)]):
        return None, ("tags nested or out of order, expected "
                      + "".join(f"<{t}>...</{t}>" for t in tags))
    for (_, prev, m_close), (_, nxt, m_open) in zip(found[1::2], found[2::2]):
        if text[m_close.end():m_open.start()].strip():
            return None, f"text between </{prev}> and <{nxt}>"
    return [text[o.end():c.start()].strip()
            for (_, _, o), (_, _, c) in zip(found[::2], found[1::2])], ""


def _retrievers(raw, max_rets):
    """The KBs a <ret> names (None: the stop), or an error."""
    names = [raw] if max_rets == 1 else raw.split(",")
    rets = [_CANONICAL_RET.get(" ".join(n.split()).lower()) for n in names]
    if None in rets:
        return None, f"unknown retriever {raw!r}"
    if len(rets) > max_rets:
        return None, f"{len(rets)} retrievers in <ret>{raw}</ret>, at most {max_rets} allowed"
    if len(set(rets)) < len(rets):
        return None, f"a retriever named twice in <ret>{raw}</ret>"
    if STOP_RET in rets and len(rets) > 1:
        return None, f"None among other retrievers in <ret>{raw}</ret>"
    return tuple(RET_TO_KB.get(r) for r in rets), ""


def parse_route(text: str, max_pairs: int = 1, max_rets: int = 1, actions: bool = False) -> Route:
    """A routing step; with actions, a backtrack or a summary instead (the first action tag found
    decides which: <think> then that tag alone, with non-empty contents)."""
    if actions and isinstance(text, str):
        kind = next((m.group(2).lower() for m in _TAG.finditer(text)
                     if m.group(2).lower() in ACTIONS), None)
        if kind:
            values, error = _tag_values(text, ("think", kind), known=STEP_TAGS + ACTIONS)
            if error:
                return Route(ok=False, error=error)
            if not values[1]:
                return Route(ok=False, error=f"empty <{kind}>")
            return Route(ok=True, think=values[0], action=kind, note=values[1])
    values, error = _tag_values(text, ROUTE_TAGS, max_pairs, known=STEP_TAGS + ACTIONS * actions)
    if error:
        return Route(ok=False, error=error)
    think, pairs = values[0], []
    for sub_question, raw_ret in zip(values[1::2], values[2::2]):
        kbs, error = _retrievers(raw_ret, max_rets)
        if error:
            return Route(ok=False, error=error)
        stop = kbs == (None,)
        says_none = sub_question.lower() == "none"
        if stop and not says_none:
            return Route(ok=False, error=f"<ret>None</ret> but sub-question is {sub_question!r}, "
                                         f"expected 'None'")
        if not stop and not sub_question:
            return Route(ok=False, error="empty <sub-question>")
        if not stop and says_none:
            return Route(ok=False, error=f"sub-question is 'None' but <ret> is {raw_ret!r}")
        pairs.append((sub_question, kbs))
    if len(pairs) > 1 and any(kbs == (None,) for _, kbs in pairs):
        return Route(ok=False, error="<ret>None</ret> next to other sub-questions: a stop is the "
                                     "step's only pair")
    if pairs[0][1] == (None,):
        return Route(ok=True, think=think, sub_question=pairs[0][0], kb=None, stop=True)
    return Route(ok=True, think=think, sub_question=pairs[0][0], kb=pairs[0][1][0], stop=False,
                 pairs=pairs)


def parse_answer(text: str) -> Answer:
    values, error = _tag_values(text, ANSWER_TAGS)
    if error:
        return Answer(ok=False, error=error)
    think, answer = values
    if not answer:
        return Answer(ok=False, error="empty <answer>")
    return Answer(ok=True, think=think, answer=answer)


def format_route(think: str, pairs) -> str:
    """Render a routing step: pairs [(sub_question, kb or (kb, ...))], [] for the stop route."""
    if not pairs:
        pairs = [(STOP_RET, None)]
    body = []
    for sub_question, kbs in pairs:
        kbs = (kbs,) if kbs is None or isinstance(kbs, str) else kbs
        if kbs == (None,) and sub_question.strip().lower() != "none":
            raise ValueError(f"a stop route has no sub-question, got {sub_question!r}")
        rets = ", ".join(STOP_RET if kb is None else KB_TO_RET[kb] for kb in kbs)
        body.append(f"<sub-question>{sub_question}</sub-question>\n<ret>{rets}</ret>")
    # newline-separated like the few-shot examples in the reference src/prompt.py
    return f"<think>{think}</think>\n" + "\n".join(body)


def format_answer(think: str, answer: str) -> str:
    return f"<think>{think}</think>\n<answer>{answer}</answer>"


def format_action(think: str, kind: str, note: str) -> str:
    """Render an action step: kind "backtrack" or "summary"."""
    return f"<think>{think}</think>\n<{kind}>{note}</{kind}>"

# -----------------------------------------------------------------------------
# HotpotQA metrics (official hotpot_evaluate_v1.py)

_HOTPOT_PUNCT = set(string.punctuation)


def normalize_answer(s: str) -> str:
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _HOTPOT_PUNCT)
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def _hotpot_f1(pred, gold):
    pred, gold = normalize_answer(pred), normalize_answer(gold)
    if (pred in ("yes", "no", "noanswer") or gold in ("yes", "no", "noanswer")) and pred != gold:
        return 0.0
    pred_toks, gold_toks = pred.split(), gold.split()
    num_same = sum((Counter(pred_toks) & Counter(gold_toks)).values())
    if num_same == 0:
        return 0.0
    precision, recall = num_same / len(pred_toks), num_same / len(gold_toks)
    return 2 * precision * recall / (precision + recall)


def exact_match(pred: str, golds: list[str]) -> float:
    return max((float(normalize_answer(pred) == normalize_answer(g)) for g in golds), default=0.0)


def f1(pred: str, golds: list[str]) -> float:
    return max((_hotpot_f1(pred, g) for g in golds), default=0.0)


def acc(pred: str, golds: list[str]) -> float:
    # an empty normalised gold (e.g. "the") would be a substring of everything
    pred = normalize_answer(pred)
    return max((float(bool(g) and g in pred) for g in map(normalize_answer, golds)), default=0.0)

# -----------------------------------------------------------------------------
# R1-Router's F1-Recall, a port of ChloeTT-LAO/Router-Search src/evaluate.py
# (same code in src/Easy-R1/verl/utils/reward_score/step.py). Quirks kept:
#   - articles are only "an" and "the" ("a" stays, unlike the original VQA eval);
#   - periodStrip is '(?!<=\d)(\.)(?!\d)', a typo for a lookbehind, so it removes
#     every "." not followed by a digit, and re.UNICODE is passed where `count`
#     goes, so only the first 32 are removed;
#   - processPunctuation tests the *input* text: if a mark has a space next to
#     it, or any "digit,digit" occurs, the mark is deleted, else it becomes " ";
#   - contractions are looked up after lower-casing, so "Im"/"Ive" never match;
#   - of the golds, the first with the highest F1 wins (strict >) and its recall
#     is returned, not the best recall.
# Tokens come from nltk.word_tokenize; we port its NLTKWordTokenizer regexes
# (nltk/tokenize/destructive.py) but skip the punkt sentence split, which only
# matters for a "." that survived periodStrip.

_CONTRACTIONS = {
    "aint": "ain't", "arent": "aren't", "cant": "can't", "couldve": "could've",
    "couldnt": "couldn't", "couldn'tve": "couldn't've", "couldnt've": "couldn't've",
    "didnt": "didn't", "doesnt": "doesn't", "dont": "don't", "hadnt": "hadn't",
    "hadnt've": "hadn't've", "hadn'tve": "hadn't've", "hasnt": "hasn't", "havent": "haven't",
    "hed": "he'd", "hed've": "he'd've", "he'dve": "he'd've", "hes": "he's", "howd": "how'd",
    "howll": "how'll", "hows": "how's", "Id've": "I'd've", "I'dve": "I'd've", "Im": "I'm",
    "Ive": "I've", "isnt": "isn't", "itd": "it'd", "itd've": "it'd've", "it'dve": "it'd've",
    "itll": "it'll", "let's": "let's", "maam": "ma'am", "mightnt": "mightn't",
    "mightnt've": "mightn't've", "mightn'tve": "mightn't've", "mightve": "might've",
    "mustnt": "mustn't", "mustve": "must've", "neednt": "needn't", "notve": "not've",
    "oclock": "o'clock", "oughtnt": "oughtn't", "ow's'at": "'ow's'at", "'ows'at": "'ow's'at",
    "'ow'sat": "'ow's'at", "shant": "shan't", "shed've": "she'd've", "she'dve": "she'd've",
    "she's": "she's", "shouldve": "should've", "shouldnt": "shouldn't",
    "shouldnt've": "shouldn't've", "shouldn'tve": "shouldn't've", "somebody'd": "somebodyd",
    "somebodyd've": "somebody'd've", "somebody'dve": "somebody'd've", "somebodyll": "somebody'll",
    "somebodys": "somebody's", "someoned": "someone'd", "someoned've": "someone'd've",
    "someone'dve": "someone'd've", "someonell": "someone'll", "someones": "someone's",
    "somethingd": "something'd", "somethingd've": "something'd've",
    "something'dve": "something'd've", "somethingll": "something'll", "thats": "that's",
    "thered": "there'd", "thered've": "there'd've", "there'dve": "there'd've",
    "therere": "there're", "theres": "there's", "theyd": "they'd", "theyd've": "they'd've",
    "they'dve": "they'd've", "theyll": "they'll", "theyre": "they're", "theyve": "they've",
    "twas": "'twas", "wasnt": "wasn't", "wed've": "we'd've", "we'dve": "we'd've", "weve": "we've",
    "werent": "weren't", "whatll": "what'll", "whatre": "what're", "whats": "what's",
    "whatve": "what've", "whens": "when's", "whered": "where'd", "wheres": "where's",
    "whereve": "where've", "whod": "who'd", "whod've": "who'd've", "who'dve": "who'd've",
    "wholl": "who'll", "whos": "who's", "whove": "who've", "whyll": "why'll", "whyre": "why're",
    "whys": "why's", "wont": "won't", "wouldve": "would've", "wouldnt": "wouldn't",
    "wouldnt've": "wouldn't've", "wouldn'tve": "wouldn't've", "yall": "y'all",
    "yall'll": "y'all'll", "y'allll": "y'all'll", "yall'd've": "y'all'd've",
    "y'alld've": "y'all'd've", "y'all'dve": "y'all'd've", "youd": "you'd", "youd've": "you'd've",
    "you'dve": "you'd've", "youll": "you'll", "youre": "you're", "youve": "you've",
}
_MANUAL_MAP = {"none": "0", "zero": "0", "one": "1", "two": "2", "three": "3", "four": "4",
               "five": "5", "six": "6", "seven": "7", "eight": "8", "nine": "9", "ten": "10"}
_ARTICLES = ("an", "the")
_PERIOD_STRIP = re.compile(r"(?!<=\d)(\.)(?!\d)")
_COMMA_STRIP = re.compile(r"(\d)(,)(\d)")
_PUNCT = [";", "/", "[", "]", '"', "{", "}", "(", ")", "=", "+", "\\", "_", "-", ">", "<", "@", "`",
          ",", "?", "!"]


def _vqa_normalize(text):
    text = str(text).replace("\n", " ").replace("\t", " ").strip()
    out = text
    for p in _PUNCT:
        if p + " " in text or " " + p in text or _COMMA_STRIP.search(text):
            out = out.replace(p, "")
        else:
            out = out.replace(p, " ")
    out = _PERIOD_STRIP.sub("", out, count=32)
    words = [_MANUAL_MAP.get(w, w) for w in out.lower().split()]
    return " ".join(_CONTRACTIONS.get(w, w) for w in words if w not in _ARTICLES)


_R = re.compile
_TREEBANK_PRE = [  # STARTING_QUOTES, PUNCTUATION, PARENS_BRACKETS, DOUBLE_DASHES
    (_R(r"([«“‘„]|[`]+)"), r" \1 "), (_R(r"^\""), r"``"), (_R(r"(``)"), r" \1 "),
    (_R(r"([ \(\[{<])(\"|\'{2})"), r"\1 `` "),
    (_R(r"(?i)(?<!\w)(\')(?!(?:re|ve|ll|m|t|s|d|n)\b)(?=\w)"), r"\1 "),
    (_R(r"([^\.])(\.)([\]\)}>\"\'»”’ ]*)\s*$"), r"\1 \2 \3 "),
    (_R(r"([:,])([^\d])"), r" \1 \2"), (_R(r"([:,])$"), r" \1 "), (_R(r"\.{2,}"), r" \g<0> "),
    (_R(r"[;@#$%&]"), r" \g<0> "), (_R(r"[\u2012-\u2015]"), r" \g<0> "),
    (_R(r"([^\.])(\.)([\]\)}>\"\']*)\s*$"), r"\1 \2\3 "), (_R(r"[?!]"), r" \g<0> "),
    (_R(r"([^'])' "), r"\1 ' "), (_R(r"[*]"), r" \g<0> "),
    (_R(r"[\]\[\(\)\{\}\<\>]"), r" \g<0> "), (_R(r"--"), r" -- "),
]
_TREEBANK_POST = [  # ENDING_QUOTES, CONTRACTIONS2, CONTRACTIONS3
    (_R(r"([»”’])"), r" \1 "), (_R(r"''"), " '' "), (_R(r'"'), " '' "), (_R(r"\s+"), " "),
    (_R(r"([^' ])('[sS]|'[mM]|'[dD]|') "), r"\1 \2 "),
    (_R(r"([^' ])('ll|'LL|'re|'RE|'ve|'VE|n't|N'T) "), r"\1 \2 "),
    *[(_R(p), r" \1 \2 ") for p in (
        r"(?i)\b(can)(not)\b", r"(?i)\b(d)('ye)\b", r"(?i)\b(gim)(me)\b", r"(?i)\b(gon)(na)\b",
        r"(?i)\b(got)(ta)\b", r"(?i)\b(lem)(me)\b", r"(?i)\b(more)('n)\b", r"(?i)\b(wan)(na)(?=\s)",
        r"(?i) ('t)(is)\b", r"(?i) ('t)(was)\b")],
]


def _vqa_tokens(text):
    """process_string_en: lower-case, word_tokenize, drop tokens found in ,.?!:;'" (a substring
    test)."""
    text = str(text).lower()
    for pattern, repl in _TREEBANK_PRE:
        text = pattern.sub(repl, text)
    text = " " + text + " "
    for pattern, repl in _TREEBANK_POST:
        text = pattern.sub(repl, text)
    return [tok for tok in text.split() if tok not in ",.?!:;'\""]


def vqa_prf(pred: str, golds: list[str]) -> tuple[float, float, float]:
    """(precision, recall, F1) of the first gold with the highest token F1 (reference
    `evaluate`)."""
    pred = _vqa_normalize(pred)
    if pred == "":
        return 0.0, 0.0, 0.0
    pred_toks = _vqa_tokens(pred)
    best = (0.0, 0.0, 0.0)
    for gold in golds:
        gold_toks = _vqa_tokens(_vqa_normalize(gold))
        num_same = sum((Counter(gold_toks) & Counter(pred_toks)).values())
        if num_same == 0:  # also covers an empty side
            continue
        precision, recall = num_same / len(pred_toks), num_same / len(gold_toks)
        f = 2 * precision * recall / (precision + recall)
        if f > best[2]:
            best = (precision, recall, f)
    return best


def f1_recall(pred: str, golds: list[str]) -> float:
    return vqa_prf(pred, golds)[1]

# -----------------------------------------------------------------------------
# step rewards, from ChloeTT-LAO/Router-Search src/Easy-R1/verl/utils/reward_score/step.py


def _pairs(pred: Route):
    """[(sub_question, kbs)] of a parsed route; a stop is the pair ("none", (None,))."""
    return [("none", (None,))] if pred.stop else pred.pairs


def route_reward(pred: Route, golds: list[dict], encode) -> float:
    """R1-Router's ret_accuracy_reward, 0.5 * cos(E(q_pred), E(q_gold))
    + 0.5 * [pred KB == gold KB], over the pairs of a step: golds are the gold steps of this routing
    step (dicts with sub_question and kb), [] when the gold stops.

    encode(list[str]) -> np.ndarray [n, d]. The reference embeds with BGE-M3, whose vectors are
    unit-norm, and uses the raw dot product; we normalise explicitly so any encoder gives the
    cosine, and like the reference we do not clamp it. Both sides are lower-cased: the reference
    lower-cases the generation and its teacher data is stored lower-cased. A stop is the
    sub-question "none" with retriever "none" on both sides, nothing special: when both stop the
    strings are equal, so the reward is 1.0 (0.5 * cos("none", q) when only one stops). A malformed
    step gets 0, as the reference's exception handler returns.

    Several pairs (multi-query steps; one pair and one gold step is the formula above exactly): each
    predicted pair is matched one-to-one with a gold step, the matching with the best total cosine;
    a matched pair scores 0.5 * cos + 0.5 * [gold KB in its KBs] / |its KBs| (a pair naming several
    retrievers shares the retriever half); the step's reward is the sum over matched
    pairs / max(#pairs, #golds), so a missing pair (too few) and an extra one (too many) each cost
    their share. A pair repeating an earlier pair's sub-question (case and outer spaces aside) is
    never matched: it earns nothing and still counts in #pairs. Matching tries every assignment
    (fine for the few pairs a step holds).
    """
    if not pred.ok:
        return 0.0
    preds = _pairs(pred)
    gold = [(g["sub_question"], g["kb"]) for g in golds] or [("none", None)]
    e = np.asarray(encode([q.lower() for q, _ in preds] + [q.lower() for q, _ in gold]),
                   dtype=np.float64)
    norms = np.linalg.norm(e, axis=1, keepdims=True)
    e = np.divide(e, norms, out=np.zeros_like(e), where=norms > 0)  # a zero vector: no similarity
    cos = e[:len(preds)] @ e[len(preds):].T  # [P, G]
    seen, firsts = set(), []  # indices of pairs whose sub-question is new in this step
    for i, (q, _) in enumerate(preds):
        if q.strip().lower() not in seen:
            firsts.append(i)
        seen.add(q.strip().lower())
    m = min(len(firsts), len(gold))
    best = max(((tuple(p), g) for p in itertools.permutations(firsts, m)
                for g in itertools.combinations(range(len(gold)), m)),
               key=lambda pg: sum(cos[i, j] for i, j in zip(*pg)))
    total = sum(0.5 * cos[i, j] + 0.5 * (gold[j][1] in preds[i][1]) / len(preds[i][1])
                for i, j in zip(*best))
    return float(total) / max(len(preds), len(gold))


def score_route(pred: Route, golds: list[dict], encode, w_format: float = 0.2) -> float:
    """A routing step's reward against the gold steps there ([]: the gold stops here): w_format [the
    step parses] + route_reward. The format term is this repo's extension (0 gives the
    reference's)."""
    return w_format * pred.ok + route_reward(pred, golds, encode)


def answer_reward(pred_answer: str, golds: list[str]) -> float:
    """F1-Recall R, gated (ans_accuracy_reward):

        R         if there is one gold and it has more than 5 words (split on " ")
        [R == 1]  otherwise: all-or-nothing for short golds and for several golds

    Intermediate steps have one long teacher answer (partial credit); final answers
    are short gold lists (all-or-nothing). Pass parse_answer(text).answer and give a
    step that does not parse 0, as the reference does.
    """
    if isinstance(golds, str):
        golds = [golds]
    recall = f1_recall(pred_answer, golds)
    if len(golds) == 1 and len(golds[0].split(" ")) > 5:
        return recall
    return 1.0 if recall == 1 else 0.0


def group_answer(golds: list[dict]) -> str:
    """The intermediate answer of a routing step whose gold steps are `golds`: their answers joined
    by "; "."""
    return "; ".join(dict.fromkeys(g["answer"] for g in golds))


def retrieval_hit_reward(retrieved_ids, gold_doc_id) -> float:
    """1.0 if the gold document is among the retrieved ids: a sub-question quality
    signal that needs no teacher sub-question (this repo's alternative)."""
    return float(gold_doc_id in retrieved_ids)


def re_asks(sub_question: str | None, earlier_steps) -> bool:
    """Whether a sub-question repeats one of earlier_steps' ({"sub_question": ...} dicts; case and
    outer spaces ignored). evaluate.py's and stepgrpo.py's re-ask rate."""
    key = lambda q: (q or "").strip().lower()
    return key(sub_question) in {key(s["sub_question"]) for s in earlier_steps}


# -----------------------------------------------------------------------------
# steps as data: flat lookups, each with the routing step it belongs to


def _mentions(text, answer):
    a = normalize_answer(answer)
    return bool(a) and re.search(rf"(?<!\w){re.escape(a)}(?!\w)",
                                 normalize_answer(text)) is not None


def group_steps(steps: list[dict], max_pairs: int = 1) -> list[dict]:
    """Gold steps (one dict per lookup, in order) -> copies with "step", the routing step each is
    asked in. A step joins the previous one's routing step when it has the same (non-empty)
    sub-question (one sub-question, several retrievers), or when that routing step holds fewer than
    max_pairs sub-questions and none of their answers occurs in its sub-question (it does not depend
    on them: the two lookups of a comparison, not the hops of a chain). max_pairs 1: step t is gold
    step t."""
    out = []
    for s in steps:
        q, group = s["sub_question"], by_step(out)[-1] if out else []
        same = bool(group) and bool(q) and q == group[-1]["sub_question"]
        free = bool(group) and len({g["sub_question"] for g in group}) < max_pairs \
            and not any(_mentions(q, g["answer"]) for g in group)
        out.append(dict(s, step=group[0]["step"] if same or free else len(by_step(out))))
    return out


def by_step(steps: list[dict]) -> list[list[dict]]:
    """Flat steps with "step" -> one list per routing step, in order."""
    groups = []
    for s in steps:
        if not groups or s["step"] != groups[-1][0]["step"]:
            groups.append([])
        groups[-1].append(s)
    return groups


def pairs_of(steps: list[dict]) -> list[tuple]:
    """The lookups of one routing step -> its (sub_question, (kb, ...)) pairs, in order."""
    pairs = {}
    for s in steps:
        pairs.setdefault(s["sub_question"], []).append(s["kb"])
    return [(q, tuple(kbs)) for q, kbs in pairs.items()]
