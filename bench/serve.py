"""
bench/serve.py: serve.py under load. The router (the main job's Step-GRPO checkpoint, vLLM) behind its HTTP server on
loopback; the first N test questions asked one at a time, then by N concurrent clients (each request's trajectory
joins the engine's running batch); requests a second, p50 and p95 latency, and the ratio. Every concurrent answer is
checked against the one-at-a-time answer of its question (greedy: the same unless batching moves a near-tie).
    python -m bench.serve --model out/demo/stepgrpo/final --data data/mini -n 8
"""
import argparse
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import dataio
import remote
import serve
import trainutil

def post(client, question):
    """One chat request through the openai client (its kept-open connections, as a user's client has them); (seconds,
    answer, the steps' sub-questions)."""
    body = dict(model="r1router", messages=[dict(role="user", content=question)])
    t = time.perf_counter()
    out = client.post("/chat/completions", body=body, cast_to=object)
    subs = [p["sub_question"] for s in out.get("steps", []) for p in s["sub_questions"]]
    return time.perf_counter() - t, out["choices"][0]["message"]["content"], subs

def figures(name, times, wall):
    times = sorted(times)
    p95 = times[min(len(times) - 1, round(0.95 * (len(times) - 1)))]
    print(f"{name}: {len(times) / wall:.2f} requests/s, latency p50 {statistics.median(times):.2f} s, p95 {p95:.2f} s "
          f"({wall:.1f} s for {len(times)})")
    return len(times) / wall

def main(args):
    import uvicorn
    import torch
    print(f"CPU: {trainutil.device_kind(torch.device('cpu'))}; {torch.get_num_threads()} threads")
    engine, ret, s, known = serve.load(args)
    srv = uvicorn.Server(uvicorn.Config(serve.make_app(serve.Router(engine, ret, s, known), "r1router"),
                                        host="127.0.0.1", port=args.port, log_level="warning"))
    threading.Thread(target=srv.run, daemon=True).start()
    while not srv.started:
        time.sleep(0.05)
    qs = dataio.load_questions(args.data, "test")[:args.n]
    # no retry: a failure is the bench's finding
    client = remote.client(f"http://127.0.0.1:{args.port}/v1", None, timeout=600, tries=1)
    post(client, qs[0]["question"])  # warm-up: the first request's start-up costs
    t = time.perf_counter()
    alone = [post(client, q["question"]) for q in qs]
    one = figures("one at a time", [r[0] for r in alone], time.perf_counter() - t)
    t = time.perf_counter()
    with ThreadPoolExecutor(args.n) as ex:
        together = list(ex.map(lambda q: post(client, q["question"]), qs))
    many = figures(f"{args.n} concurrent clients", [r[0] for r in together], time.perf_counter() - t)
    same = sum(a[1:] == b[1:] for a, b in zip(alone, together))
    print(f"ratio: {many / one:.2f}x the requests a second; {same} of {args.n} answers and steps as one at a time")
    srv.should_exit = True

if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python -m bench.serve", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="out/demo/stepgrpo/final")
    ap.add_argument("--data", default="data/mini")
    ap.add_argument("--retriever", default="dense")
    ap.add_argument("--backend", default="vllm", choices=["vllm", "hf"])
    ap.add_argument("--topk", type=int, default=1)
    ap.add_argument("--max_steps", type=int, default=3)
    ap.add_argument("--max_model_len", type=int, default=4096)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("-n", type=int, default=8, help="requests, and concurrent clients")
    ap.add_argument("--port", type=int, default=8091)
    main(ap.parse_args())
