"""
stepgrpo.py: Step-GRPO, GRPO whose rewards are given per step (route, sub-question, intermediate answer) and not only
for the outcome; an FSDP2 policy, and a vLLM engine on every rank synced after each update.

    python stepgrpo.py --model out/sft/final --data data/mini --out out/stepgrpo          # the recipe (the defaults)
    torchrun --standalone --nproc_per_node 2 stepgrpo.py --model out/sft/final --data data/mini --out out/stepgrpo
    python stepgrpo.py ... --resume                              # continue from <out>/latest exactly
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc_per_node 2 --max-restarts 3 stepgrpo.py ... \
        --resume auto                                            # a job that restarts itself after a rank dies
    python stepgrpo.py ... --teacher_spans all --no-balance_kb --w_format 0 --entropy_coef 1e-3 --old_logprobs trainer \
        --route_credit whole --adv_std                          # R1-Router's released setting
    python stepgrpo.py ... --prefixes data/mini/traj-teacher     # groups at a teacher's kept trajectories (R1-Router's data)
    python stepgrpo.py ... --rollout onpolicy                    # step scoring over whole sampled trajectories
    python stepgrpo.py ... --rollout onpolicy --reward outcome   # plain GRPO on the outcome (Search-R1, ReSearch)
    python stepgrpo.py ... --rollout onpolicy --w_hit 0.5        # + a retrieval (tool) reward (Agentic RAG-R1)
    python stepgrpo.py ... --lora_r 16 --lr 5e-5                 # LoRA (also from an SFT-LoRA run's final checkpoint)
    python stepgrpo.py ... --lora_r 16 --lr 5e-5 --quant nf4     # QLoRA: nf4 base (bitsandbytes)
    python stepgrpo.py --model out/sft-k2/final ... --max_pairs 2  # multi-query steps (SFT on synth.py --max_pairs 2)

The file reads as the algorithm: arguments -> rollouts to training rows (rollout.py's step loop; every step scored by
steprewards.step_reward; group-relative advantages, grpo.py) -> the PPO-clipped update over policy tokens -> the
weight sync into this rank's engine (checked once against the trainer) -> dev evaluation -> main. Every rank takes
its share of --batch_questions, so every rollout is on-policy.

R1-Router's released setting is --rollout teacher_prefix with --teacher_spans all, no format reward (--w_format 0),
no KL in the loss, an entropy bonus of 1e-3, old logprobs recomputed by the trainer, one advantage on a whole step
and std-divided advantages. This repo's extensions: --teacher_spans route, --balance_kb, --w_format, --route_credit
split, --no-adv_std, the on-policy mode, the packed prompt of a group (pack_group), the dev-picked <out>/best.
Formulas sit next to their functions.
"""
import argparse
import math
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

import dataio
import engines
import reward
import rollout
import steprewards
import trainutil
import transcript
import vision
from grpo import (choice_entropy, collate, group_advantages, grpo_loss, norm, pack_group, split_credit,
                  token_advantages, token_logprobs)
from report import curves_chart

ROUTE_TOKENS, ANSWER_TOKENS = 64, 48  # generation budgets of a routing and an answer step while training
TEMPERATURE = 1.0  # rollouts sample from softmax(logits / T), and the trainer's logprobs are of that distribution
CLIP_EPS = 0.2     # PPO's ratio clip (R1-Router's, Search-R1's, verl's)
GRAD_CLIP = 1.0    # global gradient norm
KEEP = 3           # newest checkpoints kept (and <out>/best's)

#### arguments

def get_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="out/sft/final", help="policy to start from, also the KL reference (HF folder)")
    ap.add_argument("--data", default="data/mini", help="corpus.py folder: questions, KBs and indexes")
    ap.add_argument("--split", nargs="+", default=["train"], help="question splits trained on, mixed")
    ap.add_argument("--out", default="out/stepgrpo")
    ap.add_argument("--resume", nargs="?", const="yes", choices=["yes", "auto"],
                    help="continue from <out>/latest; auto: if there is one, else start (a restarted job)")
    # rollouts and rewards
    ap.add_argument("--rollout", default="teacher_prefix", choices=["teacher_prefix", "onpolicy"],
                    help="teacher_prefix: a group is n completions of one golden-prefix step (R1-Router); onpolicy: "
                         "n whole trajectories of one question (extension)")
    ap.add_argument("--teacher_spans", default="route", choices=["route", "all"],
                    help="teacher_prefix: route = the routing steps only (extension); all = answers too (R1-Router)")
    ap.add_argument("--prefixes", default="gold",
                    help="teacher_prefix: gold = each question's golden trajectory (GoldPolicy, real retrieval); or a "
                         "synth.py folder (its train.jsonl, e.g. a teacher's: synth.py --teacher): the groups start from "
                         "its trajectories, and only its questions are trained on")
    ap.add_argument("--reward", default="step", choices=["step", "outcome"], help="outcome = plain GRPO (onpolicy only)")
    ap.add_argument("--balance_kb", action=argparse.BooleanOptionalAction, default=True,
                    help="scale route advantages by the inverse frequency of the gold route (extension)")
    ap.add_argument("--w_format", type=float, default=0.2, help="reward of a step that parses (extension; 0: R1-Router)")
    ap.add_argument("--route_credit", default="split", choices=["whole", "split"],
                    help="teacher_prefix: whole = one advantage on every token of a routing step (R1-Router); split = the "
                         "KB half of the route reward on the <ret> tokens, the rest (cosine, format) on the tokens before "
                         "(extension)")
    ap.add_argument("--adv_std", action=argparse.BooleanOptionalAction, default=False,
                    help="divide group advantages by the group's std (GRPO, R1-Router); default: r - mean only (Dr. GRPO)")
    ap.add_argument("--w_hit", type=float, default=0.0,
                    help="onpolicy: reward of a search that retrieves the gold document (Agentic RAG-R1's tool reward)")
    ap.add_argument("--batch_questions", type=int, default=16, help="questions per step, over all ranks")
    ap.add_argument("-n", "--group_size", type=int, default=8, help="samples per golden-prefix step or per question")
    ap.add_argument("--max_steps", type=int, default=3, help="routing steps per trajectory (R1-Router: 3)")
    ap.add_argument("--max_pairs", type=int, default=1, help="sub-questions a routing step may hold (RAG-R1's parallel "
                    "queries; the route reward matches them to the step's gold steps)")
    ap.add_argument("--max_rets", type=int, default=1, help="retrievers a sub-question may name (R1-Router's multi-retriever mode)")
    ap.add_argument("--structure", default="transcript", choices=["transcript", "released"],
                    help="transcript: one chat grows with every step; released: each step its own single-turn chat (R1-Router's released code)")
    ap.add_argument("--topk", type=int, default=3, help="evidence documents per sub-question")
    ap.add_argument("--retriever", default="dense", help="dense | bm25 | hybrid | http://host:port of retrievers.py serve")
    ap.add_argument("--max_model_len", type=int, default=engines.MAX_LEN,
                    help="the engine's context (prompt + new tokens): a step that does not fit ends its trajectory, or "
                         "leaves its golden prefix without a group (teacher_prefix); log.jsonl's `overflow` is that share")
    ap.add_argument("--max_pixels", type=int, default=None,
                    help="VL policy: cap on a picture's pixels, in the trainer's processor and vLLM's (default: the "
                         "processor's; Qwen2.5-VL's allows 16k tokens a picture, so a visual step overflows 4k: e.g. "
                         "401408 = 512*28*28, <= 512 tokens, with --max_model_len 8192 for the 1 + max_steps x topk "
                         "pictures of a transcript); Idefics3's processor has no such cap and ignores it")
    # optimisation
    ap.add_argument("--lr", type=float, default=5e-6)
    ap.add_argument("--kl_coef", type=float, default=0.0, help="k3 KL to --model in the loss (R1-Router: 0)")
    ap.add_argument("--entropy_coef", type=float, default=0.0, help="entropy bonus in the loss (R1-Router: 1e-3)")
    ap.add_argument("--old_logprobs", default="sampler", choices=["sampler", "trainer"],
                    help="PPO's old logprobs: the engine's from sampling (cheaper), or recomputed by the trainer before "
                         "the update (R1-Router); trainer logs old_gap, the mean |sampler - trainer|")
    ap.add_argument("--micro_batch", type=int, default=2, help="rows per forward/backward")
    ap.add_argument("--train_steps", type=int, default=12)
    ap.add_argument("--save_every", type=int, default=6)
    ap.add_argument("--eval_questions", type=int, default=100,
                    help="score the first N dev questions at the start and at every checkpoint; <out>/best links the "
                         "checkpoint with the best mean of F1-Recall and routing accuracy (0: off)")
    ap.add_argument("--activation_checkpointing", action="store_true")
    ap.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"],
                    help="compute dtype (master weights, grads and optimizer stay fp32); auto: bf16 where native")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                    help="auto: CUDA when torch sees it, else the CPU; cuda: exit at once when CUDA is missing")
    ap.add_argument("--lora_r", type=int, default=0,
                    help="LoRA rank: train adapters (alpha 2r, every linear layer, no dropout) on a frozen base, which "
                         "is also the KL reference (0: all weights)")
    ap.add_argument("--quant", default="none", choices=["none", "nf4", "int8"],
                    help="QLoRA: the frozen base quantised by bitsandbytes (needs --lora_r)")
    ap.add_argument("--backend", default="vllm", choices=["vllm", "hf"],
                    help="the sampler on each rank: vllm (in-process vLLM), or hf: transformers generate on an unsharded "
                         "copy of the policy, synced like vLLM's (setup_policy); for machines without vLLM")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--wandb_mode", default=os.environ.get("WANDB_MODE", "offline"), choices=["online", "offline", "disabled"])
    return ap.parse_args(argv)

def check_args(args, world):
    """One-line errors for flag combinations that cannot work, before anything is loaded. --quant int8 sets
    --old_logprobs trainer: LLM.int8 quantises activations too, so the engine's bf16 logprobs are not the trainer's."""
    if args.quant == "int8" and args.old_logprobs != "trainer":
        args.old_logprobs = "trainer"
        if int(os.environ.get("RANK", 0)) == 0:
            print("note: --quant int8 uses --old_logprobs trainer (LLM.int8 quantises activations: the engine's bf16 "
                  "logprobs are not the trainer's)", flush=True)
    if args.rollout == "onpolicy" and args.prefixes != "gold":
        sys.exit("error: --prefixes is a teacher_prefix flag (--rollout onpolicy writes its own steps)")
    if args.rollout == "teacher_prefix" and args.reward == "outcome":
        sys.exit("error: --reward outcome needs --rollout onpolicy (a teacher_prefix group holds one step, no outcome)")
    if args.batch_questions % world:
        sys.exit(f"error: --batch_questions {args.batch_questions} must be divisible by the world size {world}")
    if args.group_size < 2:
        sys.exit(f"error: -n {args.group_size}: a group needs at least 2 samples to have a relative advantage")
    rollout.check_multi_query(args)
    if err := transcript.check_format(args.model, args):
        sys.exit(f"error: {err}")

def check_questions(questions, args):
    """One-line errors for training questions Step-GRPO cannot use."""
    where = f"--data {args.data} --split {' '.join(args.split)}"
    if len(questions) < args.batch_questions:
        sys.exit(f"error: --batch_questions {args.batch_questions} is more than the {len(questions)} questions of {where}")
    blank = [q["id"] for q in questions if any(not s.get("sub_question", "").strip() for s in q.get("steps", []))]
    if blank:  # the route reward's cosine would compare every sub-question with ""
        sys.exit(f"error: {len(blank)} questions of {where} have gold steps without a sub-question (first: {blank[0]}); "
                 "the route reward needs gold sub-questions")

#### rollouts -> training rows

def settings(args, **kw):
    return rollout.Settings(max_steps=args.max_steps, topk=args.topk, structure=args.structure, max_pairs=args.max_pairs,
                            max_rets=args.max_rets, **kw)

STATS = ("route_r", "kb_acc", "kb_entropy", "kb_mixed", "answer_r", "outcome", "format_ok", "overflow", "retrievals",
         "tokens", "reask")  # logged means

def onpolicy_batch(engine, retriever, qs, args, encode, w, seed):
    """n whole trajectories per question form a group; span j of sample i gets A_ij (group_advantages) on its tokens."""
    s = settings(args, route_tokens=ROUTE_TOKENS, answer_tokens=ANSWER_TOKENS, temperature=TEMPERATURE)
    trajs = rollout.rollout(engine, retriever, qs, n=args.group_size, s=s, seed=seed)
    rows, stats = [], {k: [] for k in STATS}
    stats["retrieve_s"] = sum(x["timings"]["retrieve"] for x in trajs)
    stats["rollout_tokens"] = sum(len(x["ids"]) for x in trajs)  # each transcript once (the engine caches its prefix)
    stats["rollout_generated"] = sum(x["n_policy_tokens"] for x in trajs)
    for g in range(len(qs)):
        group = trajs[g * args.group_size:(g + 1) * args.group_size]
        scored = [steprewards.span_rewards(x, encode, w) for x in group]
        scale = w.route_scale and {("route", t): w.route_scale[steprewards.gold_route(group[0]["gold_steps"], t)]
                                   for t in range(args.max_steps)}
        adv = group_advantages([x["spans"] for x in group], [r for r, _ in scored], [o for _, o in scored],
                               args.reward, scale, args.adv_std)
        for x, (r, o), a in zip(group, scored, adv):
            adv_tok = token_advantages(len(x["ids"]), x["spans"], a)
            rows += [dict(ids=x["ids"][c:d], mask=x["mask"][c:d], old=x["logprobs"][c:d], adv=adv_tok[c:d],
                          images=vision.images_in(x["images"], c, d))
                     for c, d in x["segments"] if any(x["mask"][c:d])]  # a row per chat (one unless released)
            stats["route_r"] += [v for sp, v in zip(x["spans"], r) if sp["kind"] == "route"]
            stats["answer_r"] += [v for sp, v in zip(x["spans"], r) if sp["kind"] == "answer"]
            stats["outcome"].append(o)
            failed_route = not x["format_ok"] and x["spans"][-1]["kind"] == "route"  # a format failure has >= 1 span
            n_routes = sum(sp["kind"] == "route" for sp in x["spans"]) - failed_route
            stats["kb_acc"] += [float(steprewards.route_kbs(x["steps"], t) == steprewards.route_kbs(x["gold_steps"], t))
                                for t in range(n_routes)]
            stats["format_ok"].append(float(x["format_ok"]))
            stats["overflow"].append(float(x["overflow"]))
            stats["retrievals"].append(len(x["steps"]))
            stats["reask"] += [float(reward.re_asks(q, [e for e in x["steps"] if e["step"] < g[0]["step"]]))
                               for g in reward.by_step(x["steps"]) for q, _ in reward.pairs_of(g)]
            stats["tokens"].append(x["n_policy_tokens"])
    return rows, stats

def teacher_prefix_batch(engine, retriever, qs, args, encode, w, seed, store=None):
    """R1-Router's groups: a question's trajectory up to each step is a prompt, the n completions of that one step a
    group, A = norm(r) within it (times the --balance_kb factor of the route it is judged against on routing steps).
    The trajectory is the golden one (rollout.GoldPolicy, real retrieval), or with --prefixes <folder> the one stored
    there for the question (`store`: qid -> trajectory, e.g. a teacher's, synth.py --teacher). r: steprewards.score_group."""
    t0 = time.perf_counter()  # the gold policy writes its steps at no cost: this is retrieval time
    s = settings(args, route_tokens=ROUTE_TOKENS, answer_tokens=ANSWER_TOKENS)
    prompts = rollout.span_prefixes([store[q["id"]] for q in qs]) if store is not None else \
        rollout.golden_prefixes(engine.tok, retriever, qs, s, vis=getattr(engine, "vis", None))[1]
    stats = {k: [] for k in STATS}
    stats["retrieve_s"] = time.perf_counter() - t0  # no "retrievals": a prefix's retrievals are the gold's, not the policy's
    stats["rollout_tokens"] = stats["rollout_generated"] = 0  # a group's prefix once (the engine caches it), its completions
    rows = []  # one packed row per group
    kinds = (("route", *rollout.route_stop(engine.tok, s)), ("answer", ["</answer>"], ANSWER_TOKENS))
    for kind, stop, max_tok in kinds[:1] if args.teacher_spans == "route" else kinds:
        todo = [t for t in prompts if (t[1]["kind"] == "route") == (kind == "route")]
        fit = [rollout.fits(engine, prefix, max_tok) for _, _, prefix, _ in todo]
        stats["overflow"] += [float(not f) for f in fit]
        todo = [t for t, f in zip(todo, fit) if f]  # a prefix with no room for the step: no group
        outs = engine.generate([prefix for _, _, prefix, _ in todo for _ in range(args.group_size)],
                               max_tok, TEMPERATURE, 1.0, stop, seed,
                               images=[images for *_, images in todo for _ in range(args.group_size)],
                               keys=[rollout.turn_key(x, sp) for x, sp, *_ in todo for _ in range(args.group_size)])
        groups = [outs[k * args.group_size:(k + 1) * args.group_size] for k in range(len(todo))]
        texts = [[engine.tok.decode(ids, skip_special_tokens=True) for ids, _ in g] for g in groups]
        for (x, sp, prefix, images), group, txt in zip(todo, groups, texts):
            rs, choices, kb_part, cls = steprewards.score_group(kind, x, sp, txt, s, encode, w, stats)
            stats["tokens"] += [len(ids) for ids, _ in group]
            generated = sum(len(ids) for ids, _ in group)
            stats["rollout_generated"] += generated
            stats["rollout_tokens"] += len(prefix) + generated
            if kind == "route":  # the decision as a distribution: how spread the group's KB choices are
                stats["kb_entropy"].append(choice_entropy(choices))
                stats["kb_mixed"].append(float(len(set(choices)) > 1))
            scale = w.route_scale.get(cls, 1.0) if w.route_scale and kind == "route" else 1.0
            if kind == "route" and args.route_credit == "split":  # [per completion: per-token advantages]
                adv = split_credit(engine.tok, group, rs, kb_part, args.adv_std, scale)
            else:
                adv = norm(rs, std=args.adv_std) * scale
            if getattr(getattr(engine, "vis", None), "mrope", False):  # 3-D positions: a row per completion, not a packed group
                rows += [dict(ids=prefix + ids, mask=[0] * len(prefix) + [1] * len(ids), old=[0.0] * len(prefix) + list(lps),
                              adv=[0.0] * len(prefix) + (a if isinstance(a, list) else [float(a)] * len(ids)), images=images)
                         for (ids, lps), a in zip(group, adv)]
            else:
                rows.append(dict(pack_group(prefix, group, adv), images=images))
    return rows, stats

#### update

@dataclass
class Micro:
    """One micro-batch (grpo.collate): ids [B, T]; attn [B, T] padding or [B, 1, T, T] tree mask; pos [B, T] or None;
    sel [B, T-1] the positions predicting a policy token; old, adv [N] over those N tokens (sampler logprob,
    advantage); pix the image inputs of a VL policy ({} else); weight 0 for a stand-in (no rows);
    lengths: the rows' tokens without padding (what the update computes usefully: bench/flops.py)."""
    ids: torch.Tensor
    attn: torch.Tensor
    pos: torch.Tensor | None
    sel: torch.Tensor
    old: torch.Tensor
    adv: torch.Tensor
    pix: dict
    weight: float
    lengths: tuple = ()

def scaled_loss(logp, old, ref_lp, m, denom, args, ent):
    """The one place the loss is scaled: (the loss to backprop, its part of the logged loss, kl, clipped). grpo_loss
    divides the micro-batch's per-token sum by denom / world (denom: micro_batches' global count): FSDP averages the
    gradients over ranks, so the update is the gradient of the global mean per policy token. The logged part is
    loss / world: summed over micro-batches and ranks (log_record) it is that global mean."""
    world = dist.get_world_size()
    loss, kl, clipped = grpo_loss(logp, old, ref_lp, m.adv, CLIP_EPS, args.kl_coef, denom / world, ent,
                                  args.entropy_coef)
    return loss, loss.detach() / world, kl, clipped

def micro_batches(rows, args, pad_id, device, vis=None):
    """The rows that carry a gradient, collated in micro-batches with their image inputs (vis: a VL policy), and the
    global loss denominator.
    Without a KL or an entropy term a row whose policy tokens all have advantage 0 (a unanimous group) has zero
    gradient: it is skipped, but `denom` still counts it, so the update is exactly the one over every row. Every rank runs the same
    number of micro-batches (FSDP all-gathers inside each forward), at least one: a rank with none left runs a copy
    of its first row with weight 0; and a VL policy's micro-batch without images a dummy picture (VisionIO.pixels
    always), since another rank's may have some and run the vision blocks.
    Returns [Micro], denom (the global count of policy tokens), the fraction of rows skipped."""
    rows = sorted(rows, key=lambda s: len(s["ids"]))  # micro-batches of similar lengths pad less; the loss is a global sum
    live = [s for s in rows if args.kl_coef > 0 or args.entropy_coef > 0
            or any(a for a, m in zip(s["adv"], s["mask"]) if m)]
    n_micro = torch.tensor([max(1, math.ceil(len(live) / args.micro_batch))], device=device)
    dist.all_reduce(n_micro, op=dist.ReduceOp.MAX)
    chunks = [live[k * args.micro_batch:(k + 1) * args.micro_batch] for k in range(int(n_micro))]
    stand_in = rows[:1] or [dict(ids=[pad_id] * 2, mask=[0, 1], old=[0.0] * 2, adv=[0.0] * 2)]  # no rows: nothing fit
    pixels = lambda m, ids: vis.pixels([s.get("images", []) for s in m], device, ids, always=True) if vis else {}
    micro = [Micro(*c, pix=pixels(m or stand_in, c[0]), weight=float(bool(m)), lengths=tuple(len(s["ids"]) for s in m))
             for m in chunks for c in [collate(m or stand_in, pad_id, device)]]
    denom = torch.tensor([sum(sum(s["mask"]) for s in rows)], dtype=torch.float64, device=device)
    dist.all_reduce(denom)
    return micro, denom.clamp(min=1).item(), 1 - len(live) / max(1, len(rows))

def update_tokens(args):
    """The most policy tokens a micro-batch can hold, the N of the loss's [N, vocabulary] logits (the memory check's):
    --micro_batch rows, each the n completions of one step (teacher_prefix, a packed group) or a whole trajectory
    (onpolicy), at the generation budgets (a multi-query routing step may write max_pairs pairs: rollout.route_stop)."""
    route = ROUTE_TOKENS * args.max_pairs
    row = args.group_size * max(route, ANSWER_TOKENS) if args.rollout == "teacher_prefix" else \
        args.max_steps * route + ANSWER_TOKENS
    return args.micro_batch * row

def add_stats(sums, weight, loss, kl, clipped, entropy):
    """sums[k] += weight x this micro-batch's loss and its per-token sums (float64 scalars on the data's device)."""
    for k, v in (("loss", loss.detach()), ("kl", kl.sum()), ("clipped", clipped.sum()), ("entropy", entropy.sum()),
                 ("tokens", torch.ones_like(kl).sum())):
        sums[k] += weight * v.double()

def update(model, ref, opt, micro, denom, args, suppress=()):
    """One pass of the PPO-clipped loss over the micro-batches, one optimizer step. ref: the frozen reference model,
    or None when --kl_coef is 0 or the policy is LoRA (trainutil.reference: adapters off). --old_logprobs trainer
    first replaces the sampler's logprobs with the trainer's own (R1-Router's released code, via EasyR1) and sums
    |sampler - trainer| into old_gap. Returns this rank's sums: loss, kl and clipped over its policy tokens, entropy,
    tokens, old_gap; grad_norm (the global norm). suppress: token ids the engines never sample (token_logprobs)."""
    device, T, sup = micro[0].ids.device, TEMPERATURE, suppress
    sums = {k: torch.zeros((), dtype=torch.float64, device=device)
            for k in ("loss", "kl", "clipped", "entropy", "tokens", "old_gap")}
    refs, olds = [], []
    with torch.no_grad():
        for m in micro:
            old = m.old
            if args.kl_coef > 0:
                with trainutil.reference(model, ref) as r:
                    refs.append(token_logprobs(r, m.ids, m.attn, m.sel, m.pos, T, pix=m.pix, suppress=sup)[0])
            else:
                refs.append(None)
            if args.old_logprobs == "trainer":
                mine = token_logprobs(model, m.ids, m.attn, m.sel, m.pos, T, pix=m.pix, suppress=sup)[0]  # [N]
                sums["old_gap"] += m.weight * (mine - old).abs().sum().double()
                old = mine
            olds.append(old)
    for m, old, ref_lp in zip(micro, olds, refs):
        logp, ent = token_logprobs(model, m.ids, m.attn, m.sel, m.pos, T, args.entropy_coef > 0, m.pix, sup)  # [N] each
        ref_lp = logp.detach() if ref_lp is None else ref_lp  # no reference: KL term 0
        loss, logged, kl, clipped = scaled_loss(logp, old, ref_lp, m, denom, args, ent)
        (loss * m.weight).backward()
        add_stats(sums, m.weight, logged, kl, clipped, ent.detach())
    grad_norm = trainutil.clip_grad_norm(model, GRAD_CLIP)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return sums, grad_norm

def train_step(model, ref, opt, engine, retriever, mine, args, encode, w, pad_id, peak, seed, store=None, check=False):
    """One step on this rank's questions `mine`: rollouts and rewards, the update, the new weights into the engine.
    Returns the rows, the rollout stats, the update's sums and grad norm, and the phases' seconds. The sync is checked
    (sync_gap, logged as sync_mean_diff and sync_max_diff) after this process's first update and where `check` says
    (main: at every checkpoint, so a saved policy is known to be the one its engine samples from)."""
    device = next(model.parameters()).device
    check = check or "sync" not in peak.gib  # gib: the phases run so far
    t = time.perf_counter()
    with peak("rollout"):
        rows, stats = onpolicy_batch(engine, retriever, mine, args, encode, w, seed) if args.rollout == "onpolicy" \
            else teacher_prefix_batch(engine, retriever, mine, args, encode, w, seed, store)
    timing = dict(rollout_s=time.perf_counter() - t, retrieve_s=stats.pop("retrieve_s"),
                  rollout_tokens=stats.pop("rollout_tokens"),  # this rank's rollout work (bench/flops.py)
                  rollout_generated=stats.pop("rollout_generated"))
    engine.sleep()  # GPU: the engine's memory goes to the update until the sync wakes it
    t = time.perf_counter()
    vis = getattr(engine, "vis", None)
    micro, denom, timing["skipped"] = micro_batches(rows, args, pad_id, device, vis)
    with peak("update"):
        sums, grad_norm = update(model, ref, opt, micro, denom, args, vis.special_ids if vis else ())
    timing["update_s"] = time.perf_counter() - t
    lengths = [n for m in micro for n in m.lengths]
    timing.update(update_rows=len(lengths), update_tokens=sum(lengths),  # this rank's work (bench/flops.py)
                  update_policy=sum(len(m.old) for m in micro if m.weight))
    t = time.perf_counter()
    with peak("sync"):
        engine.sync_weights(trainutil.policy_params(model))
    timing["sync_s"] = time.perf_counter() - t
    if check:  # the engine must now score a rollout as the trainer does
        row = rows[0] if rows else dict(ids=[pad_id] * 2)  # nothing fit: a stand-in (sync_gap is a collective)
        gap, timing["sync_max_diff"] = sync_gap(model, engine, row, device)  # the same on every rank
        timing["sync_mean_diff"] = gap
        tol = sync_tol(args, engine)
        if not gap <= tol:  # NaN fails too
            sys.exit(f"error: after the weight sync the engine's logprobs differ from the trainer's by {gap:.3g} on "
                     f"average (tolerance {tol:g}): the engine does not sample from the policy being trained")
    return rows, stats, sums, grad_norm, timing

def sync_tol(args, engine):
    """The largest mean |engine - trainer| logprob a sync may leave, by precision. fp32 trainer and engine: 1e-3, 10x
    above a correct sync's gap (< 1e-4 in the tests, 9.5e-7 in docs/LOG.md). bf16 on either side: 0.2. Rounding alone
    moves logprobs there: SmolLM2-135M in bf16, vLLM on CPU against the trainer, over 8 whole transcripts, a mean of
    0.04-0.05 nats, a max of 0.75-1.6 on tokens of logprob -10 to -30 (docs/LOG.md); so the max is no test, the mean
    is. A broken sync (a parameter missing, uninitialised or another layer's) is off by nats on average."""
    return 1e-3 if args.dtype == "fp32" and engine.dtype == "float32" else 0.2

def sync_gap(model, engine, row, device):
    """The sync check: the mean and the max |engine - trainer| logprob over every token of one rollout row (the prompt's
    image tokens included): the mean over ranks and the max over ranks."""
    ids, images, vis = row["ids"], row.get("images", []), engine.vis
    with torch.no_grad():
        x = torch.tensor([ids], device=device)
        pix = vis.pixels([images], device, x, always=True) if vis else {}
        mine = token_logprobs(model, x, torch.ones(1, len(ids), device=device),
                              torch.ones(1, len(ids) - 1, dtype=torch.bool, device=device), pix=pix)[0]  # [T-1]
    model.reshard()  # no backward follows before the next rollout: free the root's gathered weights for the engine
    diff = (torch.tensor(engine.prompt_logprobs(ids, images), device=device) - mine).abs()  # [T-1]
    mean, top = diff.mean().reshape(1), diff.max().reshape(1)
    dist.all_reduce(mean)
    dist.all_reduce(top, op=dist.ReduceOp.MAX)
    return mean.item() / dist.get_world_size(), top.item()

def log_record(step, epoch, stats, sums, grad_norm, timing, rows, args):
    """One log.jsonl record: means over all ranks of the rollout stats, the update's per-token sums and the timings."""
    local = {**sums, **{f"{k}.{part}": v for k in STATS for part, v in (("sum", sum(stats[k])), ("n", len(stats[k])))},
             **timing}
    device = sums["loss"].device
    vec = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device) for v in local.values()])
    dist.all_reduce(vec)
    tot, world = dict(zip(local, vec.tolist())), dist.get_world_size()
    n_tok = max(1.0, tot["tokens"])
    return dict(step=step, epoch=epoch, world=world,
                **{k: tot[f"{k}.sum"] / tot[f"{k}.n"] if tot[f"{k}.n"] else None for k in STATS},
                loss=tot["loss"],  # the global mean loss (scaled_loss)
                kl=tot["kl"] / n_tok if args.kl_coef > 0 else None, clip_frac=tot["clipped"] / n_tok,
                old_gap=tot["old_gap"] / n_tok if args.old_logprobs == "trainer" else None,
                entropy=tot["entropy"] / n_tok, grad_norm=grad_norm,
                adv_abs=float(np.mean([abs(a) for s in rows for a, m in zip(s["adv"], s["mask"]) if m] or [0.0])),  # rank 0's
                **{k: tot[k] / world for k in timing})

#### dev evaluation (checkpoint choice)

def dev_eval(engine, retriever, qs, args, rank, world):
    """Greedy routed trajectories of qs (each rank its share, on its own engine), scored by evaluate.py's score(): the
    numbers `evaluate.py --methods routed --split dev --n_questions N` gives for the checkpoint saved at this step.
    dev_score, which picks <out>/best, is the mean of F1-Recall and routing accuracy. Training's RNG state is put back
    afterwards, so a run trains the same with or without it."""
    import evaluate
    rng = torch.get_rng_state(), random.getstate()
    mine = rollout.rollout(engine, retriever, qs[rank::world], 1, settings(args, temperature=0.0), seed=0)
    torch.set_rng_state(rng[0])
    random.setstate(rng[1])
    parts = [None] * world
    dist.all_gather_object(parts, [{k: v for k, v in x.items() if k not in ("ids", "mask", "logprobs")} for x in mine])
    s = evaluate.score([x for p in parts for x in p])
    dev = {"dev_f1_recall": s["f1_recall"], "dev_routing_acc": s["routing_acc"], "dev_routing_macro": s["routing_macro"],
           "dev_routing_macro0": s["routing_macro0"], "dev_route_info0": s["route_info0"]}
    return dict(dev, dev_score=(dev["dev_f1_recall"] + dev["dev_routing_acc"]) / 2)

#### main

def setup_policy(args, start, weights, resuming, lora, rank, world, device, print0):
    """The sharded policy (and KL reference), its AdamW (resumed: with the step and dev history), and this rank's
    engine holding the policy's weights. --backend hf: HFEngine, an unsharded copy of the policy loaded from the weights
    folder and synced after each update from trainutil.policy_params, as vLLM's is (one gather a parameter, a strict
    copy). Not generate on the FSDP2 module itself: its forward all-gathers every layer at every decoding step, a
    collective all ranks would have to run in lockstep while their rollouts end at different times."""
    tree = args.rollout == "teacher_prefix"  # packed groups: 4D attention masks (SDPA, not flash-attn)
    model = trainutil.load_sharded(weights, device, world, args.activation_checkpointing, bf16=args.dtype == "bf16",
                                   tree_mask=tree, lora=lora)
    ref = trainutil.load_sharded(args.model, device, world, train=False, bf16=args.dtype == "bf16",
                                 tree_mask=tree) if args.kl_coef > 0 and not lora else None  # LoRA: adapters off
    params = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters alone
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0)
    step, dev_hist = 0, {}  # dev_hist: step -> dev score (--eval_questions)
    if resuming:
        state = trainutil.load_trainer_state(model, opt, start, args, print0)
        step, dev_hist = state["step"], state.get("dev", {})
    if args.backend == "hf":
        engine = engines.HFEngine(weights, seed=args.seed + rank, max_model_len=args.max_model_len,
                                  max_pixels=args.max_pixels, device=device)
    else:
        trainutil.check_gpu_budget(model, opt, engines.VLLMEngine.GPU_FRACTION, world, update_tokens(args))
        engine = engines.VLLMEngine(weights, max_model_len=args.max_model_len, max_pixels=args.max_pixels,
                                    max_images=settings(args).max_images, seed=args.seed + rank,
                                    device=device)  # each rank owns one engine
    if lora:  # the engine holds the base: give it the policy (resumed adapters; a quantised base as the trainer sees it)
        engine.sync_weights(trainutil.policy_params(model))
    return model, ref, opt, step, dev_hist, engine

def report(out, step, peaks, dev_hist, world, print0):
    print0(f"done: {step} steps; final checkpoint {out / 'final'}; learning curves {out / 'curves.png'}")
    print0("peak memory (GiB), rank " + " / ".join(map(str, range(world))) + ": " +
           ", ".join(f"{k} " + " / ".join(f"{v:.1f}" for v in vs) for k, vs in peaks.items()))
    if dev_hist:
        b = max(dev_hist, key=dev_hist.get)
        print0(f"best on dev (mean of F1-Recall and routing accuracy): step {b}, {dev_hist[b]:.1f}; {out / 'best'}")

def main(argv=None):
    args = get_args(argv)
    rank, world, device, print0 = trainutil.env_rank(args.device)
    check_args(args, world)
    lora = trainutil.lora_of(args.lora_r, args.quant)
    args.dtype = trainutil.resolve_dtype(args.dtype, device)  # the resolved choice is what trainer_state.pt records
    out = Path(args.out)
    start, weights, resuming = trainutil.resolve_start(args.model, out, args.resume, lora is not None)
    import retrievers
    try:
        questions = [q for sp in args.split for q in dataio.load_questions(args.data, sp)]
        dev_qs = dataio.load_questions(args.data, "dev")[:args.eval_questions] if args.eval_questions else []
        ret = retrievers.make_retriever(args.retriever, args.data, device)  # one device decision, env_rank's
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(weights)
        store = transcript.load_trajectories(args.prefixes, tok, print0) if args.prefixes != "gold" else None
    except dataio.DataError as e:
        sys.exit(f"error: {e}")
    if store is not None:  # a teacher's trajectories: only the questions it kept are trained on
        questions = [q for q in questions if q["id"] in store]
        print0(f"--prefixes {args.prefixes}: {len(questions)} of its {len(store)} trajectories' questions are in --split")
    check_questions(questions, args)
    own_group = trainutil.init_group(world, device=device)
    encoder = retrievers.Encoder(device=device)  # all-MiniLM-L6-v2, for the sub-question cosine
    vis = vision.VisionIO.load(weights, args.max_pixels)
    files = vis.proc if vis else tok  # saved beside the weights: a VL model's processor (with the cap), else the tokenizer
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    torch.manual_seed(args.seed)
    random.seed(args.seed)

    model, ref, opt, step, dev_hist, engine = setup_policy(args, start, weights, resuming, lora, rank, world, device,
                                                          print0)
    params = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters alone
    w = steprewards.Weights(args.w_format, args.w_hit,
                            steprewards.kb_balance(questions, args.max_steps, args.max_pairs) if args.balance_kb else None)
    if w.route_scale:
        print0("--balance_kb route advantage factors: " + ", ".join(f"{c} {v:.2f}" for c, v in sorted(w.route_scale.items())))
    per_epoch = len(questions) // args.batch_questions
    log = trainutil.Log(out, rank, step, resuming, args.wandb_mode, vars(args))
    print0(f"Step-GRPO ({args.rollout}, reward {args.reward}): world {world} ({trainutil.device_kind(device)}: {args.dtype}), "
           f"{sum(p.numel() for p in params) / 1e6:.2f}M trained weights{' (LoRA)' if lora else ''}, {len(questions)} "
           f"questions, {args.batch_questions} x {args.group_size} per step, {args.train_steps} steps")
    bar = trainutil.progress(rank, args.train_steps, step, "step-grpo")
    peak, peaks = trainutil.PeakMemory(device), {}  # peaks: phase -> the highest GiB of each rank over the run
    if dev_qs and step == 0:  # the starting policy's dev score: what the trained checkpoints have to beat
        dev = dev_eval(engine, ret, dev_qs, args, rank, world)
        log(dict(step=0, **dev))
        print0(f"dev ({len(dev_qs)} questions) at the start: F1-Recall {dev['dev_f1_recall']:.1f}, "
               f"routing acc {dev['dev_routing_acc']:.1f}")

    #### training loop
    while step < args.train_steps:
        epoch, pos = divmod(step, per_epoch)
        perm = torch.randperm(len(questions), generator=torch.Generator().manual_seed(args.seed + epoch)).tolist()
        mine = [questions[i] for i in perm[pos * args.batch_questions:(pos + 1) * args.batch_questions][rank::world]]
        step += 1
        saving = (args.save_every and step % args.save_every == 0) or step == args.train_steps
        rows, stats, sums, grad_norm, timing = train_step(model, ref, opt, engine, ret, mine, args, encoder.encode, w,
                                                          pad_id, peak, seed=args.seed + 7919 * (step - 1) + 104729 * rank,
                                                          store=store, check=saving)
        rec = log_record(step, epoch, stats, sums, grad_norm, timing, rows, args)
        rec["memory_gib"] = trainutil.gather_peaks(peak.gib, world)  # per phase since the last record, one value a rank
        if saving and dev_qs:
            t = time.perf_counter()
            rec.update(dev_eval(engine, ret, dev_qs, args, rank, world), dev_s=time.perf_counter() - t)
            dev_hist[step] = rec["dev_score"]
        log(rec)
        peaks = trainutil.highest(peaks, rec["memory_gib"])
        if bar:
            bar.update(1)
            bar.set_postfix(route=f"{rec['route_r'] or 0:.3f}", kb_acc=f"{rec['kb_acc'] or 0:.2f}",
                            fmt=f"{rec['format_ok']:.2f}", sync=f"{rec['sync_s']:.2f}s")
        if saving:
            best = max(dev_hist, key=dev_hist.get) if dev_hist else None  # the earliest of equal scores
            with peak("checkpoint"):
                trainutil.save_checkpoint(model, opt, files, out, step, dict(args=vars(args), dev=dev_hist), rank, KEEP,
                                          protect=f"step_{best}" if best else None,
                                          merged=step == args.train_steps or best == step,  # LoRA: final and best
                                          fmt=transcript.format_meta(args))
            if rank == 0 and best:
                trainutil.link_step(out, best, "best")
    peaks = trainutil.highest(peaks, trainutil.gather_peaks(peak.gib, world))  # the last checkpoint's, which no record holds
    if rank == 0:
        trainutil.link_step(out, step, "final")
        bar.close()
        log.close()
        dataio.write_atomic(out / "curves.png", curves_chart(out / "log.jsonl", "Step-GRPO learning curves"))
    report(out, step, peaks, dev_hist, world, print0)
    engine.close()  # vLLM's teardown destroys the default process group too (it shares it)
    if own_group and dist.is_initialized():
        dist.destroy_process_group()

if __name__ == "__main__":
    main()
