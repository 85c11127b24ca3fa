"""serve.py: the router behind a real HTTP server on loopback. The policy is rollout.GoldPolicy (the gold steps of
the tiny world's questions, through the real step loop and BM25 retrieval), so every response can be checked against
the question's own gold steps: plain and streamed through the openai client, curl, bad input answered 400 while the
server keeps serving, 8 concurrent requests none of which sees another's steps or evidence; a request's picture read
by the tiny VL model's processor and not kept; `serve.py ask` with the tiny VL policy and a picture; the page in
headless Chromium where it is installed."""
import base64
import contextlib
import json
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import quote

import pytest

import dataio
import engines
import prepare
import retrievers
import reward
import rollout
import serve

ROOT = Path(__file__).resolve().parents[1]

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

@contextlib.contextmanager
def serving(policy, ret, qs):
    """serve.make_app around a Router of policy on loopback: (base URL, the app's folder for requests' pictures)."""
    import uvicorn
    app = serve.make_app(serve.Router(policy, ret, rollout.Settings(topk=2), known=qs), "r1router")
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=srv.run, daemon=True).start()
    while not srv.started:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}", Path(app.state.pictures.name)
    finally:
        srv.should_exit = True

@pytest.fixture(scope="module")
def server(tiny_index):
    """The server on loopback: (base URL, the questions it knows, the retriever, its pictures' folder)."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(prepare.DEFAULT_MODEL)
    qs = [q for q in dataio.load_questions(tiny_index, "test") if q["steps"]][:8]
    policy, ret = rollout.GoldPolicy(tok, qs), retrievers.Retriever(tiny_index, "bm25")
    policy.max_len = 3000  # a context, so that a too-long question is refused
    with serving(policy, ret, qs) as (url, pictures):
        yield url, qs, ret, pictures

def gold_steps(q, ret, k=2):
    """What the response's `steps` must be for q: its gold steps, each with the BM25 top-k of its sub-question."""
    return [dict(step=t, sub_questions=[dict(sub_question=s["sub_question"], kb=s["kb"]) for s in g],
                 evidence=[dict(kb=s["kb"], id=d["id"], title=d["title"]) for s in g
                           for d in ret.search([s["sub_question"]], s["kb"], k)[0]],
                 answer=reward.group_answer(g))
            for t, g in enumerate(reward.by_step(reward.group_steps(q["steps"])))]

def test_the_openai_client_gets_the_answer_and_the_steps_plain_and_streamed(server):
    from openai import OpenAI
    url, qs, ret, _ = server
    client = OpenAI(base_url=url + "/v1", api_key="none")
    assert [m.id for m in client.models.list().data] == ["r1router"]
    q = qs[0]
    r = client.chat.completions.create(model="r1router", messages=[{"role": "user", "content": q["question"]}])
    assert r.choices[0].message.content == q["answers"][0] and r.object == "chat.completion"
    assert r.model_extra["steps"] == gold_steps(q, ret) and r.usage.completion_tokens > 0
    chunks = list(client.chat.completions.create(model="r1router", stream=True,
                                                 messages=[{"role": "user", "content": [{"type": "text", "text": q["question"]}]}]))
    events = [c.model_extra["step"] for c in chunks if c.model_extra.get("step")]
    n = len(reward.by_step(q["steps"]))
    assert [e["type"] for e in events] == ["route", "evidence", "answer"] * n + ["stop"]
    assert [[{k: p[k] for k in ("sub_question", "kb")} for p in e["sub_questions"]] for e in events if e["type"] == "route"] \
        == [s["sub_questions"] for s in gold_steps(q, ret)]
    assert all(p["retriever"] == reward.KB_TO_RET[p["kb"]] for e in events if e["type"] == "route" for p in e["sub_questions"])
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == q["answers"][0]
    assert chunks[-1].choices[0].finish_reason == "stop"

def test_curl_and_bad_input_get_a_400_with_one_line_and_the_server_keeps_serving(server, tiny_index):
    url, qs, _, pictures = server
    post = lambda body: subprocess.run(["curl", "-s", "-w", "\\n%{http_code}", url + "/v1/chat/completions", "-H",  # noqa
                                        "content-type: application/json", "--data-binary", "@-"], input=body,
                                       capture_output=True, text=True).stdout
    ok = post(json.dumps(dict(model="r1router", messages=[dict(role="user", content=qs[1]["question"])])))
    body, code = ok.rsplit("\n", 1)
    assert code == "200" and json.loads(body)["choices"][0]["message"]["content"] == qs[1]["answers"][0]
    picture = dataio.load_kb(tiny_index, "image")[0]["path"]
    pic = "data:image/png;base64," + base64.b64encode(Path(picture).read_bytes()).decode()
    user = lambda content: dict(model="r1router", messages=[dict(role="user", content=content)])  # noqa: E731
    cases = [("{not json", "not JSON"),
             (json.dumps(dict(model="r1router", messages=[dict(role="system", content="hi")])), "no user message"),
             (json.dumps(dict(user(qs[0]["question"]), n=2)), "n=2: the router cannot honour it"),
             (json.dumps(dict(user(qs[0]["question"]), tools=[dict(type="function")])), "tools="),
             (json.dumps(dict(user(qs[0]["question"]), response_format=dict(type="json_object"))), "response_format="),
             (json.dumps(dict(user(qs[0]["question"]), logprobs=True)), "logprobs=true"),
             (json.dumps(user([dict(type="text", text="What is shown?"), dict(type="image_url", image_url=dict(url=pic))])),
              "text model: it cannot take a picture"),
             # the policy's kind is checked before the picture is decoded (a VL policy's refusal: the test below)
             (json.dumps(user([dict(type="text", text="x"), dict(type="image_url", image_url=dict(
                 url="data:image/png;base64," + base64.b64encode(b"not a picture").decode()))])),
              "text model: it cannot take a picture"),
             (json.dumps(user([dict(type="image_url", image_url=dict(url="http://example.com/a.png"))])), "only data: URLs"),
             (json.dumps(user([dict(type="text", text="x"), dict(type="image_url", image_url=dict(
                 url="data:image/png;base64," + "A" * (12 * 2**20)))])), "more than 8 MiB"),
             (json.dumps(user("Where was Ulla born? " * 600)), "the question is too long")]
    for body, words in cases:
        out, code = post(body).rsplit("\n", 1)
        msg = json.loads(out)["error"]["message"]
        assert code == "400" and words in msg and "\n" not in msg, (words, code, out[:300])
    assert post(json.dumps(user(qs[2]["question"]))).endswith("200")  # still serving
    assert not any(pictures.iterdir())  # the refused picture was not kept

def test_eight_concurrent_requests_each_get_their_own_steps_and_evidence(server):
    from openai import OpenAI
    url, qs, ret, _ = server
    client = OpenAI(base_url=url + "/v1", api_key="none")
    ask = lambda q: client.chat.completions.create(model="r1router", messages=[{"role": "user", "content": q["question"]}])  # noqa
    with ThreadPoolExecutor(8) as ex:
        answers = list(ex.map(ask, qs))
    for q, r in zip(qs, answers):
        assert r.choices[0].message.content == q["answers"][0] and r.model_extra["steps"] == gold_steps(q, ret)

@pytest.mark.slow
def test_ask_takes_a_picture_with_a_vl_policy_and_says_a_text_policy_cannot(tiny_model_dir, tiny_index, tmp_path, capsys):
    # the VL policy through the real command line; the text policy and the bad input through serve.ask in this process
    # (the same code after the argument parsing; a process would be most of their time)
    vl = prepare.prepare_vl(tmp_path / "idefics3", text_model=tiny_model_dir)
    q = dataio.load_questions(tiny_index, "visual_test")[0]
    argv = ["ask", q["question"], "--image", q["image"], "--data", str(tiny_index), "--retriever", "bm25", "--backend", "hf",
            "--max_model_len", "2048"]
    r = subprocess.run([sys.executable, str(ROOT / "serve.py"), *argv, "--model", str(vl)], capture_output=True, text=True,
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1].startswith(("answer: ", "error: "))  # a random policy: a format failure
    serve.ask(serve.get_args(argv + ["--model", str(tiny_model_dir)]))
    assert "is a text policy: it reads no picture" in capsys.readouterr().out
    with pytest.raises(SystemExit, match=r"run `make demo` first \(its Step-GRPO checkpoint is the default\), or pass "
                                         r"--model <folder>$"):
        serve.ask(serve.get_args(argv[:2] + ["--model", str(tmp_path / "none")]))
    (tmp_path / "bad.png").write_text("not a picture")
    for pic, why in ((tmp_path / "bad.png", "not a readable picture (UnidentifiedImageError)"),
                     (tmp_path / "no.png", "file not found")):  # said before the engine starts
        with pytest.raises(SystemExit) as e:
            serve.ask(serve.get_args(argv[:2] + ["--image", str(pic)]))
        assert e.value.code == f"error: --image {pic}: {why}"

def test_ask_starts_its_engine_with_one_trajectorys_kv_cache(tiny_model_dir, tiny_index):
    # the server keeps the evaluation's cache (CPU_KV_TOKENS, zeroed whole at start: ~2 s of a 23 s ask with SmolLM2);
    # one question's trajectory fits in max_model_len tokens (vLLM refuses to start with a cache that cannot hold one)
    argv = ["ask", "q", "--model", str(tiny_model_dir), "--data", str(tiny_index), "--retriever", "bm25"]
    engine = serve.load(serve.get_args(argv + ["--max_model_len", "2048"]))[0]
    cache = engine.llm.llm_engine.vllm_config.cache_config
    assert cache.kv_cache_memory_bytes == (2048 + 32) * engines.kv_bytes_per_token(tiny_model_dir, "float32")

@pytest.mark.slow
def test_a_vl_policy_reads_the_requests_picture_and_the_server_keeps_no_copy(tiny_model_dir, tiny_index, tmp_path):
    # the tiny VL model's processor under the gold policy: the picture sent as OpenAI's image_url part is what finds
    # the entity's picture at step 1 (the sub-question alone does not name it), plain and streamed; then it is deleted
    import vision
    from openai import BadRequestError, OpenAI
    from test_serve_attack import png_header
    vis = vision.VisionIO.load(prepare.prepare_vl(tmp_path / "idefics3", text_model=tiny_model_dir))
    visual = dataio.load_questions(tiny_index, "visual_test")
    wording = Counter(q["question"] for q in visual)  # the gold policy knows a question by its text; three share theirs
    qs = [q for q in visual if wording[q["question"]] == 1][:2]
    ret = retrievers.Retriever(tiny_index, "bm25")
    with serving(rollout.GoldPolicy(vis.tok, qs, vis), ret, qs) as (url, pictures):
        client = OpenAI(base_url=url + "/v1", api_key="none")
        for q, stream in zip(qs, (False, True)):
            pic = "data:image/png;base64," + base64.b64encode(Path(q["image"]).read_bytes()).decode()
            msg = [{"role": "user", "content": [{"type": "text", "text": q["question"]},
                                                {"type": "image_url", "image_url": {"url": pic}}]}]
            r = client.chat.completions.create(model="r1router", messages=msg, stream=stream)
            if stream:
                chunks = list(r)
                answer = "".join(c.choices[0].delta.content or "" for c in chunks)
                first = next(c.model_extra["step"] for c in chunks if (c.model_extra.get("step") or {}).get("type") == "evidence")
                found = first["evidence"][0]["id"]
            else:
                answer, found = r.choices[0].message.content, r.model_extra["steps"][0]["evidence"][0]["id"]
            assert answer == q["answers"][0] and found == q["steps"][0]["doc_id"], (stream, answer, found)
            assert not any(pictures.iterdir())  # the request's picture lives only as long as its trajectory
        for raw, why in ((b"not a picture", "not a readable picture"), (png_header(12_000, 12_000), "12000 x 12000")):
            with pytest.raises(BadRequestError, match=why):  # a VL policy's refusals: after its kind is checked
                client.chat.completions.create(model="r1router", messages=[{"role": "user", "content": [
                    {"type": "text", "text": qs[0]["question"]},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(raw).decode()}}]}])
        assert not any(pictures.iterdir())

class WebDriver:
    """Headless Chromium driven through chromedriver's W3C WebDriver HTTP API (Debian's chromium and chromium-driver)."""
    ELEMENT = "element-6066-11e4-a52e-4f735466cecf"  # the W3C key of an element reference

    def __init__(self, profile):
        self.port = free_port()
        self.proc = subprocess.Popen(["chromedriver", f"--port={self.port}"], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        for _ in range(100):
            try:
                self.call("GET", "/status")
                break
            except OSError:
                time.sleep(0.1)
        # without the background-networking flags Chromium's calls home are refused by a closed network, many at a time
        args = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-sync",
                "--disable-background-networking", "--disable-component-update", f"--user-data-dir={profile}"]
        caps = {"browserName": "chrome", "goog:chromeOptions": {"binary": CHROMIUM, "args": args}}
        self.root = "/session/" + self.call("POST", "/session", {"capabilities": {"alwaysMatch": caps}})["sessionId"]

    def call(self, method, path, body=None):
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", method=method,
                                     data=None if body is None else json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read())["value"]

    def do(self, method, path="", body=None):
        return self.call(method, self.root + path, body)

    def find(self, css):
        return "/element/" + self.do("POST", "/element", {"using": "css selector", "value": css})[self.ELEMENT]

    def js(self, script):
        return self.do("POST", "/execute/sync", {"script": script, "args": []})

    def wait(self, script, timeout=60):
        for _ in range(int(timeout / 0.2)):
            if out := self.js(script):
                return out
            time.sleep(0.2)
        raise AssertionError(f"the page never gave {script!r}: {self.js('return document.body.innerText')!r}")

    def close(self):
        self.do("DELETE")
        self.proc.terminate()

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")

@pytest.mark.skipif(not (CHROMIUM and shutil.which("chromedriver")), reason="no Chromium and chromedriver installed")
def test_the_page_draws_the_steps_and_the_answer_in_headless_chromium(server, tiny_index, tmp_path):
    # a question typed into the page's box and asked with its button: each step's sub-question, its KB badge, its
    # evidence (titles, texts, an image hit's picture), the intermediate answer, then the answer; a picture chosen in
    # the upload is shown, goes to this text policy, and the page shows the server's one-line refusal
    url, qs, ret, _ = server
    q = next(q for q in qs if any(s["kb"] == "image" for s in q["steps"]))
    web = WebDriver(tmp_path / "profile")
    try:
        web.do("POST", "/url", {"url": url + "/"})
        web.do("POST", web.find("#question") + "/value", {"text": q["question"]})
        web.do("POST", web.find("button[type=submit]") + "/click", {})
        assert web.wait("return document.getElementById('final').textContent") == f"Answer: {q['answers'][0]}"
        page = web.js("return document.getElementById('steps').innerText")
        badges = web.js("return [...document.querySelectorAll('.route .kb')].map(b => b.className + ' ' + b.textContent)")
        golds = gold_steps(q, ret)
        assert badges == [f"kb {p['kb']} {reward.KB_TO_RET[p['kb']]}" for g in golds for p in g["sub_questions"]]
        for g in golds:
            assert all(p["sub_question"] in page for p in g["sub_questions"]) and f"→ {g['answer']}" in page
            assert all(d["title"] in page for d in g["evidence"])
        texts = web.js("return [...document.querySelectorAll('.doc .text')].map(t => t.textContent)")
        assert texts == [d["contents"] for g in golds for p in g["sub_questions"]
                         for d in ret.search([p["sub_question"]], p["kb"], 2)[0]]
        assert web.js("return document.querySelectorAll('.doc img').length") == sum(
            d["kb"] == "image" for g in golds for d in g["evidence"]) > 0
        web.do("POST", "/url", {"url": f"{url}/?q={quote(qs[1]['question'])}"})  # a question in the address: asked at once
        assert web.wait("return document.getElementById('final').textContent") == f"Answer: {qs[1]['answers'][0]}"
        web.js("document.getElementById('question').value = ''")
        web.do("POST", web.find("#question") + "/value", {"text": "What is shown?"})
        web.do("POST", web.find("#picture") + "/value", {"text": dataio.load_kb(tiny_index, "image")[0]["path"]})
        web.do("POST", web.find("button[type=submit]") + "/click", {})
        web.wait("return document.getElementById('shown').src.startsWith('data:image/')")  # once the file is read
        assert "text model: it cannot take a picture" in web.wait(
            "return document.querySelector('#final.error')?.textContent")
    finally:
        web.close()
