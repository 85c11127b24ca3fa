"""
serve.py: the router in use. `ask` a trained router one question (a picture with --image) and
watch each step as it happens; `serve` it behind an OpenAI-compatible endpoint, with a page at /
that draws its steps.

    python serve.py ask "Which country is the city Ulla Brenmark was born in part of?"
    python serve.py ask "On which continent is the country whose flag is shown?" \
        --model out/visual/vl/stepgrpo/final \
        --image data/mini/questions/images/vq705.png       # after `make visual`
    python serve.py ask "..." --retriever http://localhost:8000   # a running `retrievers.py serve`
    python serve.py serve --port 8080                             # then open http://localhost:8080/
    curl -s localhost:8080/v1/chat/completions -H 'content-type: application/json' -d \
        '{"model": "r1router", "messages": [{"role": "user", "content": "Where was Ulla born?"}]}'

`ask` and `serve` default to the main job's Step-GRPO checkpoint, out/demo/stepgrpo/final.
POST /v1/chat/completions takes OpenAI's chat request. The question is the last user message (its
text parts; a picture as an image_url part holding a data: URL). The whole routed loop runs, and
the answer comes in OpenAI's response shape: the final answer is the message content, and the steps
go in the extra field `steps` ([{step, sub_questions [{sub_question, kb}], evidence [{kb, id,
title}], answer}]). With "stream": true each step is sent as a server-sent event as soon as it
completes (OpenAI's chunk shape, the step in the chunk's extra field `step`), then the answer as
content, then [DONE].
Concurrent requests share one engine: a new request's trajectory joins the running batch
(rollout.StepLoop.run's `more`), and each trajectory keeps its own transcript, steps and evidence;
a client that leaves ends its trajectory (rollout.StepLoop.cancel). Fields the router cannot honour
(n > 1, tools, response_format, logprobs) and bad input get OpenAI's error shape with a one-line
reason (docs/serve.md lists every refusal). GET /v1/models, GET /health (with the count of
trajectories the server holds).
"""
import argparse
import asyncio
import base64
import binascii
import collections
import io
import itertools
import json
import signal
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import dataio
import reward
import rollout
import transcript

MAX_BODY_BYTES = 16 * 2**20  # a request's body (a picture's base64 and the question); 413 beyond it
MAX_IMAGE_BYTES = 8 * 2**20  # a request's picture, decoded
MAX_IMAGE_PIXELS = 4096 * 4096  # a request's picture, read from its header before it is decoded
PAGE = Path(__file__).with_name("serve.html")

class Refused(ValueError):
    """A request the server refuses: the one-line reason, the HTTP status, OpenAI's error param and
    code."""
    def __init__(self, message, param=None, status=400, code=None):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code

#### the router: one engine, a thread running the step loop, requests joining it

@dataclass(eq=False)
class Asked(rollout.Live):
    """A served trajectory: a Live of the step loop, who hears its steps, what they found."""
    notify: object = None  # notify(event), on the step loop's thread (Router.ask)
    step_evidence: dict = field(default_factory=dict)  # step -> its search's documents, as shown

def asked(q, chat, s):
    """Question q (a dataio.load_questions row, or id and question alone) as an Asked trajectory of
    the step loop with chat builder `chat` and Settings s, its transcript started."""
    return Asked(**vars(rollout.begin(q, 0, chat, s)))

class Router:
    """A policy's engine and the KBs' retriever behind one step loop on a thread of its own. ask()
    queues a trajectory; it joins the loop's running batch, and each of its steps is handed to the
    asker's `notify`."""
    def __init__(self, engine, retriever, s, known=()):
        self.engine, self.retriever, self.s = engine, retriever, s
        self.chat = rollout.step_chat(engine, s)
        self.known = {q["question"]: q for q in known}  # a question of the world: its id, steps
        # a token's string is at most `longest` characters (one a byte, byte-level BPE), so a
        # question of n characters is at least n / longest tokens: a bound that refuses a huge
        # question untokenized
        self.longest = max(map(len, engine.tok.get_vocab()))
        self.inbox, self.wake = collections.deque(), threading.Event()
        self.count = itertools.count()
        self.loop = rollout.StepLoop(engine, retriever, s, self.chat, events=self.on_event)
        threading.Thread(target=self.work, daemon=True).start()

    def check(self, question, picture):
        """Refuse what the policy cannot take before anything is decoded or tokenized: a picture for
        a text policy, a question whose characters alone need more tokens than its first step has
        room for."""
        if picture and getattr(self.engine, "vis", None) is None:
            raise Refused("the policy is a text model: it cannot take a picture (a VL checkpoint "
                          "can)", "messages")
        room, n = getattr(self.engine, "max_len", None), len(question)
        if room and n > (room - rollout.route_stop(self.engine.tok, self.s)[1]) * self.longest:
            raise Refused(f"the question is too long: {n} characters, at least "
                          f"{-(-n // self.longest)} tokens; the context holds {room}", "messages")

    def trajectory(self, question, image=None, temperature=None, top_p=None):
        """The request's Asked trajectory, its transcript started (the question tokenized: not on
        the event loop), or raise Refused when its first step does not fit the context."""
        q = self.known.get(question) or dict(id=f"req-{next(self.count)}", question=question)
        x = asked(dict(q, image=image), self.chat, self.s)
        need = len(x.tr.prompt()) + rollout.route_stop(self.engine.tok, self.s)[1]
        if getattr(self.engine, "max_len", None) and need > self.engine.max_len:
            raise Refused(f"the question is too long: its first step needs {need} tokens, the "
                          f"context holds {self.engine.max_len}", "messages")
        x.temperature, x.top_p = temperature, top_p
        return x

    def ask(self, x, notify):
        """Queue Asked trajectory x; notify(event) is called from the loop's thread after each of
        its steps."""
        x.notify = notify
        self.inbox.append(x)
        self.wake.set()

    def cancel(self, x):
        """End trajectory x (its client left) at its next turn; its last event is an error."""
        self.loop.cancel(x)

    def live(self):
        """The trajectories the server holds: queued, or in the step loop and not ended."""
        return len(self.inbox) + len(self.loop.live)

    def work(self):
        while True:
            self.wake.wait()  # the loop runs while it has trajectories, then waits for requests
            self.wake.clear()
            try:
                self.loop.run([], more=self.arrived)
            except Exception as e:  # noqa: BLE001 - a broken engine answers every waiting request,
                # and the server lives
                for x in [*self.loop.live.values(), *self.arrived()]:
                    x.notify(dict(type="error", error=f"the step loop failed: {e!r}"))
                self.loop.live.clear()

    def arrived(self):
        out = []
        while self.inbox:
            out.append(self.inbox.popleft())
        return out

    def on_event(self, x, kind, hits=None):
        for event in step_events(x, kind, hits):
            x.notify(event)

def step_events(live, kind, hits=None):
    """What Asked trajectory `live`'s last step shows (StepLoop's events): route (the step's
    sub-questions and KBs, or the stop), evidence, answer (the intermediate one), backtrack (the
    step popped) and summary (a policy with actions), final (the answer), error (a step that does
    not parse, an overflow, a cancel)."""
    x = live.traj
    t = x.steps[-1]["step"] if x.steps else 0
    if live.phase == "done" and x.final_answer is None:
        return [dict(type="error", error=x.error or "no answer")]
    acted = x.actions and x.actions[-1]["span"] == len(live.tr.spans) - 1
    if kind == "route" and acted:
        a = x.actions[-1]  # a backtrack names the step it popped
        step = a["popped"][0]["step"] if a["kind"] == "backtrack" else t
        return [dict(type=a["kind"], step=step, note=a["note"])]
    if kind == "route":
        if live.phase == "final":
            return [dict(type="stop", step=len(reward.by_step(x.steps)))]
        subs = [dict(sub_question=st["sub_question"], kb=st["kb"],
                     retriever=reward.KB_TO_RET[st["kb"]]) for st in x.steps if st["step"] == t]
        return [dict(type="route", step=t, sub_questions=subs)]
    if kind == "search":
        docs = [dict(sub_question=q, kb=kb, id=d["id"], title=d.get("title", ""),
                     text=d.get("contents", ""),
                     **({"image": data_url(d["path"])} if d.get("path") else {}))
                for q, kb, ds in hits for d in ds]
        live.step_evidence[t] = docs
        return [dict(type="evidence", step=t, evidence=docs)]
    if kind == "answer":
        return [dict(type="answer", step=t, answer=x.steps[-1]["answer"])]
    if kind == "final" and live.phase == "done":
        tr = live.tr
        usage = dict(prompt_tokens=len(tr.ids) - sum(tr.mask), completion_tokens=sum(tr.mask))
        return [dict(type="final", answer=x.final_answer, steps=steps_of(live), usage=usage)]
    return []

def steps_of(live):
    """The response's `steps` of Asked trajectory `live`: per routing step its sub-questions and
    KBs, the evidence's ids and titles, the answer."""
    ev = live.step_evidence
    return [dict(step=g[0]["step"],
                 sub_questions=[dict(sub_question=st["sub_question"], kb=st["kb"]) for st in g],
                 evidence=[dict(kb=d["kb"], id=d["id"], title=d["title"])
                           for d in ev.get(g[0]["step"], [])],
                 answer=g[0]["answer"]) for g in reward.by_step(live.traj.steps)]

def data_url(path):
    """An image file as a data: URL (the page draws an image hit's picture)."""
    return "data:image/png;base64," + base64.b64encode(Path(path).read_bytes()).decode()

#### the OpenAI-compatible request: checked cheapest first, so that a refusal costs little

UNSUPPORTED = {"n": lambda v: v not in (None, 1), "tools": bool,
               "tool_choice": lambda v: v not in (None, "none"), "functions": bool,
               "response_format": lambda v: v not in (None, {"type": "text"}), "logprobs": bool,
               "top_logprobs": lambda v: v not in (None, 0)}

async def read_body(request):
    """The request's body as JSON, or raise Refused: a media type other than JSON (415), more than
    MAX_BODY_BYTES (413, said before the rest is read), not JSON or nested too deep for the parser
    (400)."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/json" and not kind.endswith("+json"):
        raise Refused(f"content-type {kind or 'none'}: the body must be application/json",
                      status=415)
    over = Refused(f"the request body is over {MAX_BODY_BYTES // 2**20} MiB", status=413)
    if int(request.headers.get("content-length", "0") or 0) > MAX_BODY_BYTES:
        raise over
    raw = bytearray()
    async for chunk in request.stream():  # a chunked body has no length to go by
        raw += chunk
        if len(raw) > MAX_BODY_BYTES:
            raise over
    try:
        return json.loads(raw)
    except json.JSONDecodeError as e:
        raise Refused(f"the request body is not JSON ({dataio.json_error(e)})") from None
    except UnicodeDecodeError:
        raise Refused("the request body is not JSON (not UTF-8 text)") from None
    except RecursionError:
        raise Refused("the request body is nested too deeply to read") from None

def parse_request(body, name):
    """(question, the picture's data: URL or None, temperature, top_p, stream) of a chat request to
    model `name`, checked without decoding the picture or tokenizing the question; else raise
    Refused."""
    if not isinstance(body, dict):
        raise Refused("the request body is not a JSON object")
    if body.get("model", name) != name:
        raise Refused(f"the model {json.dumps(body['model'])[:80]} does not exist: this server "
                      f"serves {name!r}", "model", 404, "model_not_found")
    for k, bad in UNSUPPORTED.items():
        if bad(body.get(k)):
            raise Refused(f"{k}={json.dumps(body[k])[:80]}: the router cannot honour it (one "
                          "routed answer, plain text)", k)
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise Refused(f"stream={json.dumps(stream)[:80]}: true or false", "stream")
    for k in ("max_tokens", "max_completion_tokens"):  # not applied: each step has its own budget
        v = body.get(k)
        if v is not None and not (type(v) is int and v >= 1):
            raise Refused(f"{k}={json.dumps(v)[:80]}: an integer of at least 1", k)
    temperature, top_p = body.get("temperature"), body.get("top_p")
    if temperature is not None and not (number(temperature) and 0 <= temperature <= 2):
        raise Refused(f"temperature={json.dumps(temperature)[:80]}: a number in [0, 2]",
                      "temperature")
    if top_p is not None and not (number(top_p) and 0 < top_p <= 1):
        raise Refused(f"top_p={json.dumps(top_p)[:80]}: a number in (0, 1]", "top_p")
    return (*last_question(body.get("messages")), temperature, top_p, bool(stream))

def number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool)

def last_question(msgs):
    """(question, picture's data: URL or None) of the last user message: its text parts joined,
    whitespace collapsed, and at most one image_url part."""
    msgs = msgs if isinstance(msgs, list) else []
    users = [m for m in msgs if isinstance(m, dict) and m.get("role") == "user"]
    if not users:
        raise Refused("messages holds no user message: the question is the last one", "messages")
    content, texts, url = users[-1].get("content"), [], None
    if not isinstance(content, (str, list, type(None))):
        raise Refused(f"the last user message's content is {type(content).__name__}: a string or "
                      "a list of parts", "messages")
    for part in [dict(type="text", text=content)] if isinstance(content, str) else content or []:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "image_url":
            if url:
                raise Refused("the question holds two pictures; the router takes one", "messages")
            url = picture_url(part.get("image_url"))
        else:
            raise Refused(f"a message part of type {json.dumps(kind)[:40]}: only text and "
                          "image_url parts are read", "messages")
    question = " ".join(" ".join(texts).split())
    if not question:
        raise Refused("the last user message has no text: the question is empty", "messages")
    try:
        question.encode("utf-8")
    except UnicodeEncodeError:
        raise Refused("the question is not valid Unicode (a lone UTF-16 surrogate)",
                      "messages") from None
    return question, url

def picture_url(part):
    """An image_url part's data: URL, checked without decoding it: its decoded size from its
    base64's length."""
    if not isinstance(part, dict):
        raise Refused(f"image_url is {type(part).__name__}: an object with a url", "messages")
    url = part.get("url")
    if not isinstance(url, str):
        raise Refused(f"image_url.url is {type(url).__name__}: a data: URL", "messages")
    if not url.startswith("data:") or ";base64," not in url:
        raise Refused("image_url: only data: URLs with base64 data (the server fetches nothing)",
                      "messages")
    size = (len(url) - url.index(";base64,") - len(";base64,")) * 3 // 4
    if size > MAX_IMAGE_BYTES:
        raise Refused(f"image_url: the picture is {size / 2**20:.1f} MiB, more than "
                      f"{MAX_IMAGE_BYTES // 2**20} MiB", "messages")
    return url

def read_picture(url):
    """A data: URL's picture, decoded (RGB); Refused when it is not one this server reads. Its size
    is read from its header (PIL opens lazily) and checked before its pixels are decoded."""
    from PIL import Image
    try:
        raw = base64.b64decode(url.split(";base64,", 1)[1], validate=True)
    except (binascii.Error, ValueError):
        raise Refused("image_url: its base64 data does not decode", "messages") from None
    try:
        img = Image.open(io.BytesIO(raw))
        if img.width * img.height > MAX_IMAGE_PIXELS:
            raise Refused(f"image_url: the picture is {img.width} x {img.height} pixels, more than "
                          f"{MAX_IMAGE_PIXELS / 1e6:.1f} megapixels", "messages")
        img.load()
    except (OSError, Image.DecompressionBombError) as e:
        raise Refused(f"image_url: not a readable picture ({type(e).__name__})",
                      "messages") from None
    return img.convert("RGB")

def prepare(router, folder, question, url, temperature, top_p):
    """(trajectory, its picture's file or None): the slow part of a request, decoding the picture
    and tokenizing the question, run off the event loop. The picture is a file in `folder` (what the
    engines and the image KB read) while its trajectory runs; raises Refused, keeping no file."""
    image = None
    if url:
        picture = read_picture(url)
        image = Path(folder) / f"{uuid.uuid4().hex}.png"
        picture.save(image)
    try:
        return router.trajectory(question, image and str(image), temperature, top_p), image
    except BaseException:
        if image:
            image.unlink(missing_ok=True)
        raise

#### the HTTP server

def make_app(router, name):
    """The FastAPI app: /v1/chat/completions (plain and streamed), /v1/models, /health, / (the
    page)."""
    from fastapi import FastAPI, Request
    from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse
    app = FastAPI()
    app.state.router = router
    # a request's picture is a file while its trajectory runs, then removed; the folder goes when
    # the server exits
    app.state.pictures = tempfile.TemporaryDirectory(prefix="serve-pictures-")

    def error(e, kind="invalid_request_error"):  # OpenAI's error shape
        err = dict(message=str(e), type=kind, param=getattr(e, "param", None),
                   code=getattr(e, "code", None))
        return JSONResponse(dict(error=err), getattr(e, "status", 500))

    @app.exception_handler(Exception)
    async def broken(request, e):  # a bug, not the request's: OpenAI's shape, and the server lives
        return error(f"internal error: {type(e).__name__}", "server_error")

    @app.get("/health")
    def health():
        return dict(status="ok", model=name, trajectories=router.live())

    @app.get("/v1/models")
    def models():
        return dict(object="list", data=[dict(id=name, object="model", created=0,
                                              owned_by="r1router-nano")])

    @app.get("/")
    def page():
        return HTMLResponse(PAGE.read_text())

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        try:  # cheapest first: the body, its fields, what the policy takes; then the slow part
            question, url, temp, top_p, stream = parse_request(await read_body(request), name)
            router.check(question, url)
            x, image = await asyncio.to_thread(prepare, router, app.state.pictures.name, question,
                                               url, temp, top_p)
        except Refused as e:
            return error(e)
        events, loop = asyncio.Queue(), asyncio.get_running_loop()

        def notify(ev):  # on the step loop's thread
            if ev["type"] in ("final", "error") and image:
                image.unlink(missing_ok=True)  # the trajectory is over (its client there or not)
            loop.call_soon_threadsafe(events.put_nowait, ev)
        router.ask(x, notify)
        head = dict(id=f"chatcmpl-{uuid.uuid4().hex}", created=int(time.time()), model=name)
        if stream:
            return StreamingResponse(sse(router, x, events, head), media_type="text/event-stream")
        ev, steps = await until_final(router, x, events, request)
        if ev is None:  # the client left: nobody reads this
            return JSONResponse({}, 499)
        if ev["type"] == "error":
            return JSONResponse(dict(head, object="chat.completion", choices=[dict(
                index=0, message=dict(role="assistant", content=""), finish_reason="stop")],
                error=ev["error"], steps=steps_of(x)))
        usage = dict(ev["usage"], total_tokens=sum(ev["usage"].values()))
        return JSONResponse(dict(head, object="chat.completion", usage=usage, steps=ev["steps"],
                                 choices=[dict(index=0, finish_reason="stop", message=dict(
                                     role="assistant", content=ev["answer"]))]))

    return app

async def until_final(router, x, events, request):
    """(the final or error event, the step events before it) of trajectory x; (None, steps) when its
    client leaves first, which cancels x."""
    steps = []

    async def last():
        while (ev := await events.get())["type"] not in ("final", "error"):
            steps.append(ev)
        return ev

    async def gone():  # the body is read: what the connection says next is that the client left
        while (await request.receive())["type"] != "http.disconnect":
            pass
    done, left = asyncio.ensure_future(last()), asyncio.ensure_future(gone())
    await asyncio.wait({done, left}, return_when=asyncio.FIRST_COMPLETED)
    for task in (done, left):
        task.cancel()
    if not done.done() or done.cancelled():
        router.cancel(x)
        return None, steps
    return done.result(), steps

async def sse(router, x, events, head):
    """OpenAI's chunks as server-sent events: the role, then a chunk a step (its `step` field), then
    the answer. A client that leaves (Starlette cancels this stream) cancels trajectory x."""
    def chunk(delta, finish=None, **extra):
        return "data: " + json.dumps(dict(head, object="chat.completion.chunk", choices=[dict(
            index=0, delta=delta, finish_reason=finish)], **extra)) + "\n\n"
    over = False
    try:
        yield chunk(dict(role="assistant"))
        while (ev := await events.get())["type"] not in ("final", "error"):
            yield chunk({}, step=ev)
        over = True
        error = {"error": ev["error"]} if ev["type"] == "error" else {}
        yield chunk(dict(content=ev.get("answer") or ""), **error)
        yield chunk({}, "stop")
        yield "data: [DONE]\n\n"
    finally:
        if not over:
            router.cancel(x)

#### main

def load(args):
    """The engine for --model (its step format from the checkpoint), the retriever, the Settings."""
    import engines
    import retrievers
    if not (Path(args.model) / "config.json").is_file():
        sys.exit(f"error: {args.model}: no model there; run `make demo` first (its Step-GRPO "
                 "checkpoint is the default), or pass --model <folder>")
    trained = Path(args.model) / transcript.FORMAT
    fmt = json.loads(trained.read_text()) if trained.is_file() else {}
    s = rollout.Settings(max_steps=args.max_steps, topk=args.topk, temperature=args.temperature,
                         **{k: fmt[k] for k in transcript.FORMAT_FLAGS if k in fmt})
    try:
        ret = retrievers.make_retriever(args.retriever, args.data)
        splits = [sp for sp in ("train", "dev", "test")
                  if (Path(args.data) / "questions" / f"{sp}.jsonl").is_file()]
        known = [q for sp in splits for q in dataio.load_questions(args.data, sp)
                 ] if not args.retriever.startswith("http") else []
    except dataio.DataError as e:
        sys.exit(f"error: {e}")
    # ask: one trajectory's KV cache (zeroing the whole server's takes seconds on a CPU), and the
    # block vLLM keeps out of use
    one = args.command == "ask" and args.backend == "vllm"
    kv = dict(kv_tokens=args.max_model_len + engines.CPU_BLOCK) if one else {}
    engine = engines.make_engine(args.backend, args.model, max_images=s.max_images,
                                 max_model_len=args.max_model_len, **kv)
    return engine, ret, s, known

def ask(args):
    """One question through the step loop, each step printed as it completes."""
    if args.image:  # before the engine's start
        from PIL import Image
        try:
            Image.open(args.image).load()
        except (OSError, Image.DecompressionBombError) as e:
            why = "file not found" if isinstance(e, FileNotFoundError) else \
                f"not a readable picture ({type(e).__name__})"
            sys.exit(f"error: --image {args.image}: {why}")
    engine, ret, s, known = load(args)
    chat = rollout.step_chat(engine, s)
    if args.image and getattr(engine, "vis", None) is None:
        print(f"note: {args.model} is a text policy: it reads no picture; the image KB's search "
              "still looks at it", flush=True)
    q = next((dict(k, image=args.image) for k in known if k["question"] == args.question),
             dict(id="ask", question=args.question, image=args.image))
    show = lambda x, kind, hits=None: [print(line(ev), flush=True)  # noqa: E731
                                       for ev in step_events(x, kind, hits)]
    rollout.StepLoop(engine, ret, s, chat, events=show).run([asked(q, chat, s)])

def line(ev):
    """One printed line of an event."""
    if ev["type"] == "route":
        return f"step {ev['step'] + 1}: " + "; ".join(f"{p['sub_question']} -> {p['retriever']}"
                                                      for p in ev["sub_questions"])
    if ev["type"] == "evidence":
        return "  evidence: " + "; ".join(f"[{d['kb']}] {d['title'] or d['id']}"
                                          for d in ev["evidence"])
    if ev["type"] == "answer":
        return f"  answer: {ev['answer']}"
    if ev["type"] == "stop":
        return f"step {ev['step'] + 1}: no more sub-questions"
    if ev["type"] in ("backtrack", "summary"):
        return f"{ev['type']} (step {ev['step'] + 1}): {ev['note']}"
    if ev["type"] == "final":
        return f"answer: {ev['answer']}"
    return f"error: {ev['error']}"

def get_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["ask", "serve"])
    ap.add_argument("question", nargs="?", help="ask: the question")
    ap.add_argument("--image", default=None, help="ask: a picture the question is about")
    ap.add_argument("--model", default="out/demo/stepgrpo/final",
                    help="the trained router (the main job's Step-GRPO)")
    ap.add_argument("--data", default="data/mini",
                    help="the KBs' folder (and its questions: a known one shows its id)")
    ap.add_argument("--retriever", default="dense",
                    help="dense | bm25 | hybrid | http://host:port of retrievers.py serve")
    ap.add_argument("--backend", default="vllm", choices=["vllm", "hf"])
    ap.add_argument("--topk", type=int, default=1,
                    help="evidence documents a sub-question (the main job trains with 1)")
    ap.add_argument("--max_steps", type=int, default=3)
    ap.add_argument("--max_model_len", type=int, default=4096)
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="0: greedy (a request's own temperature wins)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8080)
    ap.add_argument("--name", default="r1router", help="serve: the model name /v1/models lists")
    args = ap.parse_args(argv)
    if args.command == "ask" and not args.question:
        ap.error("ask needs a question")
    return args

if __name__ == "__main__":
    args = get_args()
    if args.command == "ask":
        ask(args)
        import engines
        engines.exit_now()  # the engine and the process end together
    else:
        import uvicorn
        engine, ret, s, known = load(args)
        print(f"serving {args.model} as {args.name!r} on http://{args.host}:{args.port}/ (the "
              "page), /v1/chat/completions", flush=True)
        app = make_app(Router(engine, ret, s, known), args.name)
        # uvicorn re-raises Ctrl-C or SIGTERM after its graceful shutdown; SIGTERM's default would
        # end the process before the finally below
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        try:
            uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
        finally:
            app.state.pictures.cleanup()
