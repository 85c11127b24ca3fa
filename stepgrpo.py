"""
stepgrpo.py: Step-GRPO, GRPO whose rewards are given per step. One step: this rank's questions ->
groups of n samples of one step at a prompt (or of a whole trajectory) from the rank's engine ->
each step's reward (steprewards.py) -> group-relative advantages on the step's tokens
(grpo.advantages) -> the clipped loss and an AdamW step on the FSDP2 policy (learner.py) -> the new
weights into the engine. Flags, their sources, the other rollout modes, rewards and losses:
docs/stepgrpo.md.

    python stepgrpo.py --model out/sft/final --data data/mini --out out/stepgrpo   # the recipe
    torchrun --standalone --nproc_per_node 2 stepgrpo.py --model out/sft/final --out out/stepgrpo
    python stepgrpo.py ... --resume                                    # from <out>/latest, exactly
    python stepgrpo.py ... --rollout onpolicy --adv_estimator gae         # PPO with a critic
"""
import argparse
import os
import random
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

import critic
import dataio
import engines
import evaluate
import groups
import grpo
import judge as judges
import learner
import memory
import remote
import rollout
import steprewards
import trainutil
import transcript
import vision
from clock import CLOCK
from report import curves_chart

KEEP = 3           # newest checkpoints kept (and <out>/best's)
SAMPLES = 4        # trajectories a step (and a dev evaluation) shows in wandb's tables: rank 0's

def get_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    arg = ap.add_argument
    arg("--model", default="out/sft/final", help="policy to start from; the KL reference")
    arg("--data", default="data/mini", help="corpus.py folder: questions, KBs, indexes")
    arg("--split", nargs="+", default=["train"], help="question splits trained on, mixed")
    arg("--out", default="out/stepgrpo")
    arg("--resume", nargs="?", const="yes", choices=["yes", "auto"],
        help="continue from <out>/latest; auto: if there is one")
    # rollouts and rewards
    arg("--rollout", default="teacher_prefix", choices=["teacher_prefix", "onpolicy", "branch"],
        help="a group: n samples of one gold-prefix step | of a question | of an own step")
    arg("--branch_steps", type=int, default=2, help="branch: most steps of a trajectory grouped")
    arg("--teacher_spans", default="route", choices=["route", "all"],
        help="teacher_prefix: train routing steps only, or the answers too")
    arg("--prefixes", default="gold", help="teacher_prefix: gold, or a synth.py folder")
    arg("--reward", default="step", choices=["step", "outcome"],
        help="step rewards, or the outcome alone (plain GRPO)")
    arg("--balance_kb", action=argparse.BooleanOptionalAction, default=True,
        help="route advantages times the gold route's inverse frequency")
    arg("--w_format", type=float, default=0.2, help="reward of a step that parses")
    arg("--route_credit", default="split", choices=["whole", "split"],
        help="teacher_prefix: the KB's credit on the <ret> tokens alone (split)")
    arg("--adv_std", action=argparse.BooleanOptionalAction, default=False,
        help="divide group advantages by the group's std")
    arg("--dynamic_sampling", action=argparse.BooleanOptionalAction, default=False,
        help="DAPO's: draw more questions until every group carries a gradient")
    arg("--overlong", default="none", choices=["none", "mask", "penalty"],
        help="a step cut at its budget: untrained (mask) or DAPO's soft penalty")
    arg("--w_hit", type=float, default=0.0, help="onpolicy: reward of a search hitting gold")
    arg("--w_rag", type=float, nargs="+", default=[0.0], metavar="W",
        help="judged relevance [and groundedness] weights on the outcome")
    arg("--judge", default=None, metavar="MODEL",
        help="--w_rag's judge: a model folder (with --judge_url: or a served model's name)")
    arg("--judge_url", default=None, help="--judge served: http://host:8000/v1")
    arg("--judge_backend", default=None, choices=["openai", "chat"],
        help="--judge_url's: token-exact or chat (default: openai for a folder, chat for a name)")
    arg("--judge_api_key", default=None, help="--judge_url's key (else $JUDGE_API_KEY)")
    arg("--batch_questions", type=int, default=16, help="questions a step, over all ranks")
    arg("-n", "--group_size", type=int, default=8, help="samples a group")
    arg("--max_steps", type=int, default=3, help="routing steps a trajectory")
    arg("--topk", type=int, default=3, help="evidence documents a sub-question")
    arg("--retriever", default="dense", help="dense | bm25 | hybrid | http://host:port")
    arg("--max_model_len", type=int, default=engines.MAX_LEN, help="the engine's context")
    arg("--max_pixels", type=int, default=None, help="VL policy: a picture's pixel cap")
    # optimisation
    arg("--lr", type=float, default=5e-6)
    arg("--kl_coef", type=float, default=0.0, help="k3 KL to --model in the loss")
    arg("--entropy_coef", type=float, default=0.0, help="entropy bonus in the loss")
    arg("--old_logprobs", default="sampler", choices=["sampler", "trainer"],
        help="the ratio's old logprobs: the engine's, or the trainer's recomputed")
    arg("--clip_low", type=float, default=grpo.CLIP_LOW, help="ratio's clip below 1 (GSPO: 3e-4)")
    arg("--clip_high", type=float, default=0.2, help="the ratio's clip above 1 (DAPO: 0.28)")
    arg("--ratio", default="token", choices=["token", "sequence"],
        help="importance ratio per token (PPO) or per step (GSPO)")
    arg("--tis_cap", type=float, default=0.0, help="truncated importance sampling's cap (0: off)")
    arg("--minibatches", type=int, default=1, help="optimizer steps a rollout")
    arg("--micro_batch", type=int, default=2, help="rows a forward/backward")
    arg("--micro_tokens", type=int, default=0,
        help="or rows end to end up to this many tokens a forward/backward (0: off)")
    arg("--max_nonfinite", type=int, default=3, help="stop at this many non-finite steps in a row")
    arg("--train_steps", type=int, default=12)
    arg("--save_every", type=int, default=6)
    arg("--eval_questions", type=int, default=100, help="dev questions a checkpoint (0: off)")
    arg("--activation_checkpointing", action="store_true")
    arg("--flex_attention", action="store_true",
        help="packed groups' tree masks as FlexAttention block masks (CUDA)")
    arg("--offload", action="store_true", help="FSDP2 CPU offload of shards and optimizer state")
    arg("--dtype", default="auto", choices=["auto", "bf16", "fp32"], help="auto: bf16 where native")
    arg("--device", default="auto", choices=["auto", "cpu", "cuda"])
    arg("--lora_r", type=int, default=0, help="LoRA rank (0: all weights)")
    arg("--quant", default="none", choices=["none", "nf4", "int8"], help="QLoRA's frozen base")
    arg("--backend", default="vllm", choices=["vllm", "hf"], help="each rank's sampler")
    # PPO (--adv_estimator gae; critic.py)
    arg("--adv_estimator", default="grpo", choices=list(grpo.ESTIMATORS),
        help="group-relative (grpo), or GAE over a critic's values (gae: PPO)")
    arg("--critic_lr", type=float, default=1e-5, help="gae: the critic's learning rate")
    arg("--critic_warmup", type=int, default=4, help="gae: steps training the critic alone first")
    arg("--kl_in_reward", type=float, default=0.0, help="gae: KL penalty in the token rewards")
    arg("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    # the transcript format is the policy's own, from its checkpoint: it has no other to run in
    args.__dict__.update(transcript.trained_format(args.model))
    return args

#### the settings, built once from the flags

def rollout_config(args):
    steps = rollout.Settings(max_steps=args.max_steps, topk=args.topk, structure=args.structure,
                             max_pairs=args.max_pairs, max_rets=args.max_rets, actions=args.actions,
                             temperature=learner.TEMPERATURE)
    return groups.RolloutConfig(args.rollout, args.group_size, steps, args.reward,
                                args.adv_estimator, args.adv_std, args.teacher_spans,
                                args.route_credit, args.overlong, args.branch_steps,
                                args.dynamic_sampling)

def update_config(args):
    return learner.UpdateConfig(args.micro_batch, args.micro_tokens, args.minibatches,
                                args.clip_low, args.clip_high, args.kl_coef, args.entropy_coef,
                                args.ratio, args.tis_cap, args.old_logprobs, args.kl_in_reward,
                                args.adv_estimator == "gae", args.flex_attention)

def reward_weights(args, questions, judge=None):
    """steprewards.Weights of --w_format, --w_hit, --w_rag with its judge; with --balance_kb the
    class factors of the training questions."""
    balance = steprewards.kb_balance(questions, args.max_steps, args.max_pairs) \
        if args.balance_kb else None
    rag = (list(args.w_rag) + [0.0])[:2]
    return steprewards.Weights(args.w_format, args.w_hit, balance, rag, judge)

#### the log

def log_record(step, epoch, stats, sums, grad_norm, timing, rows, upd, kv_used=None):
    """One log.jsonl record: means over all ranks of the rollout stats, the update's per-token sums,
    the timings; kv_used: this rank's engine's highest share of its KV cache in use in the rollout
    (VLLMEngine.kv_used; 1.0: full, so requests waited), the fullest rank's logged."""
    sums = dict(sums)
    # PPO's: value_loss, vf_clipfrac, explained_var
    ppo = critic.record(sums.pop("critic")) if "critic" in sums else {}
    means = {f"{k}.{part}": v for k in groups.STATS
             for part, v in (("sum", sum(stats[k])), ("n", len(stats[k])))}
    local = {**sums, **means, **timing}
    vec = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=sums["loss"].device)
                       for v in local.values()])
    dist.all_reduce(vec)
    tot, world = dict(zip(local, vec.tolist())), dist.get_world_size()
    mean = lambda k: tot[f"{k}.sum"] / tot[f"{k}.n"] if tot[f"{k}.n"] else None  # noqa: E731
    n_tok = max(1.0, tot["tokens"])
    adv = [abs(a) for s in rows for a, m in zip(s["adv"], s["mask"]) if m]  # rank 0's
    return dict(step=step, epoch=epoch, world=world,
                **{k: mean(k) for k in groups.STATS},
                loss=tot["loss"],  # the global mean loss
                kl=tot["kl"] / n_tok if upd.kl_coef > 0 else None,
                clip_frac=(tot["clip_low"] + tot["clip_high"]) / n_tok,  # verl's pg_clipfrac
                clip_low_frac=tot["clip_low"] / n_tok, clip_high_frac=tot["clip_high"] / n_tok,
                tis_weight=tot["tis"] / n_tok if upd.tis_cap else None,
                tis_capped=tot["tis_capped"] / n_tok if upd.tis_cap else None,
                old_gap=tot["old_gap"] / n_tok if upd.old_logprobs == "trainer" else None,
                entropy=tot["entropy"] / n_tok, grad_norm=grad_norm,
                adv_abs=float(np.mean(adv or [0.0])),
                **ppo, **{k: tot[k] / world for k in timing}, **fullest(kv_used, vec.device))

def fullest(kv_used, device):
    """{"kv_used": the largest of the ranks' values} ({} where the engine does not say)."""
    if kv_used is None:
        return {}
    top = torch.tensor(kv_used, dtype=torch.float64, device=device)
    dist.all_reduce(top, op=dist.ReduceOp.MAX)
    return dict(kv_used=top.item())

def log_samples(log, step, **tables):
    """The first SAMPLES rollout.Samples of each table (name=samples) as that wandb table at `step`:
    the trajectories behind the step's numbers (wandb alone; rank 0's, the log's)."""
    for name, samples in tables.items():
        log.table(step, name, rollout.Sample.COLUMNS, [x.row() for x in samples[:SAMPLES]])

def log_start(dev, log, n, print0):
    """The starting policy's dev scores (dev: a callable) and samples, logged at step 0."""
    scores, samples = dev()
    log(dict(step=0, **scores))
    log_samples(log, 0, dev_samples=samples)
    print0(f"dev ({n} questions) at the start: F1-Recall {scores['dev_f1_recall']:.1f}, "
           f"routing acc {scores['dev_routing_acc']:.1f}")

#### main

@dataclass
class Policy:
    """The trained policy (FSDP2), its KL reference (None: none, or LoRA's base), AdamW, PPO's
    (critic, AdamW) or None, and this rank's engine holding the policy's weights."""
    model: torch.nn.Module
    ref: torch.nn.Module | None
    opt: torch.optim.Optimizer
    crit: tuple | None
    engine: object

def setup_policy(args, start, weights, resuming, lora, rank, world, device, print0):
    """The Policy, and the step and dev history it resumes at. --backend hf: an unsharded
    transformers copy synced after each update as vLLM's is (not generate on the FSDP2 module, whose
    every decoding step would be a collective all ranks run in lockstep)."""
    tree = args.rollout != "onpolicy"  # packed groups: 4D attention masks (SDPA, not flash-attn)
    bf16 = args.dtype == "bf16"
    with CLOCK("model"):
        model = trainutil.load_sharded(weights, device, world, args.activation_checkpointing,
                                       bf16=bf16, tree_mask=tree, lora=lora, offload=args.offload,
                                       flex=args.flex_attention)
        kl = (args.kl_coef > 0 or args.kl_in_reward > 0) and not lora  # LoRA's: its adapters off
        ref = trainutil.load_sharded(args.model, device, world, train=False, bf16=bf16,
                                     tree_mask=tree, offload=args.offload,
                                     flex=args.flex_attention) if kl else None
        params = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters alone
        opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0)
        crit = critic.load(args.model, args.critic_lr, device, world, lora, bf16,
                           args.activation_checkpointing, args.offload) \
            if args.adv_estimator == "gae" else None
        step, dev_hist = 0, {}  # dev_hist: step -> dev score (--eval_questions)
        if resuming:
            state = trainutil.load_trainer_state(model, opt, start, args, print0, crit)
            step, dev_hist = state["step"], state.get("dev", {})
    with CLOCK("engine"):
        engine = start_engine(args, weights, model, opt, crit, rank, world, device)
        if lora:  # the engine holds the base: give it the policy (resumed adapters, quantised base)
            engine.sync_weights(trainutil.policy_params(model))
    return Policy(model, ref, opt, crit, engine), step, dev_hist

def start_engine(args, weights, model, opt, crit, rank, world, device):
    """This rank's inference engine: --backend hf, an unsharded transformers copy; else vLLM, its
    share of the GPU checked against what the trainer will hold (memory.check_gpu_budget)."""
    if args.backend == "hf":
        return engines.HFEngine(weights, seed=args.seed + rank, max_model_len=args.max_model_len,
                                max_pixels=args.max_pixels, device=device)
    vllm = engines.VLLMEngine
    share = vllm.OFFLOAD_FRACTION if args.offload else vllm.GPU_FRACTION
    run = rollout_config(args)
    # a micro-batch's most: --micro_batch rows, or within its token budget (one longer row alone)
    most = lambda rows: (max(args.micro_tokens, rows(1)) if args.micro_tokens  # noqa: E731
                         else rows(args.micro_batch))
    positions = most(lambda m: run.update_positions(m, args.max_model_len))  # prompts included
    memory.check_gpu_budget(model, opt, share, world, most(run.update_tokens), crit,
                            args.max_model_len, args.dtype == "bf16", positions)
    per_rank = lambda n: -(-n // world)  # noqa: E731  (ceil)
    return vllm(weights, max_model_len=args.max_model_len, max_pixels=args.max_pixels,
                max_images=run.steps.max_images, seed=args.seed + rank, device=device,
                gpu_memory_utilization=share, sleep=True,  # each rank's, asleep in the update
                kv_tokens=run.kv_tokens(per_rank(args.batch_questions),
                                        per_rank(args.eval_questions)))  # the CPU's

def load_inputs(args, weights, device, print0):
    """The training questions (a --prefixes store's alone), the dev questions, the retriever, what
    is saved beside the weights (a VL processor, else the tokenizer), the pad id and the --prefixes
    store (None: gold prefixes); exits with one line on bad data."""
    import retrievers
    from transformers import AutoTokenizer
    try:
        questions = [q for sp in args.split for q in dataio.load_questions(args.data, sp)]
        dev_qs = dataio.load_questions(args.data, "dev")[:args.eval_questions] \
            if args.eval_questions else []
        ret = retrievers.make_retriever(args.retriever, args.data, device)  # env_rank's device
        tok = AutoTokenizer.from_pretrained(weights)
        store = None if args.prefixes == "gold" else \
            transcript.load_trajectories(args.prefixes, tok, print0)
    except dataio.DataError as e:
        sys.exit(f"error: {e}")
    if store is not None:  # a teacher's trajectories: only the questions it kept are trained on
        questions = [q for q in questions if q["id"] in store]
        print0(f"--prefixes {args.prefixes}: {len(questions)} of its {len(store)} trajectories' "
               "questions are in --split")
    groups.check_questions(questions, args.batch_questions,
                           f"--data {args.data} --split {' '.join(args.split)}")
    vis = vision.VisionIO.load(weights, args.max_pixels)
    if vis and args.micro_tokens:
        sys.exit("error: --micro_tokens: a vision-language policy's rows keep their pictures and "
                 "3-D positions apart; use --micro_batch")
    files = vis.proc if vis else tok  # saved beside the weights: a VL processor, else the tokenizer
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    return questions, dev_qs, ret, files, pad_id, store

def main(argv=None, close=True):
    """close: shut the engine and the process group down at the end, for a caller in the same
    process (the command line leaves through engines.exit_now instead)."""
    CLOCK.started()
    with CLOCK("imports"):
        import retrievers  # faiss: not at import (the tests import this module)
    args = get_args(argv)
    rank, world, device, print0 = trainutil.env_rank(args.device)
    check_args(args, world, device)
    lora = trainutil.lora_of(args.lora_r, args.quant)
    args.dtype = trainutil.resolve_dtype(args.dtype, device)  # a checkpoint records this one
    out = Path(args.out)
    start, weights, resuming = trainutil.resolve_start(args.model, out, args.resume,
                                                       lora is not None)
    with CLOCK("inputs"):
        questions, dev_qs, ret, files, pad_id, store = load_inputs(args, weights, device, print0)
    own_group = trainutil.init_group(world, device=device)
    with CLOCK("model"):
        judge = load_judge(args, out / f"judge-{rank}.jsonl") if any(args.w_rag) else None
        # the sub-question cosine's encoder: the dense retriever's where it is the same model
        own = getattr(ret, "encoder", None)
        encode = (own if own and own.path == retrievers.default_encoder_path()
                  else retrievers.Encoder(device=device)).encode
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    before = memory.resident()  # the libraries, the data, the index: before the models
    p, step, dev_hist = setup_policy(args, start, weights, resuming, lora, rank, world, device,
                                     print0)
    run, upd, w = rollout_config(args), update_config(args), reward_weights(args, questions, judge)
    greedy = replace(run.steps, temperature=0.0)  # the dev evaluation's
    dev = lambda: evaluate.dev_scores(p.engine, ret, dev_qs, greedy, rank, world)  # noqa: E731
    log = trainutil.Log(out, rank, step, resuming, remote.without_keys(vars(args)))
    if args.adv_estimator == "gae":
        critic.check_resumed(out, step, args.critic_warmup)  # a resume past it meets the gate again
    announce(args, p.model, w, len(questions), world, device, lora, print0)
    bar = trainutil.progress(rank, args.train_steps, step, "step-grpo")
    peak, peaks = memory.PeakMemory(device), {}  # peaks: phase -> each rank's highest GiB
    if dev_qs and step == 0:  # the starting policy's dev score: what the checkpoints have to beat
        with CLOCK("compute"):
            log_start(dev, log, len(dev_qs), print0)
    bad = 0  # steps in a row whose update was skipped for a non-finite gradient norm
    most, parts = 0, None  # the largest micro-batch's policy tokens; on the CPU, what is held

    #### training loop
    while step < args.train_steps:
        epoch, batch = groups.step_questions(questions, step, args.batch_questions, args.seed,
                                             rank, world)
        step += 1
        seed = args.seed + 7919 * (step - 1) + 104729 * rank
        saving = (args.save_every and step % args.save_every == 0) or step == args.train_steps
        warmup = p.crit is not None and step <= args.critic_warmup  # PPO: the critic learns alone
        # rollout groups, their step rewards and advantages: the training rows
        t = time.perf_counter()
        with peak("rollout"), CLOCK("compute"):
            rows, stats, samples = groups.rollout_rows(p.engine, ret, batch, run, encode, w, seed,
                                                       store, questions)
        timing = dict(rollout_s=time.perf_counter() - t, retrieve_s=stats.pop("retrieve_s"),
                      rollout_tokens=stats.pop("rollout_tokens"),  # this rank's (bench/flops.py)
                      rollout_generated=stats.pop("rollout_generated"))
        kv_used = getattr(p.engine, "kv_used", lambda: None)()  # vLLM's KV cache in the rollout
        p.engine.sleep()  # GPU: the engine's memory goes to the update until the sync wakes it
        memory.return_freed()  # the rollout's leftovers, before the update's peak
        # the update: the clipped loss over the rows (PPO: GAE from the critic first)
        with CLOCK("compute"):
            micro, sums, grad_norm = learner.learn(p.model, p.ref, p.opt, p.crit, rows, upd,
                                                   pad_id, device, getattr(p.engine, "vis", None),
                                                   seed, warmup, peak, timing)
        lengths = [n for m in micro for n in m.lengths]
        most = max([most] + [len(m.logp_sampler) for m in micro])
        timing.update(update_rows=len(lengths), update_tokens=sum(lengths),  # (bench/flops.py)
                      update_policy=sum(len(m.logp_sampler) for m in micro if m.weight))
        bad = learner.check_finite(bad, timing["nonfinite"], step, args.max_nonfinite)
        # the weight sync: the engine samples from the updated policy
        with CLOCK("compute"):
            timing.update(trainutil.sync_weights(p.model, p.engine, rows, pad_id, peak, saving,
                                                 args.dtype))
        memory.return_freed()  # the update's leftovers, before the next rollout
        # the log (with the dev score at a checkpoint) and the checkpoint
        rec = log_record(step, epoch, stats, sums, grad_norm, timing, rows, upd, kv_used)
        rec["memory_gib"] = memory.gather_peaks(peak.gib, world)  # per phase since the last record
        if device.type == "cpu":  # what the resident peaks hold, part by part (rank 0's logged)
            parts = memory.held_parts(p.model, p.opt, p.ref, p.crit, p.engine, most,
                                      args.dtype == "bf16", before)
            rec["memory_parts_gib"] = {k: round(v / memory.GIB, 3) for k, v in parts.items()}
        dev_samples = []
        if saving and dev_qs:
            with CLOCK("compute"):
                scores, dev_samples = timed(dev)
            rec.update(scores)
            dev_hist[step] = rec["dev_score"]
        log(rec)
        log_samples(log, step, samples=samples, dev_samples=dev_samples)
        peaks = memory.highest(peaks, rec["memory_gib"])
        show(bar, rec)
        if saving:
            with peak("checkpoint"), CLOCK("checkpoint"):
                checkpoint(p, files, out, step, args, dev_hist, rank)
        if args.adv_estimator == "gae":
            critic.check_warmup(rec, step, args.critic_warmup)  # after the checkpoint: it is kept
    peaks = memory.highest(peaks, memory.gather_peaks(peak.gib, world))  # the last checkpoint's
    finish(out, step, peaks, dev_hist, world, rank, bar, log, print0, parts)
    CLOCK.done(print0, rank)
    if close:
        p.engine.close()  # vLLM's teardown destroys the default process group too (it shares it)
        if own_group and dist.is_initialized():
            dist.destroy_process_group()

def timed(dev):
    """The dev scores (dev: a callable returning them and its samples) with the seconds they took
    (dev_s), and the samples."""
    t = time.perf_counter()
    scores, samples = dev()
    return dict(scores, dev_s=time.perf_counter() - t), samples

def announce(args, model, w, n_questions, world, device, lora, print0):
    if w.route_scale:
        print0("--balance_kb route advantage factors: " +
               ", ".join(f"{c} {v:.2f}" for c, v in sorted(w.route_scale.items())))
    n_trained = sum(q.numel() for q in model.parameters() if q.requires_grad) / 1e6
    print0(f"Step-GRPO ({args.rollout}, reward {args.reward}): world {world} "
           f"({trainutil.device_kind(device)}: {args.dtype}), {n_trained:.2f}M trained weights"
           f"{' (LoRA)' if lora else ''}, {n_questions} questions, {args.batch_questions} x "
           f"{args.group_size} per step, {args.train_steps} steps")

def show(bar, rec):
    if bar:
        bar.update(1)
        bar.set_postfix(route=f"{rec['route_r'] or 0:.3f}", kb_acc=f"{rec['kb_acc'] or 0:.2f}",
                        fmt=f"{rec['format_ok']:.2f}", sync=f"{rec['sync_s']:.2f}s")

def finish(out, step, peaks, dev_hist, world, rank, bar, log, print0, parts=None):
    """The final link, the log closed, the learning curves, and the run's summary; parts (the CPU's,
    where a phase's peak is the process's resident memory): rank 0's peaks beside what it held."""
    if rank == 0:
        trainutil.link_step(out, step, "final")
        bar.close()
        log.close()
        chart = curves_chart(out / "log.jsonl", "Step-GRPO learning curves")
        dataio.write_atomic(out / "curves.png", chart)
    print0(f"done: {step} steps; final checkpoint {out / 'final'}; learning curves "
           f"{out / 'curves.png'}")
    print0("peak memory (GiB), rank " + " / ".join(map(str, range(world))) + ": " +
           ", ".join(f"{k} " + " / ".join(f"{v:.1f}" for v in vs) for k, vs in peaks.items()))
    if parts:
        print0("rank 0's peaks by part (GiB; the rest: vLLM's library, activations, allocator):")
        for line in memory.breakdown({k: v[0] for k, v in peaks.items()}, parts):
            print0("  " + line)
    if dev_hist:
        b = max(dev_hist, key=dev_hist.get)
        print0(f"best on dev (mean of F1-Recall and routing accuracy): step {b}, "
               f"{dev_hist[b]:.1f}; {out / 'best'}")

def checkpoint(p, files, out, step, args, dev_hist, rank):
    """Save step `step` (the newest KEEP kept, and the best on dev's), and link <out>/best to the
    best."""
    best = max(dev_hist, key=dev_hist.get) if dev_hist else None  # the earliest of equal scores
    state = dict(args=remote.without_keys(vars(args)), dev=dev_hist)
    trainutil.save_checkpoint(p.model, p.opt, files, out, step, state, rank, KEEP,
                              protect=f"step_{best}" if best else None, crit=p.crit,
                              merged=step == args.train_steps or best == step,  # LoRA's: merged
                              fmt=transcript.format_meta(args))
    if rank == 0 and best:
        trainutil.link_step(out, best, "best")

def load_judge(args, cache):
    """--w_rag's judge (judge.py), its ratings cached in `cache`; a server is asked now."""
    try:
        key = remote.api_key(args.judge_api_key, remote.JUDGE_KEY_ENV)
        return judges.Judge.load(args.judge, args.judge_url, key, cache, args.judge_backend,
                                 seed=args.seed, max_model_len=args.max_model_len)
    except dataio.DataError as e:
        sys.exit(f"error: {e}")

#### argument checks: one-line errors before anything is loaded

def check_args(args, world, device=torch.device("cpu")):
    """Flag combinations that cannot work. --tis_cap and --quant int8 set --old_logprobs trainer:
    the IS weights are pi_trainer / pi_sampler, and LLM.int8 quantises activations, so the engine's
    logprobs are not the trainer's."""
    if args.tis_cap > 0:
        args.old_logprobs = "trainer"
    if args.quant == "int8" and args.old_logprobs != "trainer":
        args.old_logprobs = "trainer"
        if int(os.environ.get("RANK", 0)) == 0:
            print("note: --quant int8 uses --old_logprobs trainer (LLM.int8 quantises activations: "
                  "the engine's bf16 logprobs are not the trainer's)", flush=True)
    if args.rollout != "teacher_prefix" and args.prefixes != "gold":
        sys.exit(f"error: --prefixes is a teacher_prefix flag (--rollout {args.rollout} writes its "
                 "own steps)")
    if args.rollout == "teacher_prefix" and args.reward == "outcome":
        sys.exit("error: --reward outcome needs --rollout onpolicy or branch (a teacher_prefix "
                 "group holds one step, no outcome)")
    if len(args.w_rag) > 2 or min(args.w_rag) < 0 or (any(args.w_rag) and not args.judge) or \
            ((args.judge_url or args.judge_backend) and not args.judge) or \
            (args.judge_backend and not args.judge_url):
        sys.exit(f"error: --w_rag {' '.join(map(str, args.w_rag))}: one or two weights >= 0 "
                 "(relevance, groundedness), and --judge MODEL to rate them (--judge_url needs "
                 "--judge too, --judge_backend --judge_url)")
    if any(args.w_rag) and args.rollout == "teacher_prefix":
        sys.exit("error: --w_rag judges a whole trajectory's evidence and answer: it needs "
                 "--rollout onpolicy or branch")
    if any(args.w_rag) and world > 1 and not args.judge_url:  # two in-process vLLM engines a rank
        sys.exit("error: --judge in-process runs in a single process; under torchrun serve it and "
                 "pass --judge_url")
    if args.branch_steps < 1:
        sys.exit(f"error: --branch_steps {args.branch_steps}: it must be at least 1")
    if args.batch_questions % world:
        sys.exit(f"error: --batch_questions {args.batch_questions} must be divisible by the world "
                 f"size {world}")
    if args.group_size < 1 or (args.group_size < 2 and args.adv_estimator != "gae"):
        sys.exit(f"error: -n {args.group_size}: a group needs at least 2 samples to have a "
                 "relative advantage (--adv_estimator gae: 1 is enough)")
    if not (0 <= args.clip_low < 1 and args.clip_high >= 0 and args.tis_cap >= 0
            and args.minibatches >= 1 and args.max_nonfinite >= 1):
        sys.exit(f"error: --clip_low {args.clip_low} --clip_high {args.clip_high} --tis_cap "
                 f"{args.tis_cap} --minibatches {args.minibatches} --max_nonfinite "
                 f"{args.max_nonfinite}: 0 <= clip_low < 1, clip_high >= 0, tis_cap >= 0, "
                 "minibatches >= 1, max_nonfinite >= 1")
    if args.adv_estimator == "gae":
        critic.check_flags(args.rollout, args.structure, args.actions, args.dynamic_sampling,
                           args.critic_warmup, args.kl_in_reward, args.model)
    elif args.kl_in_reward:
        sys.exit("error: --kl_in_reward is PPO's (--adv_estimator gae); group advantages take "
                 "--kl_coef")
    if args.micro_tokens and args.rollout == "onpolicy":
        sys.exit(f"error: --micro_tokens {args.micro_tokens} is for packed groups (--rollout "
                 "teacher_prefix, branch): on-policy rows take --micro_batch")
    if args.flex_attention and (args.rollout == "onpolicy" or device.type != "cuda"):
        sys.exit(f"error: --flex_attention on {device.type} with --rollout {args.rollout}: it is "
                 "for packed groups (teacher_prefix, branch) on CUDA; FlexAttention has no "
                 "backward on CPU (torch 2.13)")
    rollout.check_multi_query(args.max_pairs, args.max_rets, args.structure, args.actions)
    if err := transcript.check_format(args.model, args):
        sys.exit(f"error: {err}")

if __name__ == "__main__":
    import retrievers
    try:
        main(close=False)
    except retrievers.RetrievalError as e:  # the search's line, not a traceback a rank
        sys.exit(f"error: {e}")
    engines.exit_now()
