"""
serve.py: the router in use. `ask` a trained router one question (a picture with --image) and watch each step as it
happens; `serve` it behind an OpenAI-compatible endpoint, with a page at / that draws its steps.

    python serve.py ask "Which country is the city Ulla Brenmark was born in part of?"   # out/demo/stepgrpo/final
    python serve.py ask "On which continent is the country whose flag is shown?" --model out/visual/vl/stepgrpo/final \
        --image data/mini/questions/images/vq705.png                    # after `make visual`
    python serve.py ask "..." --retriever http://localhost:8000         # the KBs of a running `retrievers.py serve`
    python serve.py serve --port 8080                                   # then open http://localhost:8080/
    curl -s localhost:8080/v1/chat/completions -H 'content-type: application/json' \
        -d '{"model": "r1router", "messages": [{"role": "user", "content": "Where was Ulla Brenmark born?"}]}'

POST /v1/chat/completions takes OpenAI's chat request. The question is the last user message (its text parts; a
picture as an image_url part holding a data: URL). The whole routed loop runs, and the answer comes in OpenAI's
response shape: the final answer is the message content, and the steps go in the extra field `steps`
([{step, sub_questions [{sub_question, kb}], evidence [{kb, id, title}], answer}]). With "stream": true each step is
sent as a server-sent event as soon as it completes (OpenAI's chunk shape, the step in the chunk's extra field
`step`), then the answer as content, then [DONE].
Concurrent requests share one engine: a new request's trajectory joins the running batch (rollout.StepLoop.run's
`more`), and each trajectory keeps its own transcript, steps and evidence. Fields the router cannot honour (n > 1,
tools, response_format, logprobs) and bad input get a 400 with a one-line reason. GET /v1/models, GET /health.
"""
import argparse
import asyncio
import base64
import binascii
import io
import itertools
import json
import queue
import signal
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import dataio
import reward
import rollout
import transcript

MAX_IMAGE_BYTES = 8 * 2**20  # a request's picture, decoded
PAGE = Path(__file__).with_name("serve.html")

#### the router: one engine, a thread running the step loop, requests joining it

class Router:
    """A policy's engine and the KBs' retriever behind one step loop on a thread of its own. ask() queues a question;
    its trajectory joins the loop's running batch, and each of its steps is handed to the asker's `notify`."""
    def __init__(self, engine, retriever, s, known=()):
        self.engine, self.retriever, self.s = engine, retriever, s
        self.chat = rollout.step_chat(engine, s)
        self.known = {q["question"]: q for q in known}  # a question of the world: its id and gold steps
        self.inbox, self.count = queue.Queue(), itertools.count()
        self.loop = rollout.StepLoop(engine, retriever, s, self.chat, events=self.on_event)
        threading.Thread(target=self.work, daemon=True).start()

    def trajectory(self, question, image=None, temperature=None, top_p=None):
        """The request's trajectory (its transcript started), or a one-line reason it cannot run."""
        q = dict(self.known.get(question) or dict(id=f"req-{next(self.count)}", question=question), image=image)
        if image and getattr(self.engine, "vis", None) is None:
            return None, "the policy is a text model: it cannot take a picture (a VL checkpoint can)"
        x = rollout.trajectory(q, 0, self.chat, self.s)
        need = len(x["tr"].prompt()) + rollout.route_stop(self.engine.tok, self.s)[1]
        if getattr(self.engine, "max_len", None) and need > self.engine.max_len:
            return None, (f"the question is too long: its first step needs {need} tokens, the context holds "
                          f"{self.engine.max_len}")
        x.update({k: v for k, v in (("temperature", temperature), ("top_p", top_p)) if v is not None})
        return x, None

    def ask(self, x, notify):
        """Queue trajectory x; notify(event) is called from the loop's thread after each of its steps."""
        x["notify"] = notify
        self.inbox.put(x)

    def work(self):
        while True:
            first = [self.inbox.get()]
            try:
                self.loop.run(first, more=self.arrived)
            except Exception as e:  # noqa: BLE001 - a broken engine answers every waiting request, and the server lives
                for x in first + self.arrived():
                    x["notify"](dict(type="error", error=f"the step loop failed: {e!r}"))

    def arrived(self):
        out = []
        while True:
            try:
                out.append(self.inbox.get_nowait())
            except queue.Empty:
                return out

    def on_event(self, x, kind, hits=None):
        for event in step_events(x, kind, hits):
            x["notify"](event)

def step_events(x, kind, hits=None):
    """What trajectory x's last step shows (StepLoop's events): route (the step's sub-questions and KBs, or the stop),
    evidence, answer (the intermediate one), backtrack (the step popped) and summary (a policy with actions), final
    (the answer), error (a step that does not parse, an overflow)."""
    t = x["steps"][-1]["step"] if x["steps"] else 0
    if x["phase"] == "done" and x["final_answer"] is None:
        return [dict(type="error", error=x["error"] or "no answer")]
    if kind == "route" and x["actions"] and x["actions"][-1]["span"] == len(x["tr"].spans) - 1:  # just acted
        a = x["actions"][-1]  # a backtrack names the step it popped
        return [dict(type=a["kind"], step=a["popped"][0]["step"] if a["kind"] == "backtrack" else t, note=a["note"])]
    if kind == "route":
        if x["phase"] == "final":
            return [dict(type="stop", step=len(reward.by_step(x["steps"])))]
        subs = [dict(sub_question=st["sub_question"], kb=st["kb"], retriever=reward.KB_TO_RET[st["kb"]])
                for st in x["steps"] if st["step"] == t]
        return [dict(type="route", step=t, sub_questions=subs)]
    if kind == "search":
        docs = [dict(sub_question=q, kb=kb, id=d["id"], title=d.get("title", ""), text=d.get("contents", ""),
                     **({"image": data_url(d["path"])} if d.get("path") else {})) for q, kb, ds in hits for d in ds]
        x.setdefault("step_evidence", {})[t] = docs
        return [dict(type="evidence", step=t, evidence=docs)]
    if kind == "answer":
        return [dict(type="answer", step=t, answer=x["steps"][-1]["answer"])]
    if kind == "final" and x["phase"] == "done":
        return [dict(type="final", answer=x["final_answer"], steps=steps_of(x),
                     usage=dict(prompt_tokens=len(x["tr"].ids) - sum(x["tr"].mask), completion_tokens=sum(x["tr"].mask)))]
    return []

def steps_of(x):
    """The response's `steps`: per routing step its sub-questions and KBs, the evidence's ids and titles, the answer."""
    ev = x.get("step_evidence", {})
    return [dict(step=g[0]["step"], sub_questions=[dict(sub_question=st["sub_question"], kb=st["kb"]) for st in g],
                 evidence=[dict(kb=d["kb"], id=d["id"], title=d["title"]) for d in ev.get(g[0]["step"], [])],
                 answer=g[0]["answer"]) for g in reward.by_step(x["steps"])]

def data_url(path):
    """An image file as a data: URL (the page draws an image hit's picture)."""
    return "data:image/png;base64," + base64.b64encode(Path(path).read_bytes()).decode()

#### the OpenAI-compatible request

UNSUPPORTED = {"n": lambda v: v not in (None, 1), "tools": bool, "tool_choice": lambda v: v not in (None, "none"),
               "functions": bool, "response_format": lambda v: v not in (None, {"type": "text"}), "logprobs": bool,
               "top_logprobs": lambda v: v not in (None, 0)}

def parse_request(body):
    """(question, picture (a PIL image) or None, temperature, top_p), or raise ValueError with the one-line reason a
    400 gives."""
    if not isinstance(body, dict):
        raise ValueError("the request body is not a JSON object")
    for k, bad in UNSUPPORTED.items():
        if bad(body.get(k)):
            raise ValueError(f"{k}={json.dumps(body[k])[:80]}: the router cannot honour it (one routed answer, plain text)")
    msgs = body.get("messages")
    users = [m for m in msgs if isinstance(m, dict) and m.get("role") == "user"] if isinstance(msgs, list) else []
    if not users:
        raise ValueError("messages holds no user message: the question is the last one")
    content, texts, image = users[-1].get("content"), [], None
    for part in [dict(type="text", text=content)] if isinstance(content, str) else content or []:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "image_url":
            if image:
                raise ValueError("the question holds two pictures; the router takes one")
            image = read_picture((part.get("image_url") or {}).get("url", ""))
        else:
            raise ValueError(f"a message part of type {kind!r}: only text and image_url parts are read")
    question = " ".join(" ".join(texts).split())
    if not question:
        raise ValueError("the last user message has no text: the question is empty")
    temperature, top_p = body.get("temperature"), body.get("top_p")
    if temperature is not None and not (isinstance(temperature, (int, float)) and 0 <= temperature <= 2):
        raise ValueError(f"temperature={temperature!r}: a number in [0, 2]")
    if top_p is not None and not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise ValueError(f"top_p={top_p!r}: a number in (0, 1]")
    return question, image, temperature, top_p

def read_picture(url):
    """A data: URL's picture, decoded (RGB); ValueError when it is not one this server can read."""
    from PIL import Image
    if not url.startswith("data:") or ";base64," not in url:
        raise ValueError("image_url: only data: URLs with base64 data (the server fetches nothing)")
    try:
        raw = base64.b64decode(url.split(";base64,", 1)[1], validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("image_url: its base64 data does not decode") from None
    if len(raw) > MAX_IMAGE_BYTES:
        raise ValueError(f"image_url: the picture is {len(raw) / 2**20:.1f} MiB, more than {MAX_IMAGE_BYTES // 2**20} MiB")
    try:
        img = Image.open(io.BytesIO(raw))
        img.load()
    except (OSError, Image.DecompressionBombError) as e:
        raise ValueError(f"image_url: not a readable picture ({type(e).__name__})") from None
    return img.convert("RGB")

#### the HTTP server

def make_app(router, name):
    """The FastAPI app: /v1/chat/completions (plain and streamed), /v1/models, /health, / (the page)."""
    from fastapi import FastAPI, Request
    from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse
    app = FastAPI()
    # a request's picture is a file (what the engines and the image KB read) while its trajectory runs, then removed;
    # the folder goes when the server exits
    app.state.pictures = tempfile.TemporaryDirectory(prefix="serve-pictures-")
    error = lambda msg, code=400: JSONResponse(dict(error=dict(message=msg, type="invalid_request_error")), code)  # noqa

    @app.get("/health")
    def health():
        return dict(status="ok", model=name)

    @app.get("/v1/models")
    def models():
        return dict(object="list", data=[dict(id=name, object="model", created=0, owned_by="r1router-nano")])

    @app.get("/")
    def page():
        return HTMLResponse(PAGE.read_text())

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        try:
            body = json.loads(await request.body())
            question, picture, temperature, top_p = parse_request(body)
        except json.JSONDecodeError as e:
            return error(f"the request body is not JSON ({dataio.json_error(e)})")
        except ValueError as e:
            return error(str(e))
        image = None
        if picture:
            image = Path(app.state.pictures.name) / f"{uuid.uuid4().hex}.png"
            picture.save(image)
        x, why = router.trajectory(question, image and str(image), temperature, top_p)
        if why:
            image and image.unlink()
            return error(why)
        events, loop = asyncio.Queue(), asyncio.get_running_loop()

        def notify(ev):  # on the step loop's thread
            if ev["type"] in ("final", "error") and image:
                image.unlink(missing_ok=True)  # the trajectory is over (whether or not its client still listens)
            loop.call_soon_threadsafe(events.put_nowait, ev)
        router.ask(x, notify)
        head = dict(id=f"chatcmpl-{x['qid']}", created=int(time.time()), model=name)
        if body.get("stream"):
            return StreamingResponse(stream(events, head), media_type="text/event-stream")
        steps = []
        while (ev := await events.get())["type"] not in ("final", "error"):
            steps.append(ev)
        if ev["type"] == "error":
            return JSONResponse(dict(head, object="chat.completion", choices=[dict(
                index=0, message=dict(role="assistant", content=""), finish_reason="stop")], error=ev["error"],
                steps=steps_of(x)))
        return JSONResponse(dict(head, object="chat.completion", usage=dict(
            ev["usage"], total_tokens=sum(ev["usage"].values())), steps=ev["steps"], choices=[dict(
                index=0, message=dict(role="assistant", content=ev["answer"]), finish_reason="stop")]))

    return app

async def stream(events, head):
    """OpenAI's chunks as server-sent events: the role, then a chunk a step (its `step` field), then the answer."""
    chunk = lambda delta, finish=None, **extra: "data: " + json.dumps(dict(  # noqa: E731
        head, object="chat.completion.chunk", choices=[dict(index=0, delta=delta, finish_reason=finish)], **extra)) + "\n\n"
    yield chunk(dict(role="assistant"))
    while (ev := await events.get())["type"] not in ("final", "error"):
        yield chunk({}, step=ev)
    yield chunk(dict(content=ev.get("answer") or ""), **({"error": ev["error"]} if ev["type"] == "error" else {}))
    yield chunk({}, "stop")
    yield "data: [DONE]\n\n"

#### main

def load(args):
    """The engine for --model (its step format from the checkpoint), the retriever, the Settings."""
    import engines
    import retrievers
    if not (Path(args.model) / "config.json").is_file():
        sys.exit(f"error: {args.model}: no model there; run `make demo` first (its Step-GRPO checkpoint is the "
                 "default), or pass --model <folder>")
    fmt = json.loads((Path(args.model) / transcript.FORMAT).read_text()) if (Path(args.model) / transcript.FORMAT).is_file() else {}
    s = rollout.Settings(max_steps=args.max_steps, topk=args.topk, temperature=args.temperature,
                         **{k: fmt[k] for k in transcript.FORMAT_FLAGS if k in fmt})
    try:
        ret = retrievers.make_retriever(args.retriever, args.data)
        known = [q for sp in ("train", "dev", "test") if (Path(args.data) / "questions" / f"{sp}.jsonl").is_file()
                 for q in dataio.load_questions(args.data, sp)] if not args.retriever.startswith("http") else []
    except dataio.DataError as e:
        sys.exit(f"error: {e}")
    engine = engines.make_engine(args.backend, args.model, max_images=s.max_images, max_model_len=args.max_model_len)
    return engine, ret, s, known

def ask(args):
    """One question through the step loop, each step printed as it completes."""
    if args.image:  # before the engine's start
        from PIL import Image
        try:
            Image.open(args.image).load()
        except (OSError, Image.DecompressionBombError) as e:
            sys.exit(f"error: --image {args.image}: " + ("file not found" if isinstance(e, FileNotFoundError) else
                                                         f"not a readable picture ({type(e).__name__})"))
    engine, ret, s, known = load(args)
    chat = rollout.step_chat(engine, s)
    if args.image and getattr(engine, "vis", None) is None:
        print(f"note: {args.model} is a text policy: it reads no picture; the image KB's search still looks at it",
              flush=True)
    q = next((dict(k, image=args.image) for k in known if k["question"] == args.question),
             dict(id="ask", question=args.question, image=args.image))
    show = lambda x, kind, hits=None: [print(line(ev), flush=True) for ev in step_events(x, kind, hits)]  # noqa
    rollout.StepLoop(engine, ret, s, chat, events=show).run([rollout.trajectory(q, 0, chat, s)])

def line(ev):
    """One printed line of an event."""
    if ev["type"] == "route":
        return f"step {ev['step'] + 1}: " + "; ".join(f"{p['sub_question']} -> {p['retriever']}" for p in ev["sub_questions"])
    if ev["type"] == "evidence":
        return "  evidence: " + "; ".join(f"[{d['kb']}] {d['title'] or d['id']}" for d in ev["evidence"])
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
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["ask", "serve"])
    ap.add_argument("question", nargs="?", help="ask: the question")
    ap.add_argument("--image", default=None, help="ask: a picture the question is about")
    ap.add_argument("--model", default="out/demo/stepgrpo/final", help="the trained router (the main job's Step-GRPO)")
    ap.add_argument("--data", default="data/mini", help="the KBs' folder (and its questions: a known one shows its id)")
    ap.add_argument("--retriever", default="dense", help="dense | bm25 | hybrid | http://host:port of retrievers.py serve")
    ap.add_argument("--backend", default="vllm", choices=["vllm", "hf"])
    ap.add_argument("--topk", type=int, default=1, help="evidence documents a sub-question (the main job trains with 1)")
    ap.add_argument("--max_steps", type=int, default=3)
    ap.add_argument("--max_model_len", type=int, default=4096)
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy (a request's own temperature wins)")
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
        print(f"serving {args.model} as {args.name!r} on http://{args.host}:{args.port}/ (the page), /v1/chat/completions",
              flush=True)
        app = make_app(Router(engine, ret, s, known), args.name)
        # uvicorn re-raises Ctrl-C or SIGTERM after its graceful shutdown; SIGTERM's default would end the process
        # before the finally below
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        try:
            uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
        finally:
            app.state.pictures.cleanup()
