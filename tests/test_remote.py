"""remote.py's served engines against real vLLM OpenAI servers on loopback. OpenAIEngine (`--backend openai`, token
ids through /v1/completions): the step loop gives the in-process engine's trajectories token for token at temperature
0, and evaluate.py, the judge, the judged RAG reward and a Step-GRPO step run through the same server; what a served
model cannot do is refused in one line. ChatEngine (`--backend chat`, /v1/chat/completions): the step loop, evaluate.py
and synth.py's teacher mode give the in-process engine's steps and answers (the server renders the messages with the
same chat template); a recording proxy between client and server answers 429 with Retry-After twice and shows the
key only in the Authorization header; faults on the way leave the trajectories as they were; a judge by its served
name alone, with a key; the tiny VL policy's pictures as image_url parts. One server of the tiny model serves the
module (it wants a key). The chat messages themselves, without a server: tests/test_chat.py."""
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

import dataio
import engines
import remote
import retrievers
import rollout

pytestmark = pytest.mark.slow  # vLLM servers: the whole module is in `make test` only

KEY = "sk-test-0123456789abcdef"  # the servers want it (vLLM's --api-key)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model, tmp_path, *extra):
    """A vLLM OpenAI server for `model` on loopback, named "tiny", wanting KEY, in fp32 as the in-process engine on
    the CPU (left to itself vLLM takes bf16 for an fp32 model where the CPU has it): three processes, ~30 s on 2 cores
    before it answers (up() waits for it). -> (its process, its URL)."""
    port, log = free_port(), open(tmp_path / "server.log", "w")
    kv = engines.CPU_KV_TOKENS * engines.kv_bytes_per_token(model, "float32")
    # eager as the in-process engine on the CPU: --enforce-eager leaves vLLM's sampler's logprob ranks under
    # torch.compile, which inductor builds in C++ (~10 s of CPU on a fresh clone) at the first request
    env = dict(os.environ, TORCHDYNAMO_DISABLE="1")
    server = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                               "--served-model-name", "tiny", "--api-key", KEY, "--host", "127.0.0.1", "--port",
                               str(port), "--max-model-len", "4096", "--enforce-eager", "--seed", "0",
                               "--dtype", "float32", "--kv-cache-memory-bytes", str(kv), *extra],
                              stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path, env=env)
    return server, f"http://127.0.0.1:{port}/v1"


def up(server, url, tmp_path):
    """Wait until the server started by start_server answers."""
    for _ in range(600):
        assert server.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
        try:
            urllib.request.urlopen(url.removesuffix("/v1") + "/health", timeout=2)
            return
        except OSError:
            time.sleep(0.5)
    server.terminate()
    raise AssertionError("the vLLM server did not start")


@pytest.fixture(scope="module")
def ret(tiny_index):
    return retrievers.Retriever(tiny_index, "bm25")


@pytest.fixture(scope="module")
def served(tiny_model_dir, tiny_index, ret, tmp_path_factory):
    """The module's server of the tiny model, and what each served engine must give, computed in this process while
    the server starts: the in-process engine's greedy trajectories of 12 test questions, one request in flight (so
    batching cannot change the arithmetic; the tiny random policy writes to every length limit), and its greedy steps
    at 4 questions' golden prefixes (multi-turn chats: evidence turns, earlier steps, which the tiny policy never
    reaches). -> (URL, (questions, trajectories, prefix prompts, their steps))."""
    tmp = tmp_path_factory.mktemp("server")
    proc, url = start_server(tiny_model_dir, tmp)
    try:
        qs, s = dataio.load_questions(tiny_index, "test")[:12], rollout.Settings(temperature=0.0, max_active=1)
        engine = engines.VLLMEngine(tiny_model_dir, max_model_len=4096)
        try:
            a = rollout.rollout(engine, ret, qs, s=s)
            _, prefixes = rollout.golden_prefixes(engine.tok, ret, qs[:4], s)
            prompts = [ids for _, _, ids, _ in prefixes]
            want = [engine.generate([p], 24, temperature=0.0, stop=["</ret>"])[0] for p in prompts]  # one at a time
        finally:
            engine.close()
        up(proc, url, tmp)
        yield url, (qs, a, prompts, want)
    finally:
        proc.terminate()
        proc.wait(timeout=60)


@pytest.fixture(scope="module")
def server(served):
    return served[0]


@pytest.fixture(scope="module")
def local(served):
    return served[1]


def run_script(module, *args):
    """A script's main in this process (a chat engine needs no start-up)."""
    mod = __import__(module)
    mod.main(mod.get_args([*map(str, args)]))


def server_prompt_ids(chat, ids, images=()):
    """The token ids the server makes of a prompt's chat messages (vLLM's return_token_ids): its template's
    rendering, tokenized, each picture expanded by its processor."""
    messages, go_on = chat.messages(ids, images)
    body = dict(model="tiny", messages=messages, max_tokens=1, return_token_ids=True)
    return chat.call("/chat/completions", body)["prompt_token_ids"]


def span_texts(x, tok):
    return [tok.decode(x["ids"][sp["start"]:sp["end"]]) for sp in x["spans"]]


def test_the_step_loop_evaluate_and_synth_through_chat_give_the_in_process_steps(tiny_model_dir, tiny_index, ret,
                                                                                 server, local, tmp_path):
    qs, a, prompts, want = local
    s = rollout.Settings(temperature=0.0, max_active=1)  # one request in flight, as the local engine's
    chat = engines.make_engine("chat", tiny_model_dir, base_url=server, api_key=KEY, max_concurrency=1)
    assert chat.name == "tiny" and chat.mode.startswith("chat: tiny at ")
    b = rollout.rollout(chat, ret, qs, s=s)
    tok = chat.tok
    for x, y in zip(a, b):
        for key in ("steps", "final_answer", "format_ok", "error"):
            assert x[key] == y[key], (x["qid"], key)
        assert span_texts(x, tok) == span_texts(y, tok)
        # the ids too, where the policy's sampled tokens are the canonical encoding of their text (the chat reply is
        # text, re-encoded): the one difference there is
        canonical = all(tok.encode(t, add_special_tokens=False) == x["ids"][sp["start"]:sp["end"]]
                        for t, sp in zip(span_texts(x, tok), x["spans"]))
        assert x["ids"] == y["ids"] or not canonical, x["qid"]
        assert set(y["logprobs"]) == {0.0}  # the chat backend has no logprobs of the local tokens
    # the server is asked exactly the transcript: its tokens of the messages are the prompt's ids
    assert len(prompts) > 10 and all(server_prompt_ids(chat, ids) == ids for ids in prompts)
    got = chat.generate(prompts, 24, temperature=0.0, stop=["</ret>"])
    assert [tok.decode(i) for i, _ in got] == [tok.decode(i) for i, _ in want]
    # evaluate.py through the server: those trajectories, and the report says which mode scored them
    common = ["--model", tiny_model_dir, "--data", tiny_index, "--split", "test", "--n_questions", "12",
              "--methods", "routed", "--retriever", "bm25", "--max_active", "1"]
    run_script("evaluate", *common, "--backend", "chat", "--base_url", server, "--api_key", KEY,
               "--max_concurrency", "1", "--out", tmp_path / "chat")
    row = next(iter(json.loads((tmp_path / "chat" / "results.json").read_text()).values()))
    assert row["engine"].startswith("chat: tiny at ") and "not token-exact" in row["engine"]
    assert "Scored through a server:" in (tmp_path / "chat" / "table.md").read_text()
    saved = dataio.read_jsonl(tmp_path / "chat" / "trajectories-routed.jsonl")
    assert [(x["steps"], x["final_answer"], x["error"]) for x in saved] == [(x["steps"], x["final_answer"], x["error"])
                                                                            for x in a]
    assert not any(KEY in f.read_text() for f in (tmp_path / "chat").iterdir() if f.suffix in (".json", ".md"))
    # synth.py's teacher mode: the served teacher at temperature 0 gives what the in-process one gives
    teach = ["--model", tiny_model_dir, "--data", tiny_index, "--splits", "dev", "--limit", "6", "--retriever", "bm25",
             "-n", "1", "--temperature", "0", "--top_k", "0"]
    run_script("synth", *teach, "--teacher", tiny_model_dir, "--out", tmp_path / "t-local")
    run_script("synth", *teach, "--teacher", "tiny", "--backend", "chat", "--base_url", server, "--api_key", KEY,
               "--out", tmp_path / "t-chat")
    errors = [json.loads((tmp_path / t / "dev.errors.json").read_text()) for t in ("t-local", "t-chat")]
    assert errors[0] == errors[1] and errors[0]["filters"]["sampled"] == 6
    metas = [json.loads((tmp_path / t / "meta.json").read_text()) for t in ("t-local", "t-chat")]
    assert metas[0] == metas[1]  # the local policy's tokenizer and format


def test_the_step_loop_evaluate_judge_and_a_step_through_token_ids_give_the_in_process_trajectories(
        tiny_model_dir, tiny_index, ret, server, local, tmp_path, monkeypatch):
    import judge
    import steprewards
    import stepgrpo
    from transformers import AutoTokenizer
    qs, a, _, _ = local
    s = rollout.Settings(temperature=0.0, max_active=1)  # one request in flight, as the local engine's
    b = rollout.rollout(engines.make_engine("openai", tiny_model_dir, base_url=server, api_key=KEY), ret, qs, s=s)
    assert len(a) == len(b) == len(qs) and sum(sum(x["mask"]) for x in b) > 0
    for x, y in zip(a, b):
        for key in ("ids", "mask", "spans", "steps", "final_answer", "format_ok", "error"):
            assert x[key] == y[key], (x["qid"], key)
        # the sampled tokens' logprobs, computed by another process's kernels: close, not bitwise (measured 5e-3)
        assert max(abs(p - q) for p, q in zip(x["logprobs"], y["logprobs"])) < 2e-2
    # evaluate.py through the server writes those trajectories (judged by the same server: evaluate.py --judge writes
    # the judge metric and its agreement with EM)
    common = ["--model", tiny_model_dir, "--data", tiny_index, "--split", "test", "--n_questions", "12", "--methods",
              "routed", "--retriever", "bm25", "--max_active", "1", "--api_key", KEY]
    run_script("evaluate", *common, "--backend", "openai", "--base_url", server, "--judge", tiny_model_dir,
               "--judge_url", server, "--judge_api_key", KEY, "--out", tmp_path / "remote")
    row = next(iter(json.loads((tmp_path / "remote" / "results.json").read_text()).values()))
    assert 0 < row["judge_n"] <= row["n"] and 0 <= row["judge_em_agree"] <= 100, row  # a format failure: 0, rated
    assert "## LLM judge" in (tmp_path / "remote" / "table.md").read_text()
    saved = dataio.read_jsonl(tmp_path / "remote" / "trajectories-routed.jsonl")
    assert [(x["spans"], x["steps"], x["final_answer"]) for x in saved] == [(x["spans"], x["steps"], x["final_answer"])
                                                                            for x in a]
    # the judge (judge.py) through the same server: every rating one of the scale's or None, a second call answered
    # from the cache
    j = judge.Judge.load(tiny_model_dir, server, api_key=KEY, cache=tmp_path / "judge.jsonl")
    items = [(x["question"], " or ".join(x["answers"]), x["final_answer"] or "none") for x in a[:3]]
    scores = j.accuracy(items)
    assert j.asked == 6 and all(s in (None, 0.0, 0.25, 0.5, 0.75, 1.0) for s in scores), scores
    assert j.accuracy(items) == scores and j.asked == 6
    assert len((tmp_path / "judge.jsonl").read_text().splitlines()) == 6
    # the judged RAG reward (steprewards.judge_rag, stepgrpo.py --w_rag) through the same server, on the gold policy's
    # trajectories (the tiny random policy finishes none): every finished trajectory's term on the scale, each prompt
    # cached; a second judge on the same cache asks nothing and gives the same terms
    gold = rollout.rollout(rollout.GoldPolicy(AutoTokenizer.from_pretrained(tiny_model_dir), qs), ret, qs[:4], s=s)
    assert all(x["final_answer"] and x["evidence"] for x in gold)
    terms = []
    for _ in range(2):
        w = steprewards.Weights(rag=(2.0, 1.0), judge=judge.Judge.load(tiny_model_dir, server, api_key=KEY,
                                                                        cache=tmp_path / "rag.jsonl"))
        terms.append((steprewards.judge_rag(w, gold), w.judge.asked))
    assert all(0 <= v <= 3.0 for v in terms[0][0]) and terms[0][1] > 0, terms
    assert terms[1] == (terms[0][0], 0)
    # stepgrpo.py --w_rag with --judge_url runs a step through it and logs the term
    stepgrpo.main([*map(str, ["--model", tiny_model_dir, "--data", tiny_index, "--retriever", "bm25", "--rollout",
                              "onpolicy", "--batch_questions", "2", "-n", "2", "--train_steps", "1", "--eval_questions",
                              "0", "--dtype", "fp32", "--backend", "hf", "--w_rag", "2.0", "1.0", "--judge",
                              tiny_model_dir, "--judge_url", server, "--judge_api_key", KEY, "--out", tmp_path / "grpo"])])
    rec = dataio.read_jsonl(tmp_path / "grpo" / "log.jsonl")[-1]
    assert 0 <= rec["rag"] <= 3.0, rec
    # what a served model cannot do: swap in other weights
    with pytest.raises(SystemExit, match="^error: --backend openai scores the one model"):
        run_script("evaluate", *common, "--backend", "openai", "--base_url", server, "--model", tiny_model_dir,
                   tiny_model_dir, "--out", tmp_path / "x", tmp_path / "y")
    # a server that is gone (nothing answers there): a one-line error naming it, after the retries (the policy's
    # server, and a judge's); their back-off not slept here
    gone = f"http://127.0.0.1:{free_port()}/v1"
    monkeypatch.setattr(time, "sleep", lambda s: None)
    with pytest.raises(SystemExit, match=f"^error: the server {gone} did not answer"):
        run_script("evaluate", *common, "--backend", "openai", "--base_url", gone, "--out", tmp_path / "gone")
    with pytest.raises(SystemExit, match=f"error: the server {gone} did not answer /models after {remote.TRIES} tries"):
        judge.Judge.load(tiny_model_dir, gone)  # stepgrpo.py --judge_url's start too


class Recorder(BaseHTTPRequestHandler):
    """A recording proxy on loopback between a client and the server: each request's path, headers and body
    recorded, with its arrival time and the requests in flight; the first `busy` chat requests answered 429 with
    Retry-After 1, then each one passed through (mode "html": a page instead of JSON; "stall": no answer for 3 s).
    `faults`: what the next completion requests (chat or token ids) meet, one each, in order: "429" (Retry-After 1),
    "drop" (half the reply, then the connection closed), "html" (a 502 page, a gateway's), "slow" (the reply 3 s
    late)."""
    def do_GET(self):
        self.relay(None)

    def do_POST(self):
        self.relay(self.rfile.read(int(self.headers["Content-Length"])))

    def relay(self, body):
        p = self.server
        with p.lock:
            p.inflight += 1
            p.max_inflight = max(p.max_inflight, p.inflight)
            p.seen.append(dict(t=time.monotonic(), path=self.path, body=body or b"",
                               headers={k.lower(): v for k, v in self.headers.items()}))
            busy = self.path.endswith("/chat/completions") and p.busy > 0
            p.busy -= busy
            fault = p.faults.pop(0) if self.path.endswith("/completions") and p.faults else None
        if fault == "slow":
            time.sleep(3)
        if fault in ("429", "html"):
            self.answer(*{"429": (429, b'{"error": {"message": "slow down"}}', {"Retry-After": "1"}),
                          "html": (502, b"<html><body>502 Bad Gateway</body></html>",
                                   {"Content-Type": "text/html"})}[fault])
            with p.lock:
                p.inflight -= 1
            return
        try:
            reply = self.reply(busy, body)
        finally:
            with p.lock:  # out of flight before the answer is written: its client may send the next at once
                p.inflight -= 1
        if fault == "drop":  # the headers and half the body, then the connection closed
            code, data, _ = reply
            self.send_response(code)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data[:len(data) // 2])
            self.close_connection = True
            return
        self.answer(*reply)

    def reply(self, busy, body):
        """(status, body, headers) of the answer to this request."""
        p = self.server
        if busy:
            return 429, b'{"error": {"message": "slow down"}}', {"Retry-After": "1"}
        if p.mode == "html":
            return 200, b"<html>a login page</html>", {}
        if p.mode == "stall":
            time.sleep(3)
        req = urllib.request.Request(p.upstream + self.path.removeprefix("/v1"), data=body,
                                     headers={k: v for k, v in self.headers.items()
                                              if k.lower() in ("authorization", "content-type")})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                return r.status, r.read(), {}
        except urllib.error.HTTPError as e:
            return e.code, e.read(), {}

    def answer(self, code, data, headers):
        self.send_response(code)
        for k, v in {"Content-Type": "application/json", "Content-Length": str(len(data)), **headers}.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *a):
        pass


@pytest.fixture
def proxy(server):
    p = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    p.daemon_threads, p.upstream, p.lock, p.seen = True, server, threading.Lock(), []
    p.inflight = p.max_inflight = 0
    p.busy, p.mode, p.faults = 2, "pass", []
    threading.Thread(target=p.serve_forever, daemon=True).start()
    yield p, f"http://127.0.0.1:{p.server_address[1]}/v1"
    p.shutdown()


def test_a_recording_proxy_sees_retries_after_429_bounded_requests_and_the_key_only_in_its_header(
        tiny_model_dir, tiny_index, proxy, tmp_path, capfd, caplog):
    p, url = proxy
    run_script("evaluate", "--model", tiny_model_dir, "--data", tiny_index, "--split", "test", "--n_questions", "8",
               "--methods", "routed", "--retriever", "bm25", "--backend", "chat", "--base_url", url, "--api_key", KEY,
               "--max_concurrency", "2", "--out", tmp_path / "eval")
    chats = [r for r in p.seen if r["path"].endswith("/chat/completions")]
    assert len(chats) >= 8 + 2 and p.busy == 0
    # the two 429s were tried again after the Retry-After they asked for (the back-off alone waits 0.5 s), and the
    # run then scored every question
    first = [r["t"] for r in chats if r["body"] == chats[0]["body"]]
    assert len(first) >= 2 and first[1] - first[0] >= 1.0, first
    assert len(dataio.read_jsonl(tmp_path / "eval" / "trajectories-routed.jsonl")) == 8
    assert p.max_inflight == 2  # --max_concurrency: never more in flight, and the loop keeps that many busy
    # the key: in every request's Authorization header (the server wants it), in no body, no output, no file
    assert all(r["headers"].get("authorization") == f"Bearer {KEY}" for r in p.seen)
    assert not any(KEY.encode() in r["body"] for r in p.seen)
    out, err = capfd.readouterr()
    assert KEY not in out + err + caplog.text
    assert not any(KEY in f.read_text() for f in (tmp_path / "eval").iterdir() if f.suffix in (".json", ".md"))
    # one-line errors naming the server: a wrong key (401, no retry), a page that is not JSON, a request that times
    # out after its tries; the key never in them
    with pytest.raises(SystemExit, match=f"^error: the server {url} refused /models \\(401\\)") as e:
        remote.ChatEngine(tiny_model_dir, url, api_key=KEY + "x")
    assert KEY not in str(e.value) and "\n" not in str(e.value)
    p.mode = "html"
    with pytest.raises(SystemExit, match=f"^error: the server {url} answered /models with something that is not JSON"):
        remote.ChatEngine(tiny_model_dir, url, api_key=KEY)
    p.mode = "stall"
    eng = remote.ChatEngine(tiny_model_dir, url, served="tiny", api_key=KEY, timeout=1, tries=2)
    with pytest.raises(SystemExit, match=f"^error: the server {url} did not answer /chat/completions after 2 tries"):
        eng.generate([eng.tok.encode("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nq<|im_end|>\n"
                                     "<|im_start|>assistant\n")], 8, 0.0)


def test_a_judge_by_its_served_name_with_a_key(tiny_model_dir, tiny_index, server, tmp_path, monkeypatch):
    import judge
    j = judge.Judge.load("tiny", server, api_key=KEY, cache=tmp_path / "judge.jsonl")  # no folder: the chat API
    assert isinstance(j.engine, remote.ChatEngine) and j.engine.tok is None and j.name == "tiny"
    items = [("Where was Ulla born?", "Selstoa", "Selstoa"), ("Who founded X?", "Ivo Lund", "Oslo")]
    scores = j.accuracy(items)
    assert j.asked == 4 and all(s in (None, 0.0, 0.25, 0.5, 0.75, 1.0) for s in scores), scores
    assert j.accuracy(items) == scores and j.asked == 4  # from the cache
    with pytest.raises(SystemExit, match=f"^error: the server {server} refused /chat/completions \\(401\\)"):
        judge.Judge.load("tiny", server, api_key="wrong").accuracy(items[:1])
    # evaluate.py --judge NAME --judge_url with the key in $JUDGE_API_KEY: the judge metric in the report
    monkeypatch.setenv("JUDGE_API_KEY", KEY)
    run_script("evaluate", "--model", tiny_model_dir, "--data", tiny_index, "--split", "test", "--n_questions", "4",
               "--methods", "routed", "--retriever", "bm25", "--backend", "hf", "--judge", "tiny", "--judge_url", server,
               "--out", tmp_path / "judged")
    assert "## LLM judge" in (tmp_path / "judged" / "table.md").read_text()
    assert not any(KEY in f.read_text() for f in (tmp_path / "judged").iterdir() if f.suffix in (".json", ".md"))


def test_the_vl_policys_pictures_go_as_image_parts(tiny_model_dir, tiny_index, ret, tmp_path_factory):
    # the tiny Idefics3 around the tiny Llama, served: golden prefixes of visual questions (the question's picture and
    # retrieved ones in the chat) through the chat API give the in-process engine's greedy steps, so each picture sits
    # where the transcript has it and the server expands it as the transcript does
    import prepare
    vl = prepare.prepare_vl(tmp_path_factory.mktemp("vl") / "idefics3", text_model=tiny_model_dir)
    visual = dataio.load_questions(tiny_index, "visual_test")[:3]
    tmp = tmp_path_factory.mktemp("vl-server")
    proc, url = start_server(vl, tmp, "--limit-mm-per-prompt", '{"image": 16}')  # starts while the local engine works
    try:
        local = engines.VLLMEngine(vl, max_model_len=4096)
        try:
            _, prefixes = rollout.golden_prefixes(local.tok, ret, visual, rollout.Settings(), vis=local.vis)
            prompts = [(ids, images) for _, _, ids, images in prefixes]
            assert sum(len(im) for _, im in prompts) > len(prompts)
            want = [local.generate([i], 24, 0.0, stop=["</ret>"], images=[im])[0] for i, im in prompts]
        finally:
            local.close()
        up(proc, url, tmp)
        chat = engines.make_engine("chat", vl, base_url=url, api_key=KEY, max_concurrency=1)
        msgs, _ = chat.messages(*prompts[-1])
        assert any(p["type"] == "image_url" for m in msgs if isinstance(m["content"], list) for p in m["content"])
        assert all(server_prompt_ids(chat, ids, images) == ids for ids, images in prompts)
        got = chat.generate([i for i, _ in prompts], 24, 0.0, stop=["</ret>"], images=[im for _, im in prompts])
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    assert [chat.tok.decode(i) for i, _ in got] == [chat.tok.decode(i) for i, _ in want]


def test_faults_on_the_way_leave_each_served_engines_trajectories_as_they_were(tiny_model_dir, tiny_index, server, proxy,
                                                                               tmp_path, monkeypatch):
    # one request meets a 429 with Retry-After, a reply cut half-way, a gateway's HTML error page and a reply later than
    # the timeout, one after another, through each served engine (chat, token ids) inside an evaluation, which ends
    # with the trajectories of the same evaluation sent straight to the server; the environment's OPENAI_* key,
    # organisation and headers reach no server, and an engine given no key sends none of them
    p, url = proxy
    p.busy = 0
    env = dict(OPENAI_API_KEY="sk-env-secret", OPENAI_ORG_ID="org-env", OPENAI_CUSTOM_HEADERS="X-From-Env: yes")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    common = ["--model", tiny_model_dir, "--data", tiny_index, "--split", "test", "--n_questions", "4", "--methods",
              "routed", "--retriever", "bm25", "--max_active", "1", "--max_concurrency", "1", "--api_key", KEY,
              "--timeout", "2"]
    for backend in ("chat", "openai"):
        run_script("evaluate", *common, "--backend", backend, "--base_url", server, "--out", tmp_path / "direct")
        p.faults, n = ["429", "drop", "html", "slow"], len(p.seen)
        run_script("evaluate", *common, "--backend", backend, "--base_url", url, "--out", tmp_path / "faults")
        want, got = (dataio.read_jsonl(tmp_path / k / "trajectories-routed.jsonl") for k in ("direct", "faults"))
        assert [(x["spans"], x["steps"], x["final_answer"], x["error"]) for x in got] == \
            [(x["spans"], x["steps"], x["final_answer"], x["error"]) for x in want], backend
        asked = [r for r in p.seen[n:] if r["path"].endswith("/completions")]
        assert p.faults == [] and len({r["body"] for r in asked[:5]}) == 1, backend  # one request, tried 5 times
        assert asked[1]["t"] - asked[0]["t"] >= 1.0  # after the 429's Retry-After
    assert all(r["headers"].get("authorization") == f"Bearer {KEY}" for r in p.seen)
    keyless = remote.ChatEngine(tiny_model_dir, url, served="tiny")
    with pytest.raises(SystemExit, match=f"^error: the server {url} refused /chat/completions \\(401\\)"):
        keyless.generate([keyless.tok.encode("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nq<|im_end|>\n"
                                             "<|im_start|>assistant\n")], 4, 0.0)
    assert p.seen[-1]["headers"]["authorization"] == f"Bearer {remote.NO_KEY}"
    for r in p.seen:
        assert not any(v in str(r["headers"]) or v.encode() in r["body"] for v in (*env.values(), "x-from-env"))
        assert KEY.encode() not in r["body"]
