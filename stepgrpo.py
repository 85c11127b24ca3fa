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
    python stepgrpo.py ... --rollout onpolicy --w_rag 2.0 --judge models/Qwen2.5-72B-Instruct \
        --judge_url http://judge-host:8000/v1                    # + Agentic RAG-R1's judged RAG reward (judge.py)
    python stepgrpo.py ... --rollout branch --branch_steps 2     # groups at the policy's own states, no gold prefix
    python stepgrpo.py ... --lora_r 16 --lr 5e-5                 # LoRA (also from an SFT-LoRA run's final checkpoint)
    python stepgrpo.py ... --lora_r 16 --lr 5e-5 --quant nf4     # QLoRA: nf4 base (bitsandbytes)
    python stepgrpo.py ... --lora_r 16 --lr 5e-5 --offload       # FSDP2 CPU offload: past the GPUs' memory (docs/gpu.md)
    python stepgrpo.py --model out/sft-k2/final ...   # multi-query steps (synth.py --max_pairs 2): the checkpoint's format

PPO with a critic (critic.py; Search-R1's and RAG-R1's RL): --rollout onpolicy --adv_estimator gae, the outcome
alone (--reward outcome) or each step's reward too on its last token (Step-PPO); -n 1 will do.

The file reads as the algorithm: arguments -> rollouts to training rows (rollout.py's step loop; every step scored by
steprewards.step_reward; group advantages, or PPO's token rewards) -> the update (PPO's: GAE from the critic's values
first) -> the weight sync into this rank's engine -> main. R1-Router's released setting: teacher_prefix groups,
--teacher_spans all, no format reward or KL, an entropy bonus of 1e-3, the trainer's old logprobs, one advantage a
whole step, std-divided; this repo's extensions (docs/stepgrpo.md) are the defaults. Formulas sit by their functions.
"""
import argparse
import os
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

import branches
import critic
import dataio
import engines
import evaluate
import judge as judges
import memory
import reward
import rollout
import steprewards
import trainutil
import transcript
import vision
from grpo import (choice_entropy, group_advantages, group_rows, norm, overlong, split_credit, token_advantages,
                  token_rewards, was_cut)
from learner import TEMPERATURE, learn
from report import curves_chart

DYNAMIC_TRIES = 4  # --dynamic_sampling: rounds of questions drawn at most in one step (the first included)
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
    ap.add_argument("--rollout", default="teacher_prefix", choices=["teacher_prefix", "onpolicy", "branch"],
                    help="teacher_prefix: a group is n completions of one golden-prefix step (R1-Router); onpolicy: "
                         "n whole trajectories of one question; branch: n completions, each continued to the end, of "
                         "one step of the policy's own trajectory (extensions)")
    ap.add_argument("--branch_steps", type=int, default=2,
                    help="branch: the most steps of a trajectory that get a group (drawn when it has more)")
    ap.add_argument("--teacher_spans", default="route", choices=["route", "all"],
                    help="teacher_prefix: route = the routing steps only (extension); all = answers too (R1-Router)")
    ap.add_argument("--prefixes", default="gold",
                    help="teacher_prefix: gold = each question's golden trajectory; or a synth.py folder (e.g. a "
                         "teacher's): groups at its trajectories' prefixes, on its questions only")
    ap.add_argument("--reward", default="step", choices=["step", "outcome"], help="outcome = plain GRPO (not teacher_prefix)")
    ap.add_argument("--balance_kb", action=argparse.BooleanOptionalAction, default=True,
                    help="scale route advantages by the inverse frequency of the gold route (extension)")
    ap.add_argument("--w_format", type=float, default=0.2, help="reward of a step that parses (extension; 0: R1-Router)")
    ap.add_argument("--route_credit", default="split", choices=["whole", "split"],
                    help="teacher_prefix: whole = one advantage a routing step (R1-Router); split = the KB half of the "
                         "route reward on the <ret> tokens, the rest on the tokens before (extension)")
    ap.add_argument("--adv_std", action=argparse.BooleanOptionalAction, default=False,
                    help="divide group advantages by the group's std (GRPO, R1-Router); default: r - mean only (Dr. GRPO)")
    ap.add_argument("--dynamic_sampling", action=argparse.BooleanOptionalAction, default=False,
                    help="DAPO's: drop groups whose advantages are all 0 and draw more questions until --batch_questions "
                         "have a group that carries a gradient (at most DYNAMIC_TRIES rounds; logged: refilled)")
    ap.add_argument("--overlong", default="none", choices=["none", "mask", "penalty"],
                    help="a step the engine cut at its token budget: mask = not trained (DAPO's overlong filtering); "
                         "penalty = DAPO's soft overlong punishment on its reward (grpo.overlong)")
    ap.add_argument("--w_hit", type=float, default=0.0,
                    help="onpolicy: reward of a search that retrieves the gold document (Agentic RAG-R1's tool reward)")
    ap.add_argument("--w_rag", type=float, nargs="+", default=[0.0], metavar="W",
                    help="onpolicy, branch: the judged RAG reward on the outcome (steprewards.judge_rag): W x the "
                         "judge's relevance of the evidence to the question (Agentic RAG-R1: 2.0) [and W2 x the "
                         "answer's groundedness in it]; needs --judge")
    ap.add_argument("--judge", default=None, metavar="MODEL",
                    help="--w_rag's judge (judge.py, cached in <out>/judge-<rank>.jsonl): a model folder run "
                         "in-process beside the policy's engine, or its tokenizer with --judge_url (on a GPU, serve it)")
    ap.add_argument("--judge_url", default=None, help="--judge's OpenAI-compatible server, e.g. http://host:8000/v1")
    ap.add_argument("--batch_questions", type=int, default=16, help="questions per step, over all ranks")
    ap.add_argument("-n", "--group_size", type=int, default=8, help="samples per golden-prefix step or per question")
    ap.add_argument("--max_steps", type=int, default=3, help="routing steps per trajectory (R1-Router: 3)")
    ap.add_argument("--topk", type=int, default=3, help="evidence documents per sub-question")
    ap.add_argument("--retriever", default="dense", help="dense | bm25 | hybrid | http://host:port of retrievers.py serve")
    ap.add_argument("--max_model_len", type=int, default=engines.MAX_LEN,
                    help="the engine's context: a step that does not fit ends its trajectory or leaves its prefix "
                         "without a group (log.jsonl's `overflow`)")
    ap.add_argument("--max_pixels", type=int, default=None,
                    help="VL policy: a picture's pixel cap in the trainer's processor and vLLM's (Qwen2.5-VL: e.g. "
                         "401408, <= 512 tokens, with --max_model_len 8192; docs/visual.md)")
    # optimisation
    ap.add_argument("--lr", type=float, default=5e-6)
    ap.add_argument("--kl_coef", type=float, default=0.0, help="k3 KL to --model in the loss (R1-Router: 0)")
    ap.add_argument("--entropy_coef", type=float, default=0.0, help="entropy bonus in the loss (R1-Router: 1e-3)")
    ap.add_argument("--old_logprobs", default="sampler", choices=["sampler", "trainer"],
                    help="PPO's old logprobs: the engine's from sampling (cheaper), or recomputed by the trainer before "
                         "the update (R1-Router); trainer logs old_gap, the mean |sampler - trainer|")
    ap.add_argument("--clip_high", type=float, default=0.2,
                    help="PPO's ratio clip above 1: 1 + clip_high (below: 1 - grpo.CLIP_LOW, 0.2); DAPO's clip-higher: "
                         "0.28 (verl's clip_ratio_high)")
    ap.add_argument("--ratio", default="token", choices=["token", "sequence"],
                    help="the importance ratio: token = PPO's per token; sequence = GSPO's, the geometric mean over a step "
                         "(GSPO clips at about 3e-4 / 4e-4)")
    ap.add_argument("--tis_cap", type=float, default=0.0,
                    help="truncated importance sampling: the loss weighted by min(pi_trainer / pi_sampler, C) per token "
                         "(verl's rollout correction, e.g. 2; sets --old_logprobs trainer; 0: off)")
    ap.add_argument("--minibatches", type=int, default=1,
                    help="optimizer steps per rollout, each over a shuffled share of its rows, the policy's and the "
                         "critic's (Search-R1's PPO: 2; the ratio is against the rollout's old logprobs)")
    ap.add_argument("--micro_batch", type=int, default=2, help="rows per forward/backward")
    ap.add_argument("--train_steps", type=int, default=12)
    ap.add_argument("--save_every", type=int, default=6)
    ap.add_argument("--eval_questions", type=int, default=100,
                    help="score the first N dev questions at the start and at every checkpoint; <out>/best links the "
                         "checkpoint with the best mean of F1-Recall and routing accuracy (0: off)")
    ap.add_argument("--activation_checkpointing", action="store_true")
    ap.add_argument("--offload", action="store_true",
                    help="FSDP2 CPU offload: the trainer's shards, gradients and Adam state in host memory, each layer "
                         "on the GPU only for its compute (a model past the GPUs' memory; slower)")
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
                    help="each rank's sampler: in-process vLLM, or transformers generate on a synced copy (no vLLM)")
    # PPO (--adv_estimator gae; critic.py)
    ap.add_argument("--adv_estimator", default="grpo", choices=["grpo", "gae"],
                    help="grpo: group-relative advantages; gae: PPO, a critic's values and GAE over policy tokens "
                         "(onpolicy: with --reward step the step rewards on each step's last token, Step-PPO)")
    ap.add_argument("--critic_lr", type=float, default=1e-5, help="gae: the critic's AdamW learning rate (Search-R1's)")
    ap.add_argument("--critic_warmup", type=int, default=4,
                    help="gae: steps that train the critic alone first; the policy then starts only if the critic "
                         f"explains more than {critic.MIN_EXPLAINED_VAR} of the returns' variance (0: no warm-up, no check)")
    ap.add_argument("--kl_in_reward", type=float, default=0.0,
                    help="gae: a per-token KL penalty -beta (logp_old - logp_ref) in the reward (Search-R1: 0.001)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    # the transcript format (--structure, --max_pairs, --max_rets, --actions of synth.py and evaluate.py) is the
    # policy's own, from its checkpoint: it has no other to run in
    args.__dict__.update(transcript.trained_format(args.model))
    return args

def check_args(args, world):
    """One-line errors for flag combinations that cannot work, before anything is loaded. --quant int8 sets
    --old_logprobs trainer: LLM.int8 quantises activations too, so the engine's bf16 logprobs are not the trainer's."""
    if args.tis_cap > 0 and args.old_logprobs != "trainer":
        args.old_logprobs = "trainer"  # the weights are pi_trainer / pi_sampler: the trainer's logprobs are needed
    if args.quant == "int8" and args.old_logprobs != "trainer":
        args.old_logprobs = "trainer"
        if int(os.environ.get("RANK", 0)) == 0:
            print("note: --quant int8 uses --old_logprobs trainer (LLM.int8 quantises activations: the engine's bf16 "
                  "logprobs are not the trainer's)", flush=True)
    if args.rollout != "teacher_prefix" and args.prefixes != "gold":
        sys.exit(f"error: --prefixes is a teacher_prefix flag (--rollout {args.rollout} writes its own steps)")
    if args.rollout == "teacher_prefix" and args.reward == "outcome":
        sys.exit("error: --reward outcome needs --rollout onpolicy or branch (a teacher_prefix group holds one step, no outcome)")
    if len(args.w_rag) > 2 or min(args.w_rag) < 0 or (any(args.w_rag) and not args.judge) or \
            (args.judge_url and not args.judge):
        sys.exit(f"error: --w_rag {' '.join(map(str, args.w_rag))}: one or two weights >= 0 (relevance, groundedness), "
                 "and --judge MODEL to rate them (--judge_url needs --judge too)")
    if any(args.w_rag) and args.rollout == "teacher_prefix":
        sys.exit("error: --w_rag judges a whole trajectory's evidence and answer: it needs --rollout onpolicy or branch")
    if any(args.w_rag) and world > 1 and not args.judge_url:  # two in-process vLLM engines a rank under torchrun
        sys.exit("error: --judge in-process runs in a single process; under torchrun serve it and pass --judge_url")
    if args.branch_steps < 1:
        sys.exit(f"error: --branch_steps {args.branch_steps}: it must be at least 1")
    if args.batch_questions % world:
        sys.exit(f"error: --batch_questions {args.batch_questions} must be divisible by the world size {world}")
    if args.group_size < 1 or (args.group_size < 2 and args.adv_estimator == "grpo"):
        sys.exit(f"error: -n {args.group_size}: a group needs at least 2 samples to have a relative advantage "
                 "(--adv_estimator gae: 1 is enough)")
    if not (args.clip_high >= 0 and args.tis_cap >= 0 and args.minibatches >= 1):
        sys.exit(f"error: --clip_high {args.clip_high} --tis_cap {args.tis_cap} --minibatches {args.minibatches}: "
                 "clip_high >= 0, tis_cap >= 0, minibatches >= 1")
    if args.adv_estimator == "gae":
        check_ppo(args)
    elif args.kl_in_reward:
        sys.exit("error: --kl_in_reward is PPO's (--adv_estimator gae); group advantages take --kl_coef")
    rollout.check_multi_query(args.max_pairs, args.max_rets, args.structure, args.actions)
    if err := transcript.check_format(args.model, args):
        sys.exit(f"error: {err}")

def check_ppo(args):
    """One-line errors for PPO's flags. A --structure released trajectory is several single-turn chats, each valued
    by the critic without the chats before it: PPO refuses it rather than run GAE across states it cannot see."""
    if args.rollout != "onpolicy":
        sys.exit("error: --adv_estimator gae needs --rollout onpolicy: PPO's returns run over whole trajectories")
    if args.structure != "transcript":
        sys.exit(f"error: --adv_estimator gae needs a --structure transcript policy ({args.model}'s is released): a "
                 "released trajectory's chats are valued apart, so GAE cannot run across them")
    if args.actions:
        sys.exit(f"error: --adv_estimator gae needs one chat a trajectory ({args.model} was trained with actions, which "
                 "restart the chat): GAE cannot run across chats valued apart")
    if args.dynamic_sampling:
        sys.exit("error: --dynamic_sampling drops groups whose advantages are all 0: PPO (--adv_estimator gae) has no groups")
    if args.critic_warmup < 0 or args.kl_in_reward < 0:
        sys.exit(f"error: --critic_warmup {args.critic_warmup} --kl_in_reward {args.kl_in_reward}: a warm-up >= 0, "
                 "a penalty >= 0")

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
                            max_rets=args.max_rets, actions=args.actions, **kw)

STATS = ("route_r", "kb_acc", "kb_entropy", "kb_mixed", "answer_r", "outcome", "format_ok", "overflow", "retrievals",
         "tokens", "reask", "cut", "refilled", "informative", "rag", "actions")  # logged means

def onpolicy_batch(engine, retriever, qs, args, encode, w, seed):
    """n whole trajectories per question form a group; span j of sample i gets A_ij (group_advantages) on its tokens.
    --adv_estimator gae: each row gets its token rewards instead (grpo.token_rewards; the critic's GAE gives the
    advantages in the update)."""
    s = settings(args, temperature=TEMPERATURE)
    trajs = rollout.rollout(engine, retriever, qs, n=args.group_size, s=s, seed=seed)
    rows, stats = [], {k: [] for k in STATS}
    stats["retrieve_s"] = sum(x["timings"]["retrieve"] for x in trajs)
    stats["rollout_tokens"] = sum(len(x["ids"]) for x in trajs)  # each transcript once (the engine caches its prefix)
    stats["rollout_generated"] = sum(x["n_policy_tokens"] for x in trajs)
    if w.judge:
        steprewards.judge_rag(w, trajs, stats)
    for g in range(len(qs)):
        group = trajs[g * args.group_size:(g + 1) * args.group_size]
        scored = [overlong_spans(engine.tok, x, *steprewards.span_rewards(x, encode, w), args, stats) for x in group]
        scale = w.route_scale and {("route", t): w.route_scale[steprewards.gold_route(group[0]["gold_steps"], t)]
                                   for t in range(args.max_steps)}
        ppo = args.adv_estimator == "gae"
        adv = [[0.0] * len(x["spans"]) for x in group] if ppo else group_advantages(
            [x["spans"] for x in group], [r for r, _ in scored], [o for _, o in scored], args.reward, scale, args.adv_std)
        for x, (r, o), a in zip(group, scored, adv):
            adv_tok = token_advantages(len(x["ids"]), x["spans"], a)
            tok_r = token_rewards(len(x["ids"]), x["spans"], r, o, args.reward) if ppo else None
            rows += [dict(ids=x["ids"][c:d], mask=x["mask"][c:d], old=x["logprobs"][c:d], adv=adv_tok[c:d],
                          images=vision.images_in(x["images"], c, d), group=(qs[g]["id"], g),
                          **({"reward": tok_r[c:d]} if ppo else {}))
                     for c, d in x["segments"] if any(x["mask"][c:d])]  # a row per chat (one unless released)
            steprewards.log_trajectory(stats, x, r, o)
    return rows, stats

def overlong_spans(tok, x, r, o, args, stats):
    """--overlong on on-policy trajectory x with span rewards r and outcome o (grpo.overlong): a span the engine cut at
    its budget leaves the mask, or its reward (the outcome's with --reward outcome) gets the soft penalty. Returns r, o."""
    r = list(r)
    for j, sp in enumerate(x["spans"]):
        (add,), (keep,) = overlong_group(tok, [(x["ids"][sp["start"]:sp["end"]], None)], *step_budget(tok, args, sp["kind"]),
                                         args.overlong, stats)
        if args.reward == "outcome":
            o += add
        else:
            r[j] += add
        if not keep:
            x["mask"][sp["start"]:sp["end"]] = [0] * (sp["end"] - sp["start"])
    return r, o

def step_budget(tok, args, kind):
    """(new tokens, stop strings) of a step of `kind` while training (a route's: rollout.route_stop), the budgets
    evaluation gives it (rollout.Settings), so a step is judged as it will be scored. An action is written where a
    route is, under a route's budget."""
    s = settings(args)
    if kind in ("route", *reward.ACTIONS):
        stop, n = rollout.route_stop(tok, s)
        return n, stop
    return s.answer_tokens, ["</answer>"]

def overlong_group(tok, group, budget, stop, mode, stats):
    """--overlong on completions [(ids, logprobs)] of one step (grpo.overlong): each one's reward added and whether it
    is trained; stats["cut"] gets whether the engine cut each at the budget."""
    cut = [was_cut(tok, ids, budget, stop) for ids, _ in group]
    stats["cut"] += [float(c) for c in cut]
    shaped = [overlong(len(ids), budget, c, mode) for (ids, _), c in zip(group, cut)]
    return [a for a, _ in shaped], [k for _, k in shaped]

def teacher_prefix_batch(engine, retriever, qs, args, encode, w, seed, store=None):
    """R1-Router's groups: a question's trajectory up to each step is a prompt, the n completions of that one step a
    group, A = norm(r) within it (times the --balance_kb factor of the route it is judged against on routing steps).
    The trajectory is the golden one (rollout.GoldPolicy, real retrieval), or with --prefixes <folder> the one stored
    there for the question (`store`: qid -> trajectory, e.g. a teacher's, synth.py --teacher). r: steprewards.score_group."""
    t0 = time.perf_counter()  # the gold policy writes its steps at no cost: this is retrieval time
    s = settings(args)
    prompts = rollout.span_prefixes([store[q["id"]] for q in qs]) if store is not None else \
        rollout.golden_prefixes(engine.tok, retriever, qs, s, vis=getattr(engine, "vis", None))[1]
    stats = {k: [] for k in STATS}
    stats["retrieve_s"] = time.perf_counter() - t0  # no "retrievals": a prefix's retrievals are the gold's, not the policy's
    stats["rollout_tokens"] = stats["rollout_generated"] = 0  # a group's prefix once (the engine caches it), its completions
    rows = []  # one packed row per group
    kinds = (("route", *rollout.route_stop(engine.tok, s)), ("answer", ["</answer>"], s.answer_tokens))
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
            adds, keep = overlong_group(engine.tok, group, max_tok, stop, args.overlong, stats)
            rs = [r + add for r, add in zip(rs, adds)]
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
            rows += [dict(r, group=(x["qid"], len(rows)))
                     for r in group_rows(prefix, group, adv, images, getattr(getattr(engine, "vis", None), "mrope", False), keep)]
    return rows, stats

def branch_batch(engine, retriever, qs, args, encode, w, seed):
    """Groups at the policy's own states (no gold prefix): one trajectory a question, then at up to --branch_steps of
    its spans (branches.branch_points) the n completions of that step from its prefix, each continued to the end by
    the policy (branches.branch); A = norm(r) within a group, r = steprewards.branch_reward (times the --balance_kb
    factor of the gold route on routing steps), on the branched step's tokens alone (prefix, continuation: context)."""
    s, n = settings(args, temperature=TEMPERATURE), args.group_size
    ret = branches.Memo(retriever)  # a replayed step's search returns what the trajectory's did
    trajs = rollout.rollout(engine, ret, qs, n=1, s=s, seed=seed)
    ys = branches.branch(engine, ret, qs, trajs, branches.branch_points(trajs, args.branch_steps, seed), n, s, seed + 1)
    stats = {k: [] for k in STATS}
    stats.update(retrieve_s=sum(x["timings"]["retrieve"] for x in trajs + ys),  # a branch's tokens from its span on
                 rollout_tokens=sum(len(x["ids"]) for x in trajs) + sum(y["new_tokens"] for y in ys),
                 rollout_generated=sum(x["n_policy_tokens"] for x in trajs) + sum(y["generated"] for y in ys))
    if w.judge:
        steprewards.judge_rag(w, ys, stats)  # each branch's outcome
    rows, mrope = [], getattr(getattr(engine, "vis", None), "mrope", False)
    for group in (ys[k:k + n] for k in range(0, len(ys), n)):
        rs, cls = steprewards.score_branches(group, encode, w, args.reward, stats)
        scale = w.route_scale.get(cls, 1.0) if w.route_scale and cls else 1.0
        prefix, images, completions = branches.branch_group(group)
        kind = group[0]["spans"][group[0]["branch"]]["kind"]
        adds, keep = overlong_group(engine.tok, completions, *step_budget(engine.tok, args, kind), args.overlong, stats)
        rs = [r + add for r, add in zip(rs, adds)]
        rows += [dict(r, group=(group[0]["qid"], len(rows)))
                 for r in group_rows(prefix, completions, norm(rs, std=args.adv_std) * scale, images, mrope, keep)]
    return rows, stats

def rollout_rows(engine, retriever, mine, args, encode, w, seed, store, pool):
    """This rank's training rows and rollout stats from its questions `mine`. --dynamic_sampling (DAPO): only the
    groups whose advantages are not all 0, and while fewer than len(mine) questions have one, as many questions again
    drawn from `pool` (seeded by the step's seed: an exact resume), at most DYNAMIC_TRIES rounds; the first len(mine)
    questions with a gradient are trained. Logged: refilled, the share of them drawn after the first round, and
    informative, their number over len(mine)."""
    def batch(qs, sd):
        if args.rollout == "onpolicy":
            return onpolicy_batch(engine, retriever, qs, args, encode, w, sd)
        if args.rollout == "branch":
            return branch_batch(engine, retriever, qs, args, encode, w, sd)
        return teacher_prefix_batch(engine, retriever, qs, args, encode, w, sd, store)
    rows, stats = batch(mine, seed)
    if not args.dynamic_sampling:
        return rows, stats
    kept, done = [], []  # done: (round, question id) of the questions trained
    for rnd in range(DYNAMIC_TRIES):
        if rnd:
            extra = random.Random(seed + rnd).sample(pool, len(mine))
            rows, more = batch(extra, seed + 15485863 * rnd)
            for k, v in more.items():
                stats[k] += v
        groups = {}
        for r in rows:
            groups.setdefault(r["group"], []).append(r)
        for (qid, _), g in groups.items():
            if (rnd, qid) in done or len(done) < len(mine):
                if any(a for r in g for a, m in zip(r["adv"], r["mask"]) if m):
                    done += [] if (rnd, qid) in done else [(rnd, qid)]
                    kept += g
        if len(done) >= len(mine):
            break
    stats["refilled"].append(sum(r > 0 for r, _ in done) / max(1, len(done)))
    stats["informative"].append(len(done) / len(mine))
    return kept, stats

#### update

def update_tokens(args):
    """The most policy tokens a micro-batch can hold, the N of the loss's [N, vocabulary] logits (the memory check's):
    --micro_batch rows, each the n completions of one step (teacher_prefix and branch, a packed group) or a whole
    trajectory (onpolicy), at the generation budgets (a multi-query routing step may write max_pairs pairs:
    rollout.route_stop)."""
    s = settings(args)
    route = s.route_tokens * args.max_pairs
    row = args.group_size * max(route, s.answer_tokens) if args.rollout != "onpolicy" else \
        args.max_steps * route + s.answer_tokens
    return args.micro_batch * row

def train_step(model, ref, opt, engine, retriever, mine, args, encode, w, pad_id, peak, seed, store=None, check=False,
               crit=None, warmup=False, pool=()):
    """One step on this rank's questions `mine`: rollouts and rewards (rollout_rows; pool: the questions
    --dynamic_sampling draws from), the update (learn), the new weights into the engine. Returns the rows, the
    rollout stats, the update's sums and grad norm, and the phases' seconds. The sync is checked
    (trainutil.sync_gap, logged as sync_mean_diff and sync_max_diff) after this process's first update and where `check` says
    (main: at every checkpoint, so a saved policy is known to be the one its engine samples from). crit: PPO's
    (critic, its optimizer): GAE's advantages, then the critic's update (its numbers in sums["critic"]); warmup: the
    critic alone learns (--critic_warmup)."""
    device = trainutil.compute_device(model)
    check = check or "sync" not in peak.gib  # gib: the phases run so far
    t = time.perf_counter()
    with peak("rollout"):
        rows, stats = rollout_rows(engine, retriever, mine, args, encode, w, seed, store, pool)
    timing = dict(rollout_s=time.perf_counter() - t, retrieve_s=stats.pop("retrieve_s"),
                  rollout_tokens=stats.pop("rollout_tokens"),  # this rank's rollout work (bench/flops.py)
                  rollout_generated=stats.pop("rollout_generated"))
    engine.sleep()  # GPU: the engine's memory goes to the update until the sync wakes it
    micro, sums, grad_norm = learn(model, ref, opt, crit, rows, args, pad_id, device, getattr(engine, "vis", None),
                                   seed, warmup, peak, timing)
    lengths = [n for m in micro for n in m.lengths]
    timing.update(update_rows=len(lengths), update_tokens=sum(lengths),  # this rank's work (bench/flops.py)
                  update_policy=sum(len(m.old) for m in micro if m.weight))
    t = time.perf_counter()
    with peak("sync"):
        engine.sync_weights(trainutil.policy_params(model))
    timing["sync_s"] = time.perf_counter() - t
    if check:  # the engine must now score a rollout as the trainer does
        row = rows[0] if rows else dict(ids=[pad_id] * 2)  # nothing fit: a stand-in (sync_gap is a collective)
        gap, timing["sync_max_diff"] = trainutil.sync_gap(model, engine, row, device)  # the same on every rank
        timing["sync_mean_diff"] = gap
        tol = trainutil.sync_tol(args.dtype, engine)
        if not gap <= tol:  # NaN fails too
            sys.exit(f"error: after the weight sync the engine's logprobs differ from the trainer's by {gap:.3g} on "
                     f"average (tolerance {tol:g}): the engine does not sample from the policy being trained")
    return rows, stats, sums, grad_norm, timing

def log_record(step, epoch, stats, sums, grad_norm, timing, rows, args):
    """One log.jsonl record: means over all ranks of the rollout stats, the update's per-token sums and the timings."""
    sums = dict(sums)
    ppo = critic.record(sums.pop("critic")) if "critic" in sums else {}  # value_loss, vf_clipfrac, explained_var
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
                kl=tot["kl"] / n_tok if args.kl_coef > 0 else None,
                clip_frac=(tot["clip_low"] + tot["clip_high"]) / n_tok,  # verl's pg_clipfrac: where the clip acted
                clip_low_frac=tot["clip_low"] / n_tok, clip_high_frac=tot["clip_high"] / n_tok,
                tis_weight=tot["tis"] / n_tok if args.tis_cap else None,  # the IS weights' mean, and the share capped
                tis_capped=tot["tis_capped"] / n_tok if args.tis_cap else None,
                old_gap=tot["old_gap"] / n_tok if args.old_logprobs == "trainer" else None,
                entropy=tot["entropy"] / n_tok, grad_norm=grad_norm,
                adv_abs=float(np.mean([abs(a) for s in rows for a, m in zip(s["adv"], s["mask"]) if m] or [0.0])),  # rank 0's
                **ppo, **{k: tot[k] / world for k in timing})

#### main

def setup_policy(args, start, weights, resuming, lora, rank, world, device, print0):
    """The sharded policy (and KL reference), its AdamW, PPO's critic and its AdamW (--adv_estimator gae; else None;
    resumed: with the step and dev history), and this rank's engine holding the policy's weights. --backend hf: HFEngine, an unsharded copy of the policy loaded from the weights
    folder and synced after each update from trainutil.policy_params, as vLLM's is (one gather a parameter, a strict
    copy). Not generate on the FSDP2 module itself: its forward all-gathers every layer at every decoding step, a
    collective all ranks would have to run in lockstep while their rollouts end at different times."""
    tree = args.rollout != "onpolicy"  # packed groups (teacher_prefix, branch): 4D attention masks (SDPA, not flash-attn)
    model = trainutil.load_sharded(weights, device, world, args.activation_checkpointing, bf16=args.dtype == "bf16",
                                   tree_mask=tree, lora=lora, offload=args.offload)
    ref = trainutil.load_sharded(args.model, device, world, train=False, bf16=args.dtype == "bf16",
                                 tree_mask=tree, offload=args.offload) if (args.kl_coef > 0 or args.kl_in_reward > 0) and not lora else None  # LoRA: adapters off
    params = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters alone
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0)
    crit = critic.load(args, device, world, lora) if args.adv_estimator == "gae" else None
    step, dev_hist = 0, {}  # dev_hist: step -> dev score (--eval_questions)
    if resuming:
        state = trainutil.load_trainer_state(model, opt, start, args, print0, crit)
        step, dev_hist = state["step"], state.get("dev", {})
    if args.backend == "hf":
        engine = engines.HFEngine(weights, seed=args.seed + rank, max_model_len=args.max_model_len,
                                  max_pixels=args.max_pixels, device=device)
    else:
        share = engines.VLLMEngine.OFFLOAD_FRACTION if args.offload else engines.VLLMEngine.GPU_FRACTION
        memory.check_gpu_budget(model, opt, share, world, update_tokens(args), crit)
        engine = engines.VLLMEngine(weights, max_model_len=args.max_model_len, max_pixels=args.max_pixels,
                                    max_images=settings(args).max_images, seed=args.seed + rank, device=device,
                                    gpu_memory_utilization=share)  # each rank owns one engine
    if lora:  # the engine holds the base: give it the policy (resumed adapters; a quantised base as the trainer sees it)
        engine.sync_weights(trainutil.policy_params(model))
    return model, ref, opt, crit, step, dev_hist, engine

def report(out, step, peaks, dev_hist, world, print0):
    print0(f"done: {step} steps; final checkpoint {out / 'final'}; learning curves {out / 'curves.png'}")
    print0("peak memory (GiB), rank " + " / ".join(map(str, range(world))) + ": " +
           ", ".join(f"{k} " + " / ".join(f"{v:.1f}" for v in vs) for k, vs in peaks.items()))
    if dev_hist:
        b = max(dev_hist, key=dev_hist.get)
        print0(f"best on dev (mean of F1-Recall and routing accuracy): step {b}, {dev_hist[b]:.1f}; {out / 'best'}")

def main(argv=None, close=True):
    """close: shut the engine and the process group down at the end, for a caller in the same process (the command
    line leaves through engines.exit_now instead: vLLM's shutdown collects the whole heap, ~1 s a rank)."""
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
    try:  # a server is asked now; a cache file with a bad line stops here
        judge = judges.Judge.load(args.judge, args.judge_url, cache=out / f"judge-{rank}.jsonl", seed=args.seed,
                                  max_model_len=args.max_model_len) if any(args.w_rag) else None
    except dataio.DataError as e:
        sys.exit(f"error: {e}")
    encoder = retrievers.Encoder(device=device)  # all-MiniLM-L6-v2, for the sub-question cosine
    vis = vision.VisionIO.load(weights, args.max_pixels)
    files = vis.proc if vis else tok  # saved beside the weights: a VL model's processor (with the cap), else the tokenizer
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    torch.manual_seed(args.seed)
    random.seed(args.seed)

    model, ref, opt, crit, step, dev_hist, engine = setup_policy(args, start, weights, resuming, lora, rank, world,
                                                                device, print0)
    params = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters alone
    w = steprewards.Weights.of(args, questions, judge)
    if w.route_scale:
        print0("--balance_kb route advantage factors: " + ", ".join(f"{c} {v:.2f}" for c, v in sorted(w.route_scale.items())))
    per_epoch = len(questions) // args.batch_questions
    log = trainutil.Log(out, rank, step, resuming, vars(args))
    critic.check_resumed(out, step, args)  # a resume past the warm-up meets its gate again
    print0(f"Step-GRPO ({args.rollout}, reward {args.reward}): world {world} ({trainutil.device_kind(device)}: {args.dtype}), "
           f"{sum(p.numel() for p in params) / 1e6:.2f}M trained weights{' (LoRA)' if lora else ''}, {len(questions)} "
           f"questions, {args.batch_questions} x {args.group_size} per step, {args.train_steps} steps")
    bar = trainutil.progress(rank, args.train_steps, step, "step-grpo")
    peak, peaks = memory.PeakMemory(device), {}  # peaks: phase -> the highest GiB of each rank over the run
    if dev_qs and step == 0:  # the starting policy's dev score: what the trained checkpoints have to beat
        dev = evaluate.dev_scores(engine, ret, dev_qs, settings(args, temperature=0.0), rank, world)
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
                                                          store=store, check=saving, crit=crit, pool=questions,
                                                          warmup=crit is not None and step <= args.critic_warmup)
        rec = log_record(step, epoch, stats, sums, grad_norm, timing, rows, args)
        rec["memory_gib"] = memory.gather_peaks(peak.gib, world)  # per phase since the last record, one value a rank
        if saving and dev_qs:
            t = time.perf_counter()
            rec.update(evaluate.dev_scores(engine, ret, dev_qs, settings(args, temperature=0.0), rank, world), dev_s=time.perf_counter() - t)
            dev_hist[step] = rec["dev_score"]
        log(rec)
        peaks = memory.highest(peaks, rec["memory_gib"])
        if bar:
            bar.update(1)
            bar.set_postfix(route=f"{rec['route_r'] or 0:.3f}", kb_acc=f"{rec['kb_acc'] or 0:.2f}",
                            fmt=f"{rec['format_ok']:.2f}", sync=f"{rec['sync_s']:.2f}s")
        if saving:
            best = max(dev_hist, key=dev_hist.get) if dev_hist else None  # the earliest of equal scores
            with peak("checkpoint"):
                trainutil.save_checkpoint(model, opt, files, out, step, dict(args=vars(args), dev=dev_hist), rank, KEEP,
                                          protect=f"step_{best}" if best else None, crit=crit,
                                          merged=step == args.train_steps or best == step,  # LoRA: final and best
                                          fmt=transcript.format_meta(args))
            if rank == 0 and best:
                trainutil.link_step(out, best, "best")
        critic.check_warmup(rec, step, args)  # after the checkpoint: the warmed-up critic is kept
    peaks = memory.highest(peaks, memory.gather_peaks(peak.gib, world))  # the last checkpoint's, which no record holds
    if rank == 0:
        trainutil.link_step(out, step, "final")
        bar.close()
        log.close()
        dataio.write_atomic(out / "curves.png", curves_chart(out / "log.jsonl", "Step-GRPO learning curves"))
    report(out, step, peaks, dev_hist, world, print0)
    if close:
        engine.close()  # vLLM's teardown destroys the default process group too (it shares it)
        if own_group and dist.is_initialized():
            dist.destroy_process_group()

if __name__ == "__main__":
    main(close=False)
    engines.exit_now()
