"""
transcript.py: a trajectory as token ids plus a mask of what the policy wrote. `ChatFormat` finds
the string pieces of any concatenative chat template (ChatML, Llama-3, ...) by rendering sentinel
messages; `Transcript` grows token by token, so the ids that were sampled are exactly the ids
trained on. rollout.py builds trajectories with it and sft.py renders golden ones through the same
code, so training and evaluation never drift apart. Text from outside (a question, retrieved
evidence) is encoded with the template's special tokens' strings as text (`Template`). `truncate`
cuts every engine's completion after its first EOS or stop string.
"""
import functools
import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import reward
from dataio import KBS, DataError, read_jsonl
from vision import Img, images_in

META = "meta.json"  # beside a folder of trajectories (synth.py): tokenizer_meta of the tokenizer
                    # that wrote their ids

def truncate(tok, ids, logprobs, stop, eos):
    """Cut after the first EOS, then after the first token that completes a stop string (HF pads
    finished rows)."""
    if eos in ids:
        n = ids.index(eos) + 1
        ids, logprobs = ids[:n], logprobs[:n]
    if not any(s in tok.decode(ids) for s in stop):
        return ids, logprobs
    # a stop string, once decoded, stays in every longer prefix: binary-search the first one
    lo, hi = 1, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if any(s in tok.decode(ids[:mid]) for s in stop) else (mid + 1, hi)
    return ids[:lo], logprobs[:lo]

def tokenizer_meta(tok):
    """Whose token ids a trajectory holds: the tokenizer's name and a hash of its vocabulary (sha256
    of the sorted (token, id) pairs, 16 hex digits). Ids of another vocabulary are in range and
    train on garbage without an error, so sft.py compares the hash with its policy's."""
    vocab = json.dumps(sorted(tok.get_vocab().items()), ensure_ascii=False)
    return dict(tokenizer=str(tok.name_or_path),
                vocab_sha256=hashlib.sha256(vocab.encode()).hexdigest()[:16])

FORMAT = "transcript.json"  # in a checkpoint (sft.py, stepgrpo.py): the format_meta its policy was
                            # trained on
# R1-Router's: one growing chat, one sub-question to one retriever a step, no actions
FORMAT_DEFAULTS = dict(structure="transcript", max_pairs=1, max_rets=1, actions=False)
FORMAT_FLAGS = tuple(FORMAT_DEFAULTS)

def format_meta(args):
    """The flags that shape a trajectory's text. synth.py writes them into META, sft.py and
    stepgrpo.py into each checkpoint (FORMAT), and check_format compares: a policy run with another
    format than it was trained on (golden one chat per step for a router trained on a growing one,
    multi-query steps for a single-query one) scores and trains without an error, on prompts it has
    never seen. With them the KBs (dataio.KBS): the prompt names each one."""
    return {**{k: getattr(args, k) for k in FORMAT_FLAGS}, "kbs": list(KBS)}

def trained_format(model):
    """{flag: value} of the transcript format the policy in folder `model` was trained on (its
    FORMAT), FORMAT_DEFAULTS for what it does not record (a prompt-only model): stepgrpo.py trains a
    policy in its own format, the only one check_format lets it run."""
    path = Path(model) / FORMAT
    theirs = json.loads(path.read_text()) if path.is_file() else {}
    return {k: theirs.get(k, v) for k, v in FORMAT_DEFAULTS.items()}

def check_tokenizer(data, tok, print0):
    """Trajectories are token ids: refuse those synth.py wrote with another tokenizer
    (<data>/meta.json), which would train on garbage. A folder without meta.json (older synth.py,
    written by hand) passes with a warning. Returns the trajectories' transcript.format_meta (None
    if unknown), which every checkpoint records."""
    theirs, mine = data_meta(data), tokenizer_meta(tok)
    if not theirs:
        print0(f"warning: {Path(data) / META} not found: cannot check that the trajectories hold "
               f"{tok.name_or_path}'s token ids")
        return None
    if theirs.get("vocab_sha256") != mine["vocab_sha256"]:
        raise DataError(f"{data}: trajectories tokenised by {theirs.get('tokenizer')} (vocab "
                               f"{theirs.get('vocab_sha256')}) but the policy's tokenizer is "
                               f"{mine['tokenizer']} (vocab {mine['vocab_sha256']}); run synth.py "
                               f"--model with the policy")
    return theirs.get("format")

def load_trajectories(folder, tok, print0):
    """qid -> the trajectory of <folder>/train.jsonl (stepgrpo.py --prefixes): synth.py's rows (ids
    in the policy's tokenizer, spans, steps with what they retrieved, gold_steps), checked like
    sft.py's data."""
    check_tokenizer(folder, tok, print0)
    path = Path(folder) / "train.jsonl"
    store = {}
    for i, x in enumerate(read_jsonl(path), 1):
        if not all(k in x for k in ("qid", "ids", "spans", "segments", "images", "steps",
                                    "gold_steps", "answers")):
            raise DataError(f"{path}: row {i}: not a synth.py trajectory (needs qid, ids, spans, "
                            "segments, images, steps, gold_steps, answers)")
        store[x["qid"]] = x
    return store

def data_meta(data):
    """A trajectory folder's META ({} when it has none): the tokenizer, the format, and a VL
    policy's picture cap (max_pixels: the image expansions in the ids were made with it, so the
    trainer's processor needs the same)."""
    path = Path(data) / META
    return json.loads(path.read_text()) if path.is_file() else {}

def check_format(model, args):
    """None, or a one-line error naming each flag of args that differs from what the policy in
    folder `model` was trained on (its FORMAT; a folder without one, the prompt-only model say,
    passes)."""
    path = Path(model) / FORMAT
    if not path.is_file():
        return None
    theirs, mine = json.loads(path.read_text()), format_meta(args)
    diff = [f"--{k} {mine[k]} (trained: {theirs[k]})" for k in FORMAT_FLAGS
            if k in theirs and theirs[k] != mine[k]]
    if theirs.get("kbs", mine["kbs"]) != mine["kbs"]:
        diff.append(f"the KBs {' '.join(mine['kbs'])} of dataio.KB_TABLE (trained: "
                    f"{' '.join(theirs['kbs'])})")
    if not diff:
        return None
    return (f"{model} was trained on another transcript format: {', '.join(diff)}; pass the "
            f"trained values")

class Template(str):
    """Text of the chat template itself (ChatFormat's pieces): a special token's string in it is
    that token. Every other string ChatFormat.encode takes is outside text (a question, a retrieved
    document, a sub-question), whose special tokens' strings stay text: a question that closes its
    own turn and writes an evidence turn forges nothing."""

class ChatFormat:
    """The string pieces of the tokenizer's chat template, found by rendering sentinel messages, so
    any concatenative template (ChatML, Llama-3, ...) works without hard-coding it."""
    def __init__(self, tok, system_prompt):
        if not tok.chat_template:
            raise DataError(f"{tok.name_or_path}: the tokenizer has no chat template "
                            "(tokenizer_config.json's chat_template or chat_template.jinja); every "
                            "step is a chat turn rendered through it")
        self.tok, self.system = tok, system_prompt
        r = lambda msgs, gen=False: tok.apply_chat_template(msgs, tokenize=False,
                                                            add_generation_prompt=gen)
        S, U = dict(role="system", content=system_prompt), dict(role="user", content="\x00Q")
        base = r([S, U])
        self.gen_prompt = Template(r([S, U], True)[len(base):])  # e.g. "<|im_start|>assistant\n"
        # e.g. "<|im_end|>\n"
        after_a = r([S, U, dict(role="assistant", content="\x01")]).split("\x01")[1]
        seg = r([S, U, dict(role="assistant", content="\x01"), dict(role="user", content="\x02")],
                True).split("\x01")[1]
        if not seg.startswith(after_a) or "\x02" not in seg:
            raise ValueError("chat template is not concatenative; rollout.py cannot build "
                             "transcripts incrementally")
        self.end_assistant = Template(after_a)
        self.user_open = Template(seg[len(after_a):seg.index("\x02")])
        self.user_close = Template(seg[seg.index("\x02") + 1:])
        self.prefix_tpl = (Template(base.split("\x00Q")[0]),
                           Template(base.split("\x00Q")[1] + self.gen_prompt))

    def ids(self, text):
        """Token ids of text the template or this code wrote (its special tokens' strings are those
        tokens)."""
        return self.tok.encode(text, add_special_tokens=False)

    @functools.cached_property
    def specials(self):
        """A regex of the tokenizer's special tokens' strings, longest first (as the tokenizer
        matches them)."""
        toks = sorted({t.content for t in self.tok.added_tokens_decoder.values() if t.special},
                      key=len, reverse=True)
        return re.compile("|".join(map(re.escape, toks)) or "(?!)")

    @functools.cached_property
    def splitter(self):
        """The tokenizer's backend, copied, with split_special_tokens on (encode_special_tokens: a
        special token's string is encoded as text). A copy of its own: setting the flag on the
        shared tokenizer, which the step loop's thread and a server's request threads encode with at
        once, would race."""
        import tokenizers
        backend = tokenizers.Tokenizer.from_str(self.tok.backend_tokenizer.to_str())
        backend.encode_special_tokens = True
        return backend

    def text_ids(self, text):
        """Token ids of outside text: a special token's string stays text."""
        if not text:
            return []
        # a Python tokenizer: the flag is per call
        if getattr(self.tok, "backend_tokenizer", None) is None:
            return self.tok.encode(text, add_special_tokens=False, split_special_tokens=True)
        return self.splitter.encode(text, add_special_tokens=False).ids

    def run_ids(self, run):
        """Token ids of consecutive string parts, as one text. When every special token's string in
        it lies in a Template part, that is the tokenizer's own encoding of the whole (what it
        always was); otherwise the Template parts' special tokens are tokens, split out as the
        tokenizer splits them, and everything between them, outside text included, is text."""
        text, spans, at = "".join(run), [], 0
        for part in run:
            spans += [(at, at + len(part))] * isinstance(part, Template)
            at += len(part)
        if all(any(a <= m.start() and m.end() <= b for a, b in spans)
               for m in self.specials.finditer(text)):
            return self.ids(text)
        ids, chunk = [], ""
        for part in run:
            at = 0
            for m in self.specials.finditer(part) if isinstance(part, Template) else ():
                ids += (self.text_ids(chunk + part[at:m.start()])
                        + [self.tok.convert_tokens_to_ids(m.group())])
                chunk, at = "", m.end()
            chunk += part[at:]
        return ids + self.text_ids(chunk)

    def encode(self, parts, vis=None):
        """parts: strings and Img -> (ids, [[start, n, path]] of each image). Consecutive strings
        are one text (a Template part is the template's, any other string outside text: run_ids); an
        image goes in as VisionIO.expand's tokens (vis None, a text policy: image parts are left
        out)."""
        ids, images, run = [], [], []
        for part in [*parts, None]:
            if isinstance(part, str):
                run.append(part)
                continue
            ids += self.run_ids(run) if run else []
            run = []
            if isinstance(part, Img) and vis is not None:
                images.append([len(ids), len(vis.expand(part.path)), part.path])
                ids += vis.expand(part.path)
        return ids, images

@dataclass
class Transcript:
    ids: list = field(default_factory=list)       # [T] token ids
    mask: list = field(default_factory=list)      # [T] 1 where the policy wrote the token
    logprobs: list = field(default_factory=list)  # [T] sampling policy's logprob of each policy
                                                  # token (0.0 elsewhere)
    spans: list = field(default_factory=list)     # [{kind: route|answer|final, step, start, end}]
    starts: list = field(default_factory=lambda: [0])  # where each chat begins (--structure
                                                       # released: one a step)
    images: list = field(default_factory=list)    # [[start, n, path]]: the tokens of each image
                                                  # (VL policies)

    def new_chat(self, ids, images=()):
        """The next request is a new chat `ids` (the released structure), not a continuation of this
        one."""
        if self.ids:
            self.starts.append(len(self.ids))
        self.add_context(ids, images)

    def prompt(self):
        return self.ids[self.starts[-1]:]

    def prompt_images(self):
        return images_in(self.images, self.starts[-1], len(self.ids))

    def undo(self):
        """Drop the last policy span (a malformed step about to be sampled again); returns its
        ids."""
        sp = self.spans.pop()
        ids = self.ids[sp["start"]:]
        del self.ids[sp["start"]:], self.mask[sp["start"]:], self.logprobs[sp["start"]:]
        return ids

    def segments(self):
        """[[start, end]] of each chat: the rows a trainer takes (one for the transcript
        structure)."""
        return [[a, b] for a, b in zip(self.starts, self.starts[1:] + [len(self.ids)])]

    def add_context(self, ids, images=()):
        """Context tokens (mask 0); images: [[start within ids, n, path]] (ChatFormat.encode)."""
        self.images += [[len(self.ids) + a, n, p] for a, n, p in images]
        self.ids += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)

    def add_policy(self, ids, logprobs, kind, step):
        self.spans.append(dict(kind=kind, step=step, start=len(self.ids),
                               end=len(self.ids) + len(ids)))
        self.ids += ids
        self.mask += [1] * len(ids)
        self.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(ids)

def start_transcript(fmt, question, shots=None, image=None, vis=None):
    """The system prompt and the question (after the few-shot conversation `shots`, if given:
    few_shot_prefix); a visual question's image before it for a VL policy (vis)."""
    tr = Transcript()
    head = [Img(image)] if image and vis else []
    if shots:
        tr.add_context(shots)
        tr.add_context(*fmt.encode([fmt.user_open, *head, question, fmt.user_close], vis))
    else:
        tr.add_context(*fmt.encode([fmt.prefix_tpl[0], *head, question, fmt.prefix_tpl[1]], vis))
    return tr

def evidence_parts(kb, docs, pixels=False):
    """The documents of one KB as chat parts: numbered contents, and with pixels (a VL policy) each
    image document's picture before its caption."""
    parts = [f"Retrieved by {reward.KB_TO_RET[kb]}:"]
    for i, d in enumerate(docs):
        parts += ([f"\n[{i + 1}] "] + ([Img(d["path"])] if pixels and d.get("path") else [])
                  + [d["contents"]])
    return parts

def evidence_text(kb, docs):
    return "".join(evidence_parts(kb, docs))

def next_turn(fmt, user_text=None):
    """Template text after a policy turn: close it, optionally add a user turn, open the next
    assistant turn.
    user_text: a string, or a list of parts (ChatFormat.encode) when it holds images; the result is
    of the same kind."""
    # the template's pieces stay Template (ChatFormat.encode), user_text is outside
    if isinstance(user_text, list):
        return [Template(fmt.end_assistant + fmt.user_open), *user_text,
                Template(fmt.user_close[:-len(fmt.gen_prompt)] + fmt.gen_prompt)]
    mid = ("" if user_text is None
           else fmt.user_open + user_text + fmt.user_close[:-len(fmt.gen_prompt)])
    return fmt.end_assistant + mid + fmt.gen_prompt

class ChatTurns:
    """A chat of a transcript (token ids, ChatFormat's pieces around its turns) read back as chat
    messages, for an engine behind a chat API (remote.ChatEngine). Why from the ids: every caller
    of an engine (the step loop in both structures, few-shot prefixes, the baselines, the route
    probe, golden prefixes) hands it a prompt as ids, so reading them back serves all of them
    without a second description of the transcript that could drift from the ids. It is exact
    because the ids are split where the template's own special tokens are (token ids, not their
    strings): outside text holding a special token's string (ChatFormat.encode keeps it text)
    stays inside its message. A picture's expansion (images: [[start, n, path]]) becomes an image
    part. The server renders the messages with its own template; with the policy's template that
    is the chat's text again (tests/test_chat.py)."""
    SYSTEM = "\x03"  # a sentinel system prompt: the template's text around it

    def __init__(self, tok):
        self.tok, self.fmt = tok, ChatFormat(tok, self.SYSTEM)
        self.special = {i for i, t in tok.added_tokens_decoder.items() if t.special}
        f, mark = self.fmt, self.mark
        sys_open, rest = f.prefix_tpl[0].split(self.SYSTEM)
        # the pieces as read: the system turn's opening, its close with the first user turn's
        # opening, a user turn's opening and close (with the assistant's), an assistant turn's end
        self.head, self.after_system = mark(sys_open), mark(rest)
        self.user_open, self.user_close = mark(f.user_open), mark(f.user_close)
        self.end_assistant, self.gen_prompt = mark(f.end_assistant), mark(f.gen_prompt)

    def mark(self, template):
        """Template text with each special token's string as its id between private-use
        characters: the form the ids are read in (read)."""
        tid = self.tok.convert_tokens_to_ids
        return self.fmt.specials.sub(lambda m: f"\ue000{tid(m.group())}\ue001", template)

    def read(self, ids, images=()):
        """The text of ids, each special token id as mark writes it and each picture as
        \\ue002k\\ue003 (its index in images)."""
        spans = {start: (k, n) for k, (start, n, _) in enumerate(images)}
        out, run, at = [], [], 0
        while at < len(ids):
            if at in spans or ids[at] in self.special:
                out.append(self.tok.decode(run, clean_up_tokenization_spaces=False))
                run = []
                if at in spans:
                    k, n = spans[at]
                    out.append(f"\ue002{k}\ue003")
                    at += n
                    continue
                out.append(f"\ue000{ids[at]}\ue001")
            else:
                run.append(ids[at])
            at += 1
        return "".join(out) + self.tok.decode(run, clean_up_tokenization_spaces=False)

    def messages(self, ids, images=()):
        """([{role, content}] of the chat `ids`, whether the last message is to be continued): a
        prompt ends with an assistant turn opened, which the server opens itself, or with text in
        it, a last assistant message the server continues (ChatEngine.ask); content is a string,
        or with pictures a list of {"type": "text", "text"} and {"type": "image", "path"} parts.
        ValueError: ids that are not one chat of this template."""
        text = self.read(ids, images)
        if not text.startswith(self.head) or self.after_system not in text:
            raise ValueError("the prompt does not open with the chat template's system turn")
        system, rest = text[len(self.head):].split(self.after_system, 1)
        msgs, role = [("system", system)], "user"
        while True:
            close = self.user_close if role == "user" else self.end_assistant
            if close not in rest:
                break
            content, rest = rest.split(close, 1)
            msgs.append((role, content))
            if role == "user":
                role = "assistant"
            elif rest.startswith(self.user_open):
                rest, role = rest[len(self.user_open):], "user"
            elif rest.startswith(self.gen_prompt):  # two assistant turns in a row (after a stop)
                rest = rest[len(self.gen_prompt):]
            else:
                raise ValueError("an assistant turn is followed by neither a user turn nor one "
                                 "of its own")
        if role != "assistant":
            raise ValueError("the prompt does not end with an assistant turn opened")
        # text already in the open turn (IRCoT's sentences): a last assistant message to continue
        msgs += [("assistant", rest)] * bool(rest)
        return [dict(role=r, content=self.content(c, images)) for r, c in msgs], bool(rest)

    def content(self, text, images):
        """A message's text as read -> a string (special tokens' ids back to their strings), or
        text and image parts where it holds pictures."""
        text = re.sub("\ue000(\\d+)\ue001",
                      lambda m: self.tok.convert_ids_to_tokens(int(m.group(1))), text)
        pieces = re.split("\ue002(\\d+)\ue003", text)
        if len(pieces) == 1:
            return text
        parts = [dict(type="image", path=images[int(p)][2]) if i % 2
                 else dict(type="text", text=p) for i, p in enumerate(pieces)]
        return [p for p in parts if p.get("text") != ""]

    def reply_ids(self, text):
        """Token ids of a chat reply's text, as the transcript keeps the policy's turn: a special
        token's string in it stays text (the server's reply is outside text here)."""
        return self.fmt.text_ids(text)
