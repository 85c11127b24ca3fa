"""
bench/rollout.py: throughput of the routed loop against raw vLLM generation of the same tokens: the main job's routed
evaluation (greedy, one trajectory a test question, top-1 evidence), the rollouts (each step structure; visual
questions too when the data has them), each against raw generation from the same first prompts and against raw
generation that also runs as many prompt tokens as the loop did (the evidence and turns it reads); vLLM against HF
generate (images/s for a VL policy), and the time of a weight sync into the running engine.
Figures print; docs/LOG.md keeps the measured ones.
    python -m bench.rollout --model out/demo/sft/final --n_questions 32 -n 4
    python -m bench.rollout --model out/released/sft/final --structure released     # R1-Router's released structure
A policy trained on the step format runs whole trajectories (the prompt-only model stops early).
"""
import argparse
import os
import time
from pathlib import Path

import torch

import dataio
import retrievers
import vision
from engines import HFEngine, VLLMEngine, auto_model
from prepare import DEFAULT_MODEL
from prompts import SYSTEM_PROMPT
from rollout import ReleasedSteps, Settings, TranscriptSteps, begin, rollout

def cache_only(engine, warm):
    """vLLM's prefix cache emptied, then holding the ids `warm` alone."""
    engine.llm.reset_prefix_cache()
    engine.generate([warm], 1)

def raw_run(engine, prompts, counts, temperature, warm):
    """Raw vLLM: prompts[i] [(ids, images)] generates counts[i] tokens (EOS ignored), all submitted at once, the
    prefix cache holding `warm` alone (as when the loop began); returns (policy tokens a second, prefill tokens run)."""
    from vllm import SamplingParams
    cache_only(engine, warm)
    sps = [SamplingParams(max_tokens=c, min_tokens=c, ignore_eos=True, temperature=temperature) for c in counts]
    t = time.perf_counter()
    outs = engine.llm.generate([engine.tokens_prompt(p, im) for p, im in prompts], sps, use_tqdm=False)
    tok_s = sum(counts) / (time.perf_counter() - t)
    return tok_s, sum(len(o.prompt_token_ids) - (o.num_cached_tokens or 0) for o in outs)

def run_on(x, n):
    """Trajectory x's first n transcript tokens and their pictures (ids, images), cut before a picture n splits."""
    n = min([s for s, k, _ in x["images"] if s < n < s + k] + [n])
    return x["ids"][:n], vision.images_in(x["images"], 0, n)

def bench_loop(engine, ret, qs, s, k, seed, label):
    """The routed loop (Settings s, k trajectories a question) against raw vLLM generating each trajectory's policy
    tokens from its first prompt, and against raw vLLM computing as many prompt tokens as the loop did (each first
    prompt run on into its trajectory's transcript): the first ratio is the speed goal's (docs/LOG.md), the second the
    loop's own cost (requests that wait on one another, searches, the batch thinning as trajectories end), the engine's compute
    aside. Both sides start with the shared system prompt cached. Returns the first prompts [(ids, images)]."""
    structure = s.structure
    rollout(engine, ret, qs[:4], n=1, s=s)  # warm-up
    chat = ReleasedSteps(engine.tok, engine.vis) if structure == "released" else \
        TranscriptSteps(engine.tok, SYSTEM_PROMPT.format(max_steps=s.max_steps), vis=engine.vis)
    starts = [begin(q, i, chat, s) for q in qs for i in range(k)]  # the loop's first prompts
    prompts = [(live.tr.prompt(), live.tr.prompt_images()) for live in starts]
    warm = os.path.commonprefix([p for p, _ in prompts[:2]]) if len(prompts) > 1 else prompts[0][0]
    cache_only(engine, warm)
    engine.computed.update(prefill=0, decode=0)
    t = time.perf_counter()
    trajs = rollout(engine, ret, qs, n=k, s=s, seed=seed)
    loop_s, ran, n = time.perf_counter() - t, dict(engine.computed), len(trajs)
    counts = [max(1, x["n_policy_tokens"]) for x in trajs]
    raw, first = raw_run(engine, prompts, counts, s.temperature, warm)
    more = (ran["prefill"] - first) // n  # prompt tokens a trajectory the loop ran beyond its first prompt
    longer = [run_on(x, len(p) + more) for x, (p, _) in zip(trajs, prompts)]
    same, ran_raw = raw_run(engine, longer, counts, s.temperature, warm)
    tok_s = sum(x["n_policy_tokens"] for x in trajs) / loop_s
    steps, images = sum(len(x["steps"]) for x in trajs) / n, sum(len(x["images"]) for x in trajs) / n
    print(f"{label} ({structure}): {n} trajectories, {steps:.2f} retrieval steps, {images:.1f} images, "
          f"{100 * sum(x['format_ok'] for x in trajs) / n:.0f}% well-formed, "
          f"{sum(x['overflow'] for x in trajs)} context overflows; per trajectory the model ran "
          f"{ran['prefill'] / n:.0f} prefill + {ran['decode'] / n:.0f} decode tokens in {loop_s / n:.2f}s (batched): "
          f"{tok_s:.0f} policy tok/s in {loop_s:.1f}s\n"
          f"  raw vLLM, each trajectory's tokens from its first prompt ({first / n:.0f} prefill): {raw:.0f} tok/s -> "
          f"loop/raw = {tok_s / raw:.2f}\n"
          f"  raw vLLM, as many prompt tokens as the loop ran ({ran_raw / n:.0f} prefill): {same:.0f} tok/s -> "
          f"loop/raw = {tok_s / same:.2f}")
    return prompts

def main(args):
    """Throughput of the routed loop (each step structure; visual questions too, when the data has them) vs raw vLLM
    generation of as many tokens, vLLM vs HF (on prompts with images for a VL policy: images/s), weight-sync time."""
    qs = dataio.load_questions(args.data, args.split)[:args.n_questions]
    ret = retrievers.make_retriever(args.retriever, args.data)
    engine = VLLMEngine(args.model, seed=args.seed)
    settings = lambda structure: Settings(max_steps=args.max_steps, topk=args.topk, temperature=args.temperature,
                                          structure=structure)
    # the main job's evaluation (evaluate.py --methods routed --topk 1): greedy, one trajectory a test question
    tests = dataio.load_questions(args.data, "test")[:args.n_questions]
    bench_loop(engine, ret, tests, Settings(topk=1, temperature=0.0), 1, args.seed, "routed evaluation, test questions")
    for structure in ("transcript", "released") if args.structure == "both" else (args.structure,):
        prompts = bench_loop(engine, ret, qs, settings(structure), args.n, args.seed, f"{args.split} questions")
    if (Path(args.data) / "questions" / f"visual_{args.split}.jsonl").is_file():  # the cost of a visual question
        vqs = dataio.load_questions(args.data, f"visual_{args.split}")[:args.n_questions]
        visual = bench_loop(engine, ret, vqs, settings(args.structure.replace("both", "transcript")), args.n,
                            args.seed, f"visual_{args.split} questions")
        prompts = visual if engine.vis else prompts
    from vllm import SamplingParams
    # backend speed: 16 prompts x 64 new tokens, greedy, EOS ignored by both
    prompts, n_new = prompts[:16], 64
    n_img = sum(len(im) for _, im in prompts)
    sp = SamplingParams(max_tokens=n_new, min_tokens=n_new, ignore_eos=True, temperature=0.0)
    t = time.perf_counter()
    engine.llm.generate([engine.tokens_prompt(p, im) for p, im in prompts], sp, use_tqdm=False)
    v_s = time.perf_counter() - t
    hf = HFEngine(args.model)
    t = time.perf_counter()
    for i in range(0, len(prompts), 8):  # batch 8 (HF's best on 2 cores in the CPU notes)
        batch = prompts[i:i + 8]
        L = max(len(p) for p, _ in batch)
        x = torch.tensor([[engine.tok.eos_token_id] * (L - len(p)) + p for p, _ in batch])
        am = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p, _ in batch])
        pix = hf.vis.pixels([im for _, im in batch], "cpu", x) if hf.vis else {}
        with torch.inference_mode():
            hf.model.generate(input_ids=x, attention_mask=am, **pix, max_new_tokens=n_new, min_new_tokens=n_new,
                              do_sample=False, pad_token_id=engine.tok.eos_token_id)
    h_s = time.perf_counter() - t
    v, h = len(prompts) * n_new / v_s, len(prompts) * n_new / h_s
    images = f"; {n_img} images: vLLM {n_img / v_s:.1f} images/s, HF {n_img / h_s:.1f}" if n_img else ""
    print(f"backends, 16 prompts x {n_new} tokens: vLLM {v:.0f} tok/s ({engine.dtype}), HF {h:.0f} tok/s (fp32) -> "
          f"{v / h:.1f}x (target >= 3){images}")
    sd = auto_model(args.model).from_pretrained(args.model, dtype=torch.float32).state_dict()
    times = []
    for _ in range(3):
        t = time.perf_counter()
        engine.sync_weights(sd)
        times.append(time.perf_counter() - t)
    print(f"weight sync ({sum(v.numel() for v in sd.values()) / 1e6:.0f}M parameters{', prefix and encoder caches reset' if engine.vis else ''}): "
          f"{min(times):.2f}s best, {sum(times) / 3:.2f}s mean of 3 (target <= 1 s)")

if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python -m bench.rollout", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL, help="any HF causal LM or image-text-to-text folder")
    ap.add_argument("--data", default="data/mini")
    ap.add_argument("--split", default="dev")
    ap.add_argument("--n_questions", type=int, default=32)
    ap.add_argument("-n", type=int, default=4, help="samples per question")
    ap.add_argument("--max_steps", type=int, default=3)
    ap.add_argument("--topk", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--structure", default="transcript", choices=["transcript", "released", "both"])
    ap.add_argument("--retriever", default="dense", help="dense | bm25 | hybrid | http://host:port of retrievers.py serve")
    ap.add_argument("--seed", type=int, default=0)
    main(ap.parse_args())
