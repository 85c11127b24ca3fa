"""
bench/flops.py: where the time goes. This machine's matmul peak at the policy's own shapes (fp32, and bf16 where the
CPU computes it natively), then each stage's achieved FLOP/s and its share of that peak: an SFT step, a Step-GRPO
update, vLLM prefill and decode, a routed evaluation per question, the dense index's encoder. Figures print;
docs/LOG.md keeps the measured ones, with the CPU's flags.
    python -m bench.flops --model out/demo/sft/final --data data/mini            # (make bench runs it)
    python -m bench.flops --runs out/demo/sft-cont out/demo/stepgrpo              # runs' FLOPs, updates, rows seen
FLOPs are counted from the shapes, as the work a stage needs: 2 m n k a matmul; the linear layers at every token;
causal attention 2 L d S^2 a sequence of S tokens; the LM head only where it is read (a loss's label tokens, a
generated token); a training step 3 forwards. A share far below 1 is time spent outside those matmuls: padding, a
head over every position, memory traffic, Python. SFT and Step-GRPO run their scripts' own code for a few steps in
this process (gloo, one rank), each figure from their log.jsonl.
"""
import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

import dataio
import retrievers
import trainutil
from prepare import DEFAULT_MODEL

def shapes(cfg):
    """The policy's matmul shapes (k, n) of one token's row: attention projections, the MLP, the LM head."""
    d = cfg.hidden_size
    kv = cfg.num_key_value_heads * (getattr(cfg, "head_dim", None) or d // cfg.num_attention_heads)
    return {"q / o": (d, d), "k / v": (d, kv), "mlp up": (d, cfg.intermediate_size),
            "mlp down": (cfg.intermediate_size, d), "lm head": (d, cfg.vocab_size)}

def forward_flops(cfg, tokens, head, context):
    """A forward's FLOPs over `tokens` tokens that attend to `context` earlier tokens on average (a whole sequence of S:
    S / 2), with the LM head at `head` positions."""
    d, f, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    kv = shapes(cfg)["k / v"][1]
    linear = 2 * L * (2 * d * d + 2 * d * kv + 3 * d * f)  # q, o; k, v; gate, up, down: a token
    return linear * tokens + 4 * L * d * context * tokens + 2 * d * cfg.vocab_size * head  # + QK^T and AV, + the head

def matmul_peak(cfg, dtype, tokens=1024, reps=5):
    """{shape: FLOP/s} of one [tokens, k] x [k, n] matmul in dtype, the best of reps."""
    out = {}
    for name, (k, n) in shapes(cfg).items():
        a, b = torch.randn(tokens, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
        a @ b  # warm-up
        best = min(timed(lambda: a @ b) for _ in range(reps))
        out[name] = 2 * tokens * k * n / best
    return out

def timed(fn):
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t

def records(folder):
    return [json.loads(line) for line in open(Path(folder) / "log.jsonl") if '"step"' in line]

def run_script(main, argv):
    """A training script's main() in this process (gloo, world 1, no wandb), its process group closed after."""
    import torch.distributed as dist
    os.environ["WANDB_MODE"] = "disabled"
    main([str(a) for a in argv])
    if dist.is_initialized():
        dist.destroy_process_group()

def sft_stage(cfg, args, work):
    """(FLOP/s, note) of SFT steps after the first: sft.py's own train step, from its log."""
    import sft
    run_script(sft.main, ["--model", args.model, "--data", Path(args.data) / "traj", "--out", work / "sft", "--train_steps",
                          args.steps + 1, "--eval_every", 0, "--save_every", 0])
    recs = records(work / "sft")[1:]  # the first step warms up
    rows = sft.get_args([]).batch_size * sft.get_args([]).grad_accum
    flops = sum(3 * forward_flops(cfg, r["tokens"], r["loss_tokens"], r["tokens"] / rows / 2) for r in recs)
    seconds = sum(r["step_s"] for r in recs)
    return flops / seconds, f"{seconds / len(recs):.1f} s a step, {recs[-1]['tokens']} tokens ({rows} rows)"

def grpo_stage(cfg, args, work):
    """(FLOP/s, note) of Step-GRPO updates after the first, from stepgrpo.py's log (this rank's rows and tokens)."""
    import stepgrpo
    run_script(stepgrpo.main, ["--model", args.model, "--data", args.data, "--out", work / "grpo", "--train_steps",
                               args.steps + 1, "--batch_questions", 4, "--eval_questions", 0, "--save_every", 0])
    recs = records(work / "grpo")[1:]
    if not all(r["update_tokens"] for r in recs):
        raise SystemExit(f"error: {args.model}: a Step-GRPO step had no row with a gradient (every group unanimous): "
                         "bench a policy trained on the step format, e.g. --model out/demo/sft/final")
    flops = sum(3 * forward_flops(cfg, r["update_tokens"], r["update_policy"], r["update_tokens"] / r["update_rows"] / 2)
                for r in recs)
    seconds = sum(r["update_s"] for r in recs)
    return flops / seconds, (f"{seconds / len(recs):.1f} s an update, {recs[-1]['update_tokens']:.0f} tokens in "
                             f"{recs[-1]['update_rows']:.0f} rows, {recs[-1]['update_policy']:.0f} policy tokens")

def engine_stages(cfg, args):
    """[(stage, FLOP/s, note)]: vLLM prefill (the head at each prompt's last position), decode, and a routed greedy
    evaluation per question (the tokens the engine ran, attention left out)."""
    from vllm import SamplingParams

    import rollout
    from engines import VLLMEngine
    from prompts import SYSTEM_PROMPT
    engine = VLLMEngine(args.model, seed=0)
    qs = dataio.load_questions(args.data, "dev")[:args.questions]
    chat = rollout.TranscriptSteps(engine.tok, SYSTEM_PROMPT.format(max_steps=3))
    prompts = [chat.start(dict(question=q["question"], image=None, steps=[])).prompt() for q in qs]
    gen = lambda n: engine.llm.generate([engine.tokens_prompt(p, []) for p in prompts], SamplingParams(
        max_tokens=n, min_tokens=n, ignore_eos=True, temperature=0.0), use_tqdm=False)
    gen(1)  # warm-up
    engine.llm.reset_prefix_cache()
    t = time.perf_counter()
    outs = gen(1)
    pre_s = time.perf_counter() - t
    # the prompts share the system prompt, which vLLM's prefix cache computes once: count the tokens it ran
    n_pre, n_all = sum(len(o.prompt_token_ids) - (o.num_cached_tokens or 0) for o in outs), sum(map(len, prompts))
    out = [("vLLM prefill", forward_flops(cfg, n_pre, len(prompts), n_all / len(prompts) / 2) / pre_s,
            f"{len(prompts)} prompts of {n_all // len(prompts)} tokens ({n_pre} not cached) in {pre_s:.2f} s")]
    engine.llm.reset_prefix_cache()
    new = 64
    dec_s = timed(lambda: gen(new + 1)) - pre_s
    ctx = n_all / len(prompts) + new / 2  # a decoded token's mean context
    out.append(("vLLM decode", forward_flops(cfg, new * len(prompts), new * len(prompts), ctx) / dec_s,
                f"{len(prompts)} x {new} tokens in {dec_s:.2f} s ({new * len(prompts) / dec_s:.0f} tok/s)"))
    ret = retrievers.make_retriever("dense", args.data)
    s = rollout.Settings(temperature=0.0)
    engine.computed.update(prefill=0, decode=0)
    ev_s = timed(lambda: rollout.rollout(engine, ret, qs, 1, s))
    ran = engine.computed["prefill"] + engine.computed["decode"]
    out.append(("evaluation (routed)", forward_flops(cfg, ran, engine.computed["decode"], 0) / ev_s,
                f"{ev_s / len(qs):.2f} s a question, {ran / len(qs):.0f} tokens run a question"))
    return out

def encoder_stage(args):
    """(FLOP/s, note) of the dense index's encoder over KB passages (retrievers.Encoder, the linear layers only)."""
    enc = retrievers.Encoder()
    texts = [retrievers.doc_contents(d, "text") for d in dataio.read_jsonl(Path(args.data) / "kb" / "text.jsonl")]
    texts = texts[:args.passages]
    enc.encode(texts[:32])  # warm-up
    s = timed(lambda: enc.encode(texts))
    c = enc.model.config
    tokens = sum(len(enc.tok(t, truncation=True, max_length=enc.max_length)["input_ids"]) for t in texts)
    flops = 2 * c.num_hidden_layers * (4 * c.hidden_size ** 2 + 2 * c.hidden_size * c.intermediate_size) * tokens
    return flops / s, f"{len(texts)} passages, {tokens / s:.0f} tokens/s ({enc.model.dtype})"

def run_compute(folder):
    """A finished sft.py or stepgrpo.py run's compute to its checkpoint (<folder>/best, the dev pick, where there is
    one, else final), from its log.jsonl: (step, updates, rows or questions seen, training FLOPs, rollout FLOPs or
    None). SFT: 3 forwards over each step's tokens. Step-GRPO: 3 forwards over the update's rows a PPO epoch, one more
    where the trainer recomputes the old logprobs and one where a KL reference scores them; its rollouts one forward
    over the tokens the engine ran (a prefix once: vLLM's prefix cache), the head at each generated token. A
    continued run counts its own steps only. Dev evaluations are left out (every arm's pick costs the same)."""
    from transformers import AutoConfig
    folder = Path(folder)
    ck = (folder / "best") if (folder / "best").exists() else folder / "final"
    cfg = AutoConfig.from_pretrained(ck).get_text_config()
    state = torch.load(ck / "trainer_state.pt", weights_only=True)
    recs = [r for r in records(folder) if r["step"] <= state["step"] and ("loss_tokens" in r or "update_tokens" in r)]
    a = state["args"]
    if "loss_tokens" in recs[0]:  # sft.py: a step's tokens over all ranks
        rows = state["global_batch"]
        train = sum(3 * forward_flops(cfg, r["tokens"], r["loss_tokens"], r["tokens"] / rows / 2) for r in recs)
        return state["step"], len(recs), len(recs) * rows, train, None
    if "rollout_tokens" not in recs[0]:
        raise SystemExit(f"error: {folder}/log.jsonl: no rollout_tokens (a log written before they were counted)")
    epochs = a.get("ppo_epochs", 1)  # update passes a step: one since the flag went (runs before it recorded theirs)
    passes = 3 * epochs + (a["old_logprobs"] == "trainer") + (a["kl_coef"] > 0 or a.get("kl_in_reward", 0) > 0)
    critic = 4 if a.get("adv_estimator") == "gae" else 0  # PPO's critic: its values (a forward) and its update (3), no LM head
    train = rollout = 0.0
    for r in recs:  # a record's token counts are the ranks' mean
        ctx = r["update_tokens"] / max(r["update_rows"], 1) / 2
        train += r["world"] * (passes * forward_flops(cfg, r["update_tokens"], r["update_policy"], ctx)
                               + critic * forward_flops(cfg, r["update_tokens"], 0, ctx))
        rollout += r["world"] * forward_flops(cfg, r["rollout_tokens"], r["rollout_generated"], ctx)
    return state["step"], len(recs) * epochs, len(recs) * a["batch_questions"], train, rollout

def compute_table(folders):
    print("| run | checkpoint step | updates | rows (SFT) or questions (Step-GRPO) seen | training TFLOP | rollout TFLOP "
          "| total TFLOP |\n|---|---|---|---|---|---|---|")
    for f in folders:
        step, updates, seen, train, rollout = run_compute(f)
        print(f"| {f} | {step} | {updates} | {seen} | {train / 1e12:.1f} | "
              f"{'' if rollout is None else f'{rollout / 1e12:.1f}'} | {(train + (rollout or 0)) / 1e12:.1f} |")

def main(args):
    if args.runs:
        return compute_table(args.runs)
    from transformers import AutoConfig
    cfg = AutoConfig.from_pretrained(args.model).get_text_config()
    dtype = trainutil.resolve_dtype("auto", torch.device("cpu"))
    print(f"CPU: {trainutil.device_kind(torch.device('cpu'))}; {torch.get_num_threads()} threads; training in {dtype}")
    peaks = {}
    for dt in [torch.float32] + [torch.bfloat16] * (dtype == "bf16"):
        per = matmul_peak(cfg, dt)
        peaks[dt] = max(per.values())
        print(f"matmul peak, {str(dt)[6:]} [1024 tokens x k] x [k x n]: " +
              ", ".join(f"{k} {v / 1e9:.0f}" for k, v in per.items()) + " GFLOP/s")
    train_peak = peaks[torch.bfloat16 if dtype == "bf16" else torch.float32]
    work = Path(tempfile.mkdtemp(prefix="bench_flops_"))
    try:
        rows = [("SFT step", *sft_stage(cfg, args, work), train_peak),
                ("Step-GRPO update", *grpo_stage(cfg, args, work), train_peak)]
        rows += [(name, f, note, peaks[torch.float32]) for name, f, note in engine_stages(cfg, args)]  # vLLM CPU: fp32
        rows.append(("index encoder", *encoder_stage(args), train_peak))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("\n| stage | achieved GFLOP/s | share of the matmul peak | |\n|---|---|---|---|")
    for name, f, note, peak in rows:
        print(f"| {name} | {f / 1e9:.1f} | {f / peak:.2f} | {note} |")

if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python -m bench.flops", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL, help="a policy that writes the step format (a trained SFT)")
    ap.add_argument("--data", default="data/mini", help="corpus.py folder with golden trajectories in <data>/traj")
    ap.add_argument("--steps", type=int, default=2, help="SFT steps and Step-GRPO updates timed (after one warm-up)")
    ap.add_argument("--questions", type=int, default=32, help="dev questions for the engine stages")
    ap.add_argument("--passages", type=int, default=512, help="KB passages encoded")
    ap.add_argument("--runs", nargs="+", default=None, metavar="RUN",
                    help="no benchmark: each sft.py / stepgrpo.py run's compute to its dev pick (the claim tables' columns)")
    main(ap.parse_args())
