"""retrievers.py: embeddings, faiss vs brute force, BM25, recall on gold sub-questions, retrieval by image, errors, the
HTTP server (its strict request model) and its client (retries through a server's faults and restart)."""
import base64
import contextlib
import http.server
import json
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

import dataio
import retrievers
import rollout

ROOT = Path(__file__).resolve().parents[1]

def test_encoder_matches_sentence_transformers(encoder):
    # the reference: the model folder's sentence-transformers modules (mean pooling over a 256-token window, then
    # normalised) and the vectors sentence-transformers itself made of these texts (tests/minilm_reference.json, its
    # "made_by"; the last text runs past the window). sentence-transformers is not installed: it needs scikit-learn,
    # which transformers then imports into every process (1.2 s each)
    folder = Path(retrievers.default_encoder_path())
    read = lambda name: json.loads((folder / name).read_text())
    assert [m["type"].rsplit(".", 1)[1] for m in read("modules.json")] == ["Transformer", "Pooling", "Normalize"]
    assert [k for k, v in read("1_Pooling/config.json").items() if k.startswith("pooling_mode") and v] == \
        ["pooling_mode_mean_tokens"]
    assert read("sentence_bert_config.json") == {"max_seq_length": encoder.max_length, "do_lower_case": False}
    ref = json.loads((ROOT / "tests" / "minilm_reference.json").read_text())
    want = np.array(ref["embeddings"], dtype=np.float32)  # [4, 384]
    ours = retrievers.Encoder(dtype="float32").encode(ref["texts"])  # [4, 384]
    assert ours.shape == want.shape == (4, 384)
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(ours, want, atol=1e-4)
    fast = encoder.encode(ref["texts"])  # the default dtype (bf16 where supported) stays within 1e-3 in cosine
    assert ((fast * want).sum(1) > 0.999).all()

def test_dense_search_equals_brute_force(tiny_index, encoder):
    r = retrievers.Retriever(tiny_index, "dense", encoder=encoder)
    for kb in dataio.KBS:
        docs = dataio.load_kb(tiny_index, kb)
        emb = encoder.encode([retrievers.doc_contents(d, kb) for d in docs])  # [n_docs, 384]
        queries = [s["sub_question"] for q in dataio.load_questions(tiny_index, "dev") for s in q["steps"]][:20]
        sims = encoder.encode(queries) @ emb.T  # [n_q, n_docs]
        res = r.search(queries, kb, 5)
        for qi, hits in enumerate(res):
            assert len(hits) == 5
            np.testing.assert_allclose([h["score"] for h in hits], np.sort(sims[qi])[::-1][:5], atol=1e-5)
            assert [h["id"] for h in hits][0] == docs[int(np.argmax(sims[qi]))]["id"]
            assert all(h["kb"] == kb and h["contents"].startswith('"') for h in hits)

def test_bm25_scores_equal_a_hand_computed_bm25(tiny_index):
    # Lucene BM25 (bm25s's default): idf = ln(1 + (N - df + .5) / (df + .5)), tf part = tf / (tf + k1 (1 - b + b dl/avgdl))
    # (Lucene >= 8 drops BM25's constant (k1 + 1) factor; rankings are unchanged)
    bm25s = retrievers.import_bm25s()
    docs = dataio.load_kb(tiny_index, "text")
    texts = [retrievers.doc_contents(d, "text") for d in docs]
    tok = retrievers.bm25_tokenize(texts)
    inv = {i: w for w, i in tok.vocab.items()}
    bags = [[inv[i] for i in ids] for ids in tok.ids]
    n, avgdl, k1, b = len(bags), np.mean([len(x) for x in bags]), 1.5, 0.75
    query = "Who founded " + docs[-1]["title"] + "?"
    q_words = set(bm25s.tokenize([query], stopwords="en", show_progress=False, return_ids=False)[0])
    def score(bag):
        s = 0.0
        for w in q_words:
            df = sum(w in x for x in bags)
            tf = bag.count(w)
            if df and tf:
                s += np.log(1 + (n - df + 0.5) / (df + 0.5)) * tf / (tf + k1 * (1 - b + b * len(bag) / avgdl))
        return s
    expect = sorted(((score(bag), i) for i, bag in enumerate(bags)), reverse=True)[:3]
    hits = retrievers.Retriever(tiny_index, "bm25").search([query], "text", 3)[0]
    np.testing.assert_allclose([h["score"] for h in hits], [s for s, _ in expect], rtol=1e-4)
    assert hits[0]["id"] == docs[expect[0][1]]["id"]

@pytest.mark.parametrize("method", ["dense", "bm25", "hybrid"])
def test_gold_sub_questions_find_their_documents(tiny_index, encoder, method):
    r = retrievers.Retriever(tiny_index, method, encoder=encoder if method != "bm25" else None)
    qs = dataio.load_questions(tiny_index, "train")
    for kb in dataio.KBS:
        rec, n = retrievers.recall_at(r, qs, kb)
        assert n > 10 and rec["R@5"] >= 0.9, (method, kb, rec)

VISUAL_SPLITS = ("visual_train", "visual_dev", "visual_test")

def test_question_images_find_their_pictures(tiny_index):
    qs = [q for s in VISUAL_SPLITS for q in dataio.load_questions(tiny_index, s)]
    rec, n = retrievers.image_query_recall(retrievers.Retriever(tiny_index, "bm25"), qs)
    assert n == 50 and rec["R@1"] >= 0.9 and rec["R@5"] >= 0.95, rec  # measured 1.0 and 1.0

def assert_pixel_ranking(hits, sims, docs):
    """Search hits of one query against its brute-force similarities to every KB picture (ties in any order)."""
    np.testing.assert_allclose([h["score"] for h in hits], np.sort(sims)[::-1][:len(hits)], atol=1e-5)
    ids = [d["id"] for d in docs]
    np.testing.assert_allclose([sims[ids.index(h["id"])] for h in hits], [h["score"] for h in hits], atol=1e-5)

def test_image_queries_rank_by_pixels_and_batch_with_text_queries(tiny_index):
    from PIL import Image
    r = retrievers.Retriever(tiny_index, "bm25")
    docs, qs = dataio.load_kb(tiny_index, "image"), dataio.load_questions(tiny_index, "visual_dev")
    enc = retrievers.PixelEncoder()
    sims = enc.encode_images([q["image"] for q in qs]) @ enc.encode_images([d["path"] for d in docs]).T  # [n_q, n_docs]
    texts = [q["question"] for q in qs]
    images = [[q["image"], Path(q["image"]), Image.open(q["image"])][n % 3] for n, q in enumerate(qs)]  # every kind
    by_pixels = r.search(texts, "image", 5, images=images)
    for n, hits in enumerate(by_pixels):
        assert len(hits) == 5 and hits[0]["id"] == qs[n]["steps"][0]["doc_id"]
        assert_pixel_ranking(hits, sims[n], docs)
    by_text = r.search(texts, "image", 5)
    assert r.search(texts, "image", 5, images=[None] * len(qs)) == by_text and by_text != by_pixels
    mixed = r.search(texts, "image", 5, images=[None if n % 2 else x for n, x in enumerate(images)])
    assert mixed == [by_text[n] if n % 2 else by_pixels[n] for n in range(len(qs))]
    assert r.search(texts, "table", 3, images=images) == r.search(texts, "table", 3)  # other KBs ignore images
    with pytest.raises(ValueError, match="images: 1 entries for 10 queries"):
        r.search(texts, "image", 3, images=[None])

def test_missing_or_stale_pixel_index_is_reported(tmp_path, tiny_index):
    import faiss
    broken = tmp_path / "broken"
    shutil.copytree(tiny_index, broken)
    n = len(dataio.load_kb(broken, "image"))
    short = retrievers.faiss_index(np.ones((n - 1, retrievers.PixelEncoder.dim)))  # one picture short
    faiss.write_index(short, str(broken / "index" / "image.pix.faiss"))
    with pytest.raises(dataio.DataError, match=rf"pixel index is stale \({n - 1} vectors .*; rerun `python retrievers.py build"):
        retrievers.Retriever(broken, "bm25")
    (broken / "index" / "image.pix.faiss").unlink()
    with pytest.raises(dataio.DataError, match="no pixel index for the image KB; rerun `python retrievers.py build"):
        retrievers.Retriever(broken, "bm25")

@pytest.fixture(scope="module")
def tiny_clip_dir(tmp_path_factory, tok_dir):
    """A tiny random CLIP with the tests' tokenizer (no download), saved with its processor like any HF CLIP folder."""
    import torch
    from transformers import AutoTokenizer, CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor
    tok = AutoTokenizer.from_pretrained(tok_dir, model_max_length=64)
    layers = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    cfg = CLIPConfig(text_config=dict(vocab_size=len(tok), max_position_embeddings=64, bos_token_id=tok.bos_token_id,
                                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **layers),
                     vision_config=dict(image_size=32, patch_size=8, **layers), projection_dim=16)
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("clip") / "clip"
    CLIPModel(cfg).save_pretrained(out)
    pixels = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    CLIPProcessor(image_processor=pixels, tokenizer=tok).save_pretrained(out)
    return out

def test_a_clip_pixel_index_equals_brute_force(tmp_path, tiny_world, tiny_clip_dir):
    data = tmp_path / "data"
    shutil.copytree(tiny_world, data, ignore=shutil.ignore_patterns("index"))
    meta = retrievers.build(data, methods=("bm25",), image_encoder=str(tiny_clip_dir), progress=False)
    assert meta["pixel_encoder"] == str(tiny_clip_dir)
    r, clip = retrievers.Retriever(data, "bm25"), retrievers.ClipEncoder(str(tiny_clip_dir))
    docs, qs = dataio.load_kb(data, "image"), dataio.load_questions(data, "visual_dev")
    emb = clip.encode_images([d["path"] for d in docs])  # [n_docs, 16]
    sims = clip.encode_images([q["image"] for q in qs]) @ emb.T
    for n, hits in enumerate(r.search([q["question"] for q in qs], "image", 5, images=[q["image"] for q in qs])):
        assert len(hits) == 5
        assert_pixel_ranking(hits, sims[n], docs)
    # text queries keep CLIP's text->image ranking fused with bm25's: reciprocal-rank scores, at most 2 / (RRF_K + 1)
    texts = [s["sub_question"] for q in dataio.load_questions(data, "train") for s in q["steps"] if s["kb"] == "image"][:5]
    fused = r.search(texts, "image", 5)
    assert all(0 < h["score"] <= 2 / (retrievers.RRF_K + 1) for hits in fused for h in hits)
    assert fused != retrievers.Retriever(tiny_world, "bm25").search(texts, "image", 5)
    moved = tmp_path / "moved"
    shutil.copytree(tiny_clip_dir, moved)
    meta["pixel_encoder"] = str(moved)
    (data / "index" / "meta.json").write_text(json.dumps(meta))
    shutil.rmtree(moved)
    with pytest.raises(dataio.DataError, match="built with the CLIP folder .*moved, which is gone; rerun"):
        retrievers.Retriever(data, "bm25")

def test_missing_or_stale_index_is_reported(tmp_path, tiny_index):
    with pytest.raises(dataio.DataError, match="no index found; run `python retrievers.py build"):
        retrievers.Retriever(tmp_path)
    stale = tmp_path / "stale"
    shutil.copytree(tiny_index, stale)
    rows = dataio.read_jsonl(stale / "kb" / "table.jsonl")
    dataio.write_jsonl(stale / "kb" / "table.jsonl", rows[:-1])
    with pytest.raises(dataio.DataError, match="index is stale for the table KB"):
        retrievers.Retriever(stale, "bm25")
    with pytest.raises(ValueError, match="unknown kb 'video'"):
        retrievers.Retriever(tiny_index, "bm25").search(["q"], "video", 3)
    with pytest.raises(dataio.DataError, match="--retriever weird: expected one of dense, bm25, hybrid or the http"):
        retrievers.make_retriever("weird", tiny_index)

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

def post(url, payload, raw=None):
    data = raw if raw is not None else json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())

def serve(data, port, *flags):
    """`retrievers.py serve` of data on loopback's port, started (not yet answering)."""
    return subprocess.Popen([sys.executable, str(ROOT / "retrievers.py"), "serve", "--data", str(data), "--port",
                             str(port), *flags], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

def wait_up(proc, base):
    for _ in range(120):
        try:
            urllib.request.urlopen(base + "/health", timeout=1)
            return
        except OSError:
            assert proc.poll() is None, proc.stdout.read().decode()
            time.sleep(0.5)
    raise AssertionError(f"{base} did not answer in 60 s")

@pytest.fixture(scope="module")
def server(tiny_index):
    port = free_port()
    proc, base = serve(tiny_index, port), f"http://127.0.0.1:{port}"
    wait_up(proc, base)
    yield base
    proc.terminate()
    proc.wait(10)
    assert f"on http://127.0.0.1:{port}/retrieve".encode() in proc.stdout.read()  # it says where it listens

def test_server_speaks_search_r1_protocol(server, tiny_index, encoder):
    queries = [s["sub_question"] for q in dataio.load_questions(tiny_index, "dev") for s in q["steps"] if s["kb"] == "table"][:4]
    code, body = post(server + "/retrieve", {"queries": queries, "topk": 3, "return_scores": True, "kb": "table"})
    assert code == 200 and len(body["result"]) == len(queries)
    local = retrievers.Retriever(tiny_index, "dense", encoder=encoder).search(queries, "table", 3)
    for got, want in zip(body["result"], local):
        assert [g["document"]["id"] for g in got] == [w["id"] for w in want]
        np.testing.assert_allclose([g["score"] for g in got], [w["score"] for w in want], atol=1e-5)
    code, body = post(server + "/retrieve", {"queries": ["Who founded it?"], "topk": 2})  # a plain Search-R1 client
    assert code == 200 and set(body["result"][0][0]) == {"id", "contents", "title", "kb"} and body["result"][0][0]["kb"] == "text"
    code, body = post(server + "/retrieve", {"queries": ["Who founded it?"], "topk": None})  # null: the default, 3
    assert code == 200 and len(body["result"][0]) == 3
    remote = retrievers.RemoteRetriever(server).search(queries, "table", 3)
    assert [[d["id"] for d in r] for r in remote] == [[d["id"] for d in r] for r in local]

def test_server_answers_image_queries(server, tiny_index, encoder):
    qs = dataio.load_questions(tiny_index, "visual_dev")[:4]
    texts = [q["question"] for q in qs]
    images = [None if n == 1 else q["image"] for n, q in enumerate(qs)]  # query 1 ranks by its text
    payload = {"queries": texts, "topk": 3, "return_scores": True, "kb": "image",
               "images": [None if x is None else retrievers.png_base64(x) for x in images]}
    code, body = post(server + "/retrieve", payload)
    assert code == 200
    assert [body["result"][n][0]["document"]["id"] for n in (0, 2, 3)] == [qs[n]["steps"][0]["doc_id"] for n in (0, 2, 3)]
    local = retrievers.Retriever(tiny_index, "dense", encoder=encoder).search(texts, "image", 3, images=images)  # as served
    for got, want in zip(body["result"], local):
        assert [g["document"]["id"] for g in got] == [w["id"] for w in want]
        np.testing.assert_allclose([g["score"] for g in got], [w["score"] for w in want], atol=1e-5)
    remote = retrievers.RemoteRetriever(server).search(texts, "image", 3, images=images)
    assert [[d["id"] for d in r] for r in remote] == [[d["id"] for d in r] for r in local]

NO_IMAGE = base64.b64encode(b"no image").decode()

@pytest.mark.parametrize("payload, raw, loc, words", [
    ({"queries": ["q"], "kb": "video"}, None, ["kb"], "Input should be 'text', 'table' or 'image'"),
    ({"queries": []}, None, ["queries"], "at least 1 item"),
    ({"queries": ["q"] * 1025}, None, ["queries"], "at most 1024 items"),
    ({"queries": "not a list"}, None, ["queries"], "valid list"),
    ({"topk": 3}, None, ["queries"], "Field required"),
    ({"queries": ["q"], "topk": "3"}, None, ["topk"], "valid integer"),
    ({"queries": ["q"], "topk": 3.0}, None, ["topk"], "valid integer"),
    ({"queries": ["q"], "topk": True}, None, ["topk"], "valid integer"),
    ({"queries": ["q"], "topk": 0}, None, ["topk"], "greater than or equal to 1"),
    ({"queries": ["q"], "topk": 101}, None, ["topk"], "less than or equal to 100"),
    ({"queries": ["q"], "return_scores": "yes"}, None, ["return_scores"], "valid boolean"),
    ({"queries": ["q"], "top_k": 2}, None, ["top_k"], "Extra inputs are not permitted"),
    (None, b'{"queries": ["unterminated', [], "JSON decode error"),
    ({"queries": ["q", "r"], "kb": "image", "images": [None]}, None, ["images"],
     "'images' must hold one entry per query (2), got 1"),
    ({"queries": ["q"], "kb": "image", "images": [None, None]}, None, ["images"],
     "'images' must hold one entry per query (1), got 2"),
    ({"queries": ["q"], "kb": "image", "images": ["not base64!"]}, None, ["images"],
     "images[0]: not a base64-encoded image"),
    ({"queries": ["q", "r"], "kb": "image", "images": [None, NO_IMAGE]}, None, ["images"],
     "images[1]: not a base64-encoded image (cannot identify image file"),
    ({"queries": ["q"], "kb": "image", "images": [3]}, None, ["images", 0], "valid string"),
])
def test_server_rejects_bad_requests_in_one_shape_and_stays_up(server, payload, raw, loc, words):
    # FastAPI's 422: one error, its loc the field refused, its msg why
    code, body = post(server + "/retrieve", payload, raw)
    assert code == 422 and set(body) == {"detail"} and len(body["detail"]) == 1, body
    err = body["detail"][0]
    assert {"type", "loc", "msg"} <= set(err) and err["loc"][:len(loc) + 1] == ["body", *loc], err
    assert words in err["msg"], err
    assert post(server + "/retrieve", {"queries": ["still alive?"]})[0] == 200

def test_the_servers_openapi_shows_its_limits(server):
    with urllib.request.urlopen(server + "/openapi.json", timeout=30) as r:
        schema = json.loads(r.read())["components"]["schemas"]["QueryRequest"]
    fields = schema["properties"]
    assert schema["required"] == ["queries"] and schema["additionalProperties"] is False
    assert (fields["queries"]["minItems"], fields["queries"]["maxItems"]) == (1, 1024)
    assert fields["topk"]["default"] == 3
    assert {"type": "integer", "minimum": 1, "maximum": 100} in fields["topk"]["anyOf"]  # or null: the default
    assert fields["return_scores"] == {"type": "boolean", "title": "Return Scores", "default": False}
    assert fields["kb"]["enum"] == list(dataio.KBS) and fields["kb"]["default"] == "text"
    assert [x.get("maxItems") for x in fields["images"]["anyOf"]] == [1024, None]

class FlakyProxy(http.server.BaseHTTPRequestHandler):
    """Passes each POST on to the retrieval server at `server.upstream`, but first answers `server.faults` in turn,
    (status, headers, body) each, status None closing the connection unanswered: what a load balancer before the
    server, or the server itself, sends while it restarts or is busy. Each request's time goes to `server.times`."""
    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.server.times.append(time.perf_counter())
        if self.server.faults:
            status, headers, reply = self.server.faults.pop(0)
        else:
            req = urllib.request.Request(self.server.upstream + self.path, data=body,
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=60) as r:
                    status, headers, reply = r.status, {}, r.read()
            except urllib.error.HTTPError as e:
                status, headers, reply = e.code, {}, e.read()
        if status is None:
            return
        self.send_response(status)
        for key, value in {"Content-Length": str(len(reply)), **headers}.items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args):
        pass

@contextlib.contextmanager
def flaky_proxy(upstream, faults=()):
    """A FlakyProxy before `upstream` on loopback: yields it (its URL, its faults left and its requests' times)."""
    proxy = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FlakyProxy)
    proxy.upstream, proxy.faults, proxy.times = upstream, list(faults), []
    proxy.url = f"http://127.0.0.1:{proxy.server_port}"
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    try:
        yield proxy
    finally:
        proxy.shutdown()
        proxy.server_close()

def test_remote_client_retries_what_a_busy_or_restarting_server_answers(server, tiny_index, monkeypatch):
    faults = [(502, {}, b"<html>Bad Gateway</html>"),           # a proxy whose server is down
              (None, {}, b""),                                   # the connection closed unanswered
              (503, {"Retry-After": "1"}, b"busy"),              # asks for a second's wait
              (200, {}, b"<html>down for maintenance</html>"),   # not JSON
              (200, {"Content-Length": "1000"}, b'{"result": [[{"docu'),  # cut short
              (429, {}, b"slow down")]
    monkeypatch.setattr(retrievers, "RETRY", (len(faults) + 1, 0.01, 2.0))
    queries = [s["sub_question"] for q in dataio.load_questions(tiny_index, "dev")[:4] for s in q["steps"]]
    want = retrievers.RemoteRetriever(server).search(queries, "text", 3)
    with flaky_proxy(server, faults) as proxy:
        assert retrievers.RemoteRetriever(proxy.url).search(queries, "text", 3) == want
        assert not proxy.faults and len(proxy.times) == len(faults) + 1
        assert proxy.times[3] - proxy.times[2] >= 1.0  # the Retry-After's second, not the back-off's 0.04 s

def test_remote_client_does_not_retry_a_refusal_and_names_a_server_that_stays_down(server, monkeypatch):
    monkeypatch.setattr(retrievers, "RETRY", (3, 0.01, 0.05))
    with flaky_proxy(server) as proxy:
        with pytest.raises(RuntimeError, match=r"refused the request \(422\): .*\"kb\".*Input should be 'text'") as e:
            retrievers.RemoteRetriever(proxy.url).search(["q"], "video", 3)
        assert len(proxy.times) == 1 and "\n" not in str(e.value)  # the request's own fault: asked once
    port = free_port()  # nothing listens there
    with pytest.raises(RuntimeError) as e:
        retrievers.RemoteRetriever(f"http://127.0.0.1:{port}").search(["q"], "text", 3)
    assert str(e.value) == (f"retrieval server http://127.0.0.1:{port}/retrieve gave no result after 3 tries (the "
                            "last: ConnectionRefusedError(111, 'Connection refused'))")

class Outage(rollout.GoldPolicy):
    """The gold policy, which calls `outage` once as the step loop waits for its second turns: the loop's later
    searches find the retrieval server as `outage` left it."""
    def __init__(self, tok, questions, outage):
        super().__init__(tok, questions)
        self.outage, self.polls = outage, 0

    def poll(self):
        self.polls += 1
        if self.polls == 2:
            self.outage()
        return super().poll()

def test_a_rollout_rides_out_a_retrieval_server_restart(tiny_index, tok):
    # the step loop (evaluate.py's and the trainers') through --retriever http://: the server stops after the first
    # searches and starts again on the same port 1 s later; the trajectories equal an undisturbed run's
    qs = dataio.load_questions(tiny_index, "dev")[:8]
    port = free_port()
    base, procs = f"http://127.0.0.1:{port}", [serve(tiny_index, port, "--method", "bm25")]
    def outage():
        procs[0].terminate()
        procs[0].wait(10)
        restart.start()
    restart = threading.Timer(1.0, lambda: procs.append(serve(tiny_index, port, "--method", "bm25")))
    rows = lambda trajs: [{k: v for k, v in t.items() if k != "timings"} for t in trajs]
    try:
        wait_up(procs[0], base)
        want = rows(rollout.rollout(rollout.GoldPolicy(tok, qs), retrievers.RemoteRetriever(base), qs))
        assert sum(len(t["steps"]) for t in want) > len(qs)  # searches after the outage too
        t = time.perf_counter()
        got = rows(rollout.rollout(Outage(tok, qs, outage), retrievers.RemoteRetriever(base), qs))
        assert len(procs) == 2 and procs[1].poll() is None and time.perf_counter() - t > 1.0
        assert got == want
    finally:
        restart.cancel()
        for proc in procs:
            proc.terminate()
            proc.wait(10)

# ----------------------------------------------------------------------------------------------------------------
# Approximate indexes (--index hnsw | ivfpq)

@pytest.fixture(scope="module")
def clustered():
    """10k docs and 200 held-out queries of bench/index.py's clustered mixture, 96-d (a fast build), their norms spread
    over 0.5..2 so that inner product and L2 rank differently (the exact L2 top-10 shares ~2% with the inner-product
    one), and the exact inner-product top-10 of each query."""
    from bench import index as bench_index
    rng = np.random.default_rng(0)
    x = bench_index.clustered(10_200, 96, 1.0, rng) * rng.uniform(0.5, 2, (10_200, 1)).astype(np.float32)
    docs, queries = x[:10_000], x[10_000:]
    return docs, queries, retrievers.faiss_index(docs).search(queries, 10)[1]

def recall10(ids, exact):
    return float(np.mean([len(set(a) & set(b)) / 10 for a, b in zip(ids, exact)]))

@pytest.mark.parametrize("kind, min_recall", [("hnsw", 0.95), ("ivfpq", 0.7)])  # measured 0.9995 and 0.77 (PQ's ceiling)
def test_approximate_indexes_find_the_exact_neighbours_memory_mapped(tmp_path, clustered, kind, min_recall):
    import faiss
    docs, queries, exact = clustered
    index, params = retrievers.dense_index(docs, kind, pq_m=12)  # 8 dims a PQ byte, as 48 are for 384-d
    assert params["type"] == kind and (kind == "hnsw" or params["nlist"] == retrievers.ivf_nlist(len(docs)) == 256)
    path = tmp_path / f"{kind}.faiss"
    faiss.write_index(index, str(path))
    in_memory = faiss.read_index(str(path))
    assert str(path) not in Path("/proc/self/maps").read_text()
    mapped = retrievers.load_dense(path, params)  # at the default depth
    assert str(path) in Path("/proc/self/maps").read_text()  # memory-mapped, not read in
    depth = retrievers.DEPTH[kind]
    assert (mapped.hnsw.efSearch if kind == "hnsw" else mapped.nprobe) == depth
    if kind == "hnsw":
        in_memory.hnsw.efSearch = depth
    else:
        in_memory.nprobe = depth
    scores, ids = mapped.search(queries, 10)
    want_scores, want_ids = in_memory.search(queries, 10)
    assert (ids == want_ids).all() and np.array_equal(scores, want_scores)
    assert recall10(ids, exact) >= min_recall  # an L2 metric or shifted ids would score ~0.02
    assert np.mean([e[0] in i for i, e in zip(ids, exact)]) >= 0.95  # the exact top-1 is in the top-10
    true = np.take_along_axis(queries @ docs.T, ids, 1)  # [q, 10] the exact inner products of what was found
    assert np.abs(scores - true).max() < 1e-4 if kind == "hnsw" else np.abs(scores - true).mean() < 0.2  # PQ's: 0.12
    shallow = retrievers.load_dense(path, params, search_depth=1).search(queries, 10)[1]
    assert recall10(shallow, exact) < recall10(ids, exact) - 0.05  # measured 0.68 and 0.65

def test_build_records_the_index_and_small_kbs_stay_flat_under_ivfpq(tmp_path, tiny_world, tiny_index, encoder, capsys):
    data = tmp_path / "data"
    shutil.copytree(tiny_world, data, ignore=shutil.ignore_patterns("index"))
    flat = retrievers.Retriever(tiny_index, "dense", encoder=encoder)
    queries = {kb: [s["sub_question"] for q in dataio.load_questions(data, "dev") for s in q["steps"] if s["kb"] == kb]
               for kb in dataio.KBS}
    meta = retrievers.build(data, methods=("dense",), encoder=encoder, progress=False, index="hnsw")
    assert json.loads((data / "index" / "meta.json").read_text()) == meta
    assert all(v["index"] == dict(type="hnsw", M=retrievers.HNSW_M, efConstruction=retrievers.HNSW_EF_CONSTRUCTION)
               for v in meta["kbs"].values())
    hnsw = retrievers.Retriever(data, "dense", encoder=encoder)
    for kb in dataio.KBS:
        got, want = hnsw.search(queries[kb], kb, 1), flat.search(queries[kb], kb, 1)
        assert np.mean([g[0]["id"] == w[0]["id"] for g, w in zip(got, want)]) >= 0.95, kb
    n = {kb: len(dataio.load_kb(data, kb)) for kb in dataio.KBS}
    assert max(n.values()) < retrievers.PQ_MIN
    meta = retrievers.build(data, methods=("dense",), encoder=encoder, progress=False, index="ivfpq")
    assert capsys.readouterr().out.splitlines() == [f"{kb} KB: {n[kb]} docs are too few to train IVF-PQ (needs >= "
                                                    f"{retrievers.PQ_MIN}); indexed flat (exact) instead" for kb in dataio.KBS]
    assert all(v["index"] == {"type": "flat"} for v in meta["kbs"].values())
    exact = retrievers.Retriever(data, "dense", encoder=encoder)
    hits = lambda r, kb: [[(d["id"], d["score"]) for d in per_q] for per_q in r.search(queries[kb], kb, 5)]
    assert all(hits(exact, kb) == hits(flat, kb) for kb in dataio.KBS)
    with pytest.raises(dataio.DataError, match="--pq_m 50 must divide the embedding dimension 384"):
        retrievers.build(data, methods=("dense",), encoder=encoder, progress=False, index="ivfpq", pq_m=50)
    assert not list(data.glob(".index.tmp*"))  # refused before writing anything
