"""sft.py: the masked loss by hand, one SGD step by hand, 2-rank FSDP2 (torchrun, gloo) equal to one process, exact
resume, the saved checkpoint (transformers, tied embeddings, equal to the trainer's model), bad-input errors.

Policy: a tiny random Llama (tied embeddings) with the tests' tokenizer (SmolLM2's, cut to 4,096 ids). Data: real
golden trajectories, rollout.py's GoldPolicy through the real step loop and BM25 retrieval on the tiny world.
Single-process runs call sft.main() in this process (one torch thread: on this shared 2-core machine two OMP threads
were up to 7x slower); the 2-rank runs share one torchrun launch (tests/one_launch.py); sft.py's command line runs
in the continuation and error cases."""
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from one_launch import launch
from conftest import vllm_prompt_logprobs

import dataio
import memory
import retrievers
import rollout
import sft
import trainutil

ROOT = Path(__file__).resolve().parents[1]
# fp32: the by-hand and 1-vs-2-rank comparisons are tight; test_bf16_step and the resume test run bf16
FAST = ["--max_len", "512", "--batch_size", "2", "--warmup_steps", "0", "--dtype", "fp32"]

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

@pytest.fixture(scope="module")
def tiny_model(tiny_model_dir):
    return tiny_model_dir

def load(model_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

def read_log(out):
    return [json.loads(line) for line in open(Path(out) / "log.jsonl")]

def max_diff(a_dir, b_dir):
    a, b = load_file(Path(a_dir) / "model.safetensors"), load_file(Path(b_dir) / "model.safetensors")
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)

def hand_nll(model, ids, mask):
    """Sum over t >= 1 with mask[t] == 1 of -log p(ids[t] | ids[:t]): the one-row, no-padding, full-logits way."""
    lp = model(input_ids=torch.tensor([ids])).logits[0].float().log_softmax(-1)  # [T, V]
    pos = torch.tensor([t for t in range(1, len(ids)) if mask[t]])  # [n] target positions
    return -lp[pos - 1, torch.tensor(ids)[pos]].sum(), len(pos)

#### the loss

def test_loss_is_cross_entropy_on_exactly_the_policy_tokens(tiny_model, traj_dir):
    model = load(tiny_model).eval()
    rows = [(r["ids"], r["mask"]) for r in dataio.read_jsonl(traj_dir / "train.jsonl")[:3]]
    assert len({len(ids) for ids, _ in rows}) == 3  # unequal lengths: the batch really is padded
    with torch.no_grad():
        s, n = sft.loss_sum(model, *sft.collate(rows, 2, "cpu"))
        hand = [hand_nll(model, ids, mask) for ids, mask in rows]
        assert n.item() == sum(k for _, k in hand) == sum(sum(m[1:]) for _, m in rows)
        assert s.item() == pytest.approx(sum(h.item() for h, _ in hand), rel=1e-5)
        # the transcript ends with template tokens (mask 0): what they are does not matter, they are never targets...
        ids, mask = rows[0]
        assert mask[-1] == 0
        other = ids[:-1] + [(ids[-1] + 1) % 1000]
        s2, n2 = sft.loss_sum(model, *sft.collate([(other, mask)], 2, "cpu"))
        s1, _ = sft.loss_sum(model, *sft.collate([(ids, mask)], 2, "cpu"))
        assert s2.item() == pytest.approx(s1.item(), rel=1e-6) and n2.item() == hand[0][1]
        # ...until the mask makes that position a target: then the label counts, and which token it is matters
        s3, n3 = sft.loss_sum(model, *sft.collate([(ids, mask[:-1] + [1])], 2, "cpu"))
        s4, _ = sft.loss_sum(model, *sft.collate([(other, mask[:-1] + [1])], 2, "cpu"))
        assert n3.item() == n2.item() + 1 and s3.item() > s1.item() and abs(s4.item() - s3.item()) > 1e-3

#### one step by hand, and 2 ranks equal to 1 process

SGD = ["--optim", "sgd", "--lr", "0.5", "--grad_clip", "1.0", "--train_steps", "2", "--save_every", "1", "--eval_every", "2"]

@pytest.fixture(scope="module")
def single_run(tiny_model, traj_dir, tmp_path_factory):
    """One process, plain SGD, 2 steps of a global batch of 8 = 2 rows x 4 micro-batches; checkpoints at steps 1, 2."""
    out = tmp_path_factory.mktemp("sft") / "single"
    sft.main(["--model", str(tiny_model), "--data", str(traj_dir), "--out", str(out), "--grad_accum", "4", *FAST, *SGD])
    return out

@pytest.mark.slow
def test_first_step_is_sgd_on_the_global_token_mean(single_run, tiny_model, traj_dir):
    """Step 1 by hand: the global batch is the first 8 rows of the seed-0 permutation; the loss is the NLL summed over
    all their policy tokens / their number (not a mean of per-micro-batch means); the update is -lr * clipped grad."""
    rows = sft.load_rows(traj_dir / "train.jsonl", 512, 10**9)
    batch = [rows[i] for i in torch.randperm(len(rows), generator=torch.Generator().manual_seed(0)).tolist()[:8]]
    model = load(tiny_model)
    terms = [hand_nll(model, ids, mask) for ids, mask, _ in batch]
    loss = sum(t for t, _ in terms) / sum(k for _, k in terms)
    loss.backward()
    params = dict(model.named_parameters())  # tied: lm_head.weight is embed_tokens.weight, listed once
    norm = torch.sqrt(sum(p.grad.double().pow(2).sum() for p in params.values())).item()
    log = read_log(single_run)
    assert log[0]["loss"] == pytest.approx(loss.item(), rel=1e-6)
    assert log[0]["grad_norm"] == pytest.approx(norm, rel=1e-5) and norm > 1.0  # so clipping is active
    trained = load_file(single_run / "step_1" / "model.safetensors")
    with torch.no_grad():
        for k, w in trained.items():
            expect = params[k] - 0.5 * params[k].grad * (1.0 / (norm + 1e-6))
            assert torch.allclose(w, expect, atol=1e-6, rtol=0), k
    assert max_diff(single_run / "step_1", tiny_model) > 1e-2  # the step really moved the weights

@pytest.mark.slow
def test_bf16_step_is_close_to_fp32(single_run, tiny_model, traj_dir, tmp_path):
    """--dtype bf16: the same first step with bf16 compute. Loss and update are close to the fp32 run's
    but not equal to it, so the bf16 path really ran; the checkpoint stays fp32 (master weights)."""
    out = tmp_path / "bf16"
    sft.main(["--model", str(tiny_model), "--data", str(traj_dir), "--out", str(out), "--grad_accum", "4", *FAST, *SGD,
              "--train_steps", "1", "--dtype", "bf16"])
    a, b = read_log(single_run)[0], read_log(out)[0]
    assert b["loss"] == pytest.approx(a["loss"], rel=1e-2) and b["loss"] != a["loss"]
    assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=5e-2)
    w = load_file(out / "step_1" / "model.safetensors")
    assert all(t.dtype == torch.float32 for t in w.values())
    assert max_diff(out / "step_1", single_run / "step_1") < 0.1 * max_diff(single_run / "step_1", tiny_model)

def test_lr_schedule_by_hand():
    """Warm-up, cosine to lr * min_lr_ratio at the last step; with --decay_steps D the cosine ends at step D - 1 and
    the LR stays there: a 36-step run resumed at a constant lr * min_lr_ratio is one run of --decay_steps 36."""
    schedule = lambda args: sft.Schedule(args.lr, args.warmup_steps, args.min_lr_ratio, args.decay_steps)
    a = schedule(sft.get_args(["--lr", "2e-4", "--warmup_steps", "2", "--min_lr_ratio", "0.1"]))
    assert [sft.lr_at(k, a, 36) for k in (0, 1)] == pytest.approx([2e-4 / 3, 2 * 2e-4 / 3])
    assert sft.lr_at(2, a, 36) == pytest.approx(2e-4) and sft.lr_at(35, a, 36) == pytest.approx(2e-5)
    mid = 2 + 33 / 2  # progress 1/2: the LR halfway between lr and lr * min_lr_ratio
    assert sft.lr_at(mid, a, 36) == pytest.approx(2e-5 + 1.8e-4 * 0.5 * (1 + math.cos(math.pi / 2)))
    d = schedule(sft.get_args(["--lr", "2e-4", "--warmup_steps", "2", "--min_lr_ratio", "0.1", "--decay_steps", "36"]))
    assert [sft.lr_at(k, d, 216) for k in range(36)] == [sft.lr_at(k, a, 36) for k in range(36)]
    assert [sft.lr_at(k, d, 216) for k in (36, 100, 215)] == pytest.approx([2e-5] * 3)

def test_dtype_auto_takes_bf16_only_where_native():
    """--dtype auto: bf16 on CUDA and on AVX512-BF16 CPUs (emulated bf16 was 25x slower than fp32 on an AVX2 EPYC);
    an explicit choice is kept."""
    assert trainutil.resolve_dtype("auto", torch.device("cuda", 0)) == "bf16"
    native = torch.cpu._is_avx512_bf16_supported()
    assert trainutil.resolve_dtype("auto", torch.device("cpu")) == ("bf16" if native else "fp32")
    assert [trainutil.resolve_dtype(d, torch.device("cpu")) for d in ("bf16", "fp32")] == ["bf16", "fp32"]

def test_rank0_load_fills_every_shard_and_keeps_the_head_tied(tiny_model):
    """load_sharded builds the model on the meta device and fills it from rank 0's copy of the checkpoint: every
    parameter and the RoPE buffer (not in the state dict) equal a plain from_pretrained, the logits too, and lm_head is
    still the embedding (tied), so a step cannot make them drift apart. 2 ranks: test_two_ranks_fsdp_equal_one_process."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    own = trainutil.init_group(1)
    model = trainutil.load_sharded(tiny_model, torch.device("cpu"), 1, bf16=False)
    ref = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    full = dict(trainutil.policy_params(model))
    assert full.keys() == dict(ref.named_parameters()).keys()
    assert all(torch.equal(full[k], v) for k, v in ref.named_parameters())
    assert all(torch.equal(b, dict(ref.named_buffers())[k]) for k, b in model.named_buffers())
    ids = torch.tensor([[5, 17, 300, 9, 41]])
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, ref(ids).logits, atol=1e-5)
    if own:
        dist.destroy_process_group()

def test_one_process_in_fp32_trains_the_plain_module_as_fsdp2_does_bit_for_bit(tiny_model, traj_dir):
    """World size 1 without --offload: load_sharded leaves the module unwrapped (FSDP2 would only copy it at every
    gather and reduce); --offload keeps FSDP2. Two steps of two micro-batches each (sft.py's step:
    accumulate, the float64 norm, clipping, AdamW) leave the plain module with FSDP2's weights bit for bit."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule
    cpu = torch.device("cpu")
    rows = [(r["ids"], r["mask"]) for r in dataio.read_jsonl(traj_dir / "train.jsonl")[:4]]
    own = trainutil.init_group(1, device=cpu)
    try:
        got = {}
        for offload in (False, True):
            model = trainutil.load_sharded(tiny_model, cpu, 1, bf16=False, offload=offload)
            assert isinstance(model, FSDPModule) == offload
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            for step in range(2):
                for i, row in enumerate(rows[2 * step:2 * step + 2]):
                    trainutil.accumulate(model, last=i == 1)
                    sft.loss_sum(model, *sft.collate([row], 2, cpu))[0].backward()
                trainutil.clip_grad_norm(model, 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
            got[offload] = dict(trainutil.policy_params(model))
    finally:
        if own:
            dist.destroy_process_group()
    plain, fsdp = got[False], got[True]
    assert plain.keys() == fsdp.keys() and all(torch.equal(plain[k], fsdp[k]) for k in plain)
    assert max((plain[k] - load_file(tiny_model / "model.safetensors")[k]).abs().max() for k in plain) > 1e-3

def test_grad_norm_sums_squares_in_float64_blocks():
    """clip_grad_norm's square_sum: in blocks, the float64 sum of squares of a whole float64 copy within 1e-12 relative
    (the fp32 norm is not), an empty shard's 0."""
    g = torch.Generator().manual_seed(0)
    for x in (torch.randn(4096, 576, generator=g) * 1e-3, torch.randn(576, generator=g), torch.zeros(0, 576)):
        exact = x.double().square().sum().item()
        got = trainutil.square_sum(x)
        assert got.dtype == torch.float64 and abs(got.item() - exact) <= 1e-12 * exact
    big = torch.randn(4096, 576, generator=g)
    assert abs(torch.linalg.vector_norm(big).item() ** 2 / big.double().square().sum().item() - 1) > 1e-12

def test_one_process_in_bf16_computes_by_autocast_on_fp32_masters(tiny_model, traj_dir):
    """World size 1 in bf16: the plain module too, its weights fp32 (the masters) and its forward under autocast:
    logits in bf16, close to fp32's but not equal (the bf16 matmuls ran), gradients in fp32; a no-grad forward after
    a training one computes the same (nothing cached between forwards). FSDP2's mixed precision (--offload here, the
    unit a two-rank run has) rounds elsewhere, so a step of each lands close, not equal."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule
    cpu = torch.device("cpu")
    ids, labels = sft.collate([(r["ids"], r["mask"]) for r in dataio.read_jsonl(traj_dir / "train.jsonl")[:1]],
                              2, cpu)
    own = trainutil.init_group(1, device=cpu)
    try:
        fp32 = trainutil.load_sharded(tiny_model, cpu, 1, bf16=False)
        got = {}
        for offload in (False, True):
            model = trainutil.load_sharded(tiny_model, cpu, 1, bf16=True, offload=offload)
            assert isinstance(model, FSDPModule) == offload
            with torch.no_grad():
                logits = model(ids).logits  # [1, T, V]
            sft.loss_sum(model, ids, labels)[0].backward()
            grads = [p.grad for p in model.parameters()]
            assert all(trainutil.local(g).dtype == torch.float32 for g in grads)
            with torch.no_grad():
                assert torch.equal(model(ids).logits, logits)
            got[offload] = (logits, trainutil.full(grads[-1]))
            if not offload:
                assert all(p.dtype == torch.float32 for p in model.parameters())
                assert logits.dtype == torch.bfloat16
                with torch.no_grad():
                    ref = fp32(ids).logits
                assert 0 < (logits.float() - ref).abs().max() < 0.5
    finally:
        if own:
            dist.destroy_process_group()
    (plain, gplain), (fsdp, gfsdp) = got[False], got[True]
    assert not torch.equal(plain, fsdp) and (plain.float() - fsdp.float()).abs().max() < 0.5
    assert torch.allclose(gplain, gfsdp, rtol=0.1, atol=1e-3)

@pytest.fixture(scope="module")
def sft_ranks(tiny_model, traj_dir, tmp_path_factory):
    """The 2-rank runs, in one launch (tests/one_launch.py): padded micro-batches (2 a rank, activation
    checkpointing) as single_run's global batches, then packed ones (packed_args). -> (the launch's folder, stdout)."""
    root = tmp_path_factory.mktemp("sft-ranks")
    stdout = launch([("sft", ["--model", tiny_model, "--data", traj_dir, "--out", root / "ddp", "--grad_accum", "2",
                              "--activation_checkpointing", *FAST, *SGD]),
                     ("sft", [*packed_args(tiny_model, traj_dir), "--grad_accum", "2", "--out", root / "packed"])])
    return root, stdout

@pytest.mark.slow
def test_two_ranks_fsdp_equal_one_process(single_run, sft_ranks):
    """torchrun, 2 gloo ranks x 2 micro-batches (and activation checkpointing) vs 1 process x 4: the same global
    batches. Plain SGD, so the weights compare tightly (measured ~1e-8; AdamW's first step lr*g/(|g|+eps) would
    amplify reduction-order noise in near-zero gradients; Adam would also hide a wrong gradient scale)."""
    out, stdout = sft_ranks[0] / "ddp", sft_ranks[1]
    assert "M trained), world 2" in stdout and "global batch 8 = 2 x 2 x 2" in stdout
    for step in (1, 2):
        assert max_diff(out / f"step_{step}", single_run / f"step_{step}") < 1e-6
    assert max_diff(out / "step_2", single_run / "step_1") > 1e-3  # step 2 did something
    a, b = read_log(single_run), read_log(out)
    assert [x["step"] for x in a] == [x["step"] for x in b] == [1, 2, 2]
    for x, y in zip(a, b):
        for k in ("loss", "grad_norm", "eval_loss", "lr", "loss_tokens", "tokens"):
            if k in x:
                assert y[k] == pytest.approx(x[k], rel=1e-6), k

#### packed micro-batches (--pack_tokens)

def test_pack_keeps_the_rows_in_order_within_the_budget():
    rows = [([0] * n, [0] * n) for n in (5, 4, 9, 2, 2, 1)]
    pack = lambda rows, budget: trainutil.pack(rows, budget, lambda row: len(row[0]))
    packs = pack(rows, 9)
    assert [[len(r[0]) for r in p] for p in packs] == [[5, 4], [9], [2, 2, 1]]
    assert [[len(r[0]) for r in p] for p in pack(rows, 4)] == [[5], [4], [9], [2, 2], [1]]  # a longer row alone

def token_logprobs(model, ids, labels, pos=None):
    """[N] logprob of each label token (the trainer's selected_logits)."""
    sel = labels[:, 1:] != -100
    logp = trainutil.selected_logits(model, ids, sel, pos=pos).float().log_softmax(-1)  # [N, V]
    return logp.gather(-1, labels[:, 1:][sel][:, None])[:, 0]

def test_packed_rows_score_as_each_alone(tiny_model, traj_dir):
    """Three rows end to end (collate_packed) give each row's loss as it gets alone: the position ids restart at each
    row and transformers attends within each row. The same concatenation as one causal sequence (later rows seeing
    the earlier ones) does not: its logprobs of the later rows are off by far more."""
    model = load(tiny_model).eval()
    rows = [(r["ids"], r["mask"]) for r in dataio.read_jsonl(traj_dir / "train.jsonl")[:3]]
    with torch.no_grad():
        ids, labels, pos = sft.collate_packed(rows, "cpu")
        assert ids.shape == labels.shape == pos.shape == (1, sum(len(x) for x, _ in rows))
        s, n = sft.loss_sum(model, ids, labels, pos=pos)
        hand = [hand_nll(model, x, m) for x, m in rows]
        assert n.item() == sum(k for _, k in hand)
        assert s.item() == pytest.approx(sum(h.item() for h, _ in hand), rel=1e-5)
        alone = torch.cat([token_logprobs(model, *sft.collate([r], 2, "cpu")) for r in rows])
        packed, leaky = token_logprobs(model, ids, labels, pos), token_logprobs(model, ids, labels)
        assert (packed - alone).abs().max() < 1e-4 < (leaky - alone).abs().max()

def test_packed_logprobs_equal_padded_within_bf16_rounding(tiny_model, traj_dir):
    """Per-token logprobs of four rows packed against the same rows right-padded, through the trainer's own model
    (FSDP2; bf16: its mixed precision): in fp32 equal to 1e-5; in bf16 apart by no more than bf16 rounds the padded
    ones themselves (their distance from fp32's)."""
    import torch.distributed as dist
    cpu = torch.device("cpu")
    rows = [(r["ids"], r["mask"]) for r in dataio.read_jsonl(traj_dir / "train.jsonl")[:4]]
    own = trainutil.init_group(1, device=cpu)
    try:
        got = {}
        for dtype in ("fp32", "bf16"):
            model = trainutil.load_sharded(tiny_model, cpu, 1, train=False, bf16=dtype == "bf16")
            with torch.no_grad():
                got[dtype] = (token_logprobs(model, *sft.collate(rows, 2, cpu)),
                              token_logprobs(model, *sft.collate_packed(rows, cpu)))
    finally:
        if own:
            dist.destroy_process_group()
    (pad32, pack32), (pad16, pack16) = got["fp32"], got["bf16"]
    assert len(pad32) == len(pack32) == sum(sum(m[1:]) for _, m in rows)
    assert (pack32 - pad32).abs().max() < 1e-5
    bf16_rounding = (pad16 - pad32).abs().max()
    assert 0 < (pack16 - pad16).abs().max() <= bf16_rounding

def packed_args(tiny_model, traj_dir):
    """--pack_tokens B, B picked so that 2 ranks x 4 rows a step pack their rows in different numbers of
    micro-batches."""
    rows = sft.load_rows(traj_dir / "train.jsonl", 2048, 10**9)  # uncut: rows of unequal length
    first = [rows[i] for i in torch.randperm(len(rows), generator=torch.Generator().manual_seed(0)).tolist()[:8]]
    size = lambda row: len(row[0])
    budget = next(b for b in range(600, 3000, 50) if len(trainutil.pack(first[:4], b, size)) !=
                  len(trainutil.pack(first[4:], b, size)))
    return ["--model", str(tiny_model), "--data", str(traj_dir), *FAST, *SGD, "--max_len", "2048",
            "--pack_tokens", str(budget)]

@pytest.mark.slow
def test_packed_two_ranks_equal_one_process_and_resume_exactly(sft_ranks, tiny_model, traj_dir, tmp_path):
    """--pack_tokens B: 2 gloo ranks x 4 rows a step against 1 process x 8 (SGD: the same weights to 1e-6), B picked
    so the ranks pack their rows in different numbers of micro-batches (the one with fewer adds weight-0 copies:
    FSDP gathers inside every forward); then the 1-process run resumed from its step-1 checkpoint ends bitwise where
    it ended."""
    args = packed_args(tiny_model, traj_dir)
    one, two, resumed = tmp_path / "one", sft_ranks[0] / "packed", tmp_path / "resumed"
    sft.main([*args, "--grad_accum", "4", "--out", str(one)])
    for step in (1, 2):
        assert max_diff(two / f"step_{step}", one / f"step_{step}") < 1e-6
    losses = lambda out: [x.get("loss", x.get("eval_loss")) for x in read_log(out)]
    assert losses(two) == pytest.approx(losses(one), rel=1e-6)
    resumed.mkdir()
    shutil.copytree(one / "step_1", resumed / "step_1")
    (resumed / "latest").write_text("step_1\n")
    sft.main([*args, "--grad_accum", "4", "--out", str(resumed), "--resume"])
    assert max_diff(resumed / "step_2", one / "step_2") == 0.0

#### resume, and the checkpoint itself

@pytest.mark.slow
def test_resume_continues_exactly(tiny_model, traj_dir, tmp_path):
    """AdamW + warm-up + cosine, 6 steps straight vs a copy of the same run's step-3 checkpoint resumed with --resume
    (what a crash right after step 3 leaves): mid-epoch (4 steps of 8 of the 32 rows per epoch), so the rest of
    epoch 0 and the new permutation of epoch 1 are both crossed. Data order, LR, optimizer moments and log continue
    exactly (bitwise). The same checkpoint also loads into a run with --offload (FSDP2's CPUOffloadPolicy: shards,
    gradients and the Adam step in host memory, its mixed precision rounding elsewhere than one process's autocast),
    which lands close."""
    args = ["--model", str(tiny_model), "--data", str(traj_dir), "--grad_accum", "4", "--train_steps", "6",
            "--save_every", "3", "--eval_every", "0", "--activation_checkpointing", *FAST, "--warmup_steps", "2", "--dtype", "bf16"]
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    sft.main([*args, "--out", str(a)])
    for out, offload in ((b, []), (c, ["--offload"])):
        out.mkdir()
        shutil.copytree(a / "step_3", out / "step_3")
        shutil.copy(a / "log.jsonl", out / "log.jsonl")  # holds steps 1-6: resuming drops 4-6 and writes them again
        (out / "latest").write_text("step_3\n")
        sft.main([*args, "--out", str(out), "--resume", *offload])
    assert max_diff(a / "step_6", b / "step_6") == 0.0 < max_diff(a / "step_6", c / "step_6") < 1e-3
    assert max_diff(a / "step_6", a / "step_3") > 1e-5
    la, lb = read_log(a), read_log(b)
    assert [x["step"] for x in lb] == [1, 2, 3, 4, 5, 6] and len({x["lr"] for x in la}) == 6
    assert la[4]["loss_tokens"] != la[0]["loss_tokens"]  # step 5 opens epoch 1 with a new permutation (seed + epoch)
    for x, y in zip(la, lb):
        assert (x["loss"], x["grad_norm"], x["lr"], x["loss_tokens"]) == (y["loss"], y["grad_norm"], y["lr"], y["loss_tokens"])
    state = torch.load(b / "step_6" / "trainer_state.pt", weights_only=False)
    assert (state["step"], state["epoch"], state["position"]) == (6, 1, 2)
    assert (b / "latest").read_text().strip() == "step_6" and (b / "final").resolve() == (b / "step_6").resolve()

@pytest.mark.slow
def test_sft_continue_goes_on_where_the_run_stopped(tiny_model, traj_dir, tmp_path):
    """runs/sft_continue.sh (the SFT-continued control): a 2-step SFT run at a constant LR continued for 2 more steps
    in its own folder equals the same run trained 4 steps straight (optimizer state and data order carried, bitwise),
    and the SFT run's own checkpoint, hard-linked into the new folder, is left as it was."""
    args = ["--model", str(tiny_model), "--data", str(traj_dir), "--grad_accum", "4", "--save_every", "0",
            "--eval_every", "0", *FAST, "--lr", "2e-5", "--min_lr_ratio", "1"]
    straight, first, cont = tmp_path / "straight", tmp_path / "first", tmp_path / "cont"
    # all three in fresh processes of one environment (one thread): the comparison is bitwise, and a pytest process
    # that imported vLLM earlier, or a second thread, rounds differently (4-7e-9 on AVX512 machines)
    env = {**os.environ, "PY": sys.executable, "OMP_NUM_THREADS": "1"}
    for steps, out in ((4, straight), (2, first)):
        r = subprocess.run([sys.executable, "sft.py", *args, "--train_steps", str(steps), "--out", str(out)], cwd=ROOT,
                           capture_output=True, text=True, timeout=300, env=env)
        assert r.returncode == 0, r.stderr[-2000:]
    before = load_file(first / "step_2" / "model.safetensors")
    r = subprocess.run(["bash", "runs/sft_continue.sh", str(first / "final"), str(cont), "2", *args[2:]], cwd=ROOT,
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert max_diff(straight / "step_4", cont / "final") == 0.0
    assert max_diff(first / "step_2", cont / "final") > 1e-6
    after = load_file(first / "step_2" / "model.safetensors")
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert [x["step"] for x in read_log(cont)] == [3, 4]  # its own log: the steps it trained

@pytest.mark.slow
def test_sft_continued_control_is_dev_picked(tiny_model, traj_dir, tiny_index, tmp_path):
    """runs/common.sh's continue_sft (the SFT-continued control of runs/teacher.sh and runs/vs_sft.sh): the SFT run
    resumed for MORE steps with a checkpoint every EVERY, each scored on dev, <out>/best linked to the one with the
    best mean of F1-Recall and routing accuracy (the earliest of equals); called again, it does nothing."""
    args = ["--model", str(tiny_model), "--data", str(traj_dir), "--grad_accum", "4", "--save_every", "0",
            "--eval_every", "0", *FAST, "--lr", "2e-5", "--min_lr_ratio", "1"]
    sft.main([*args, "--train_steps", "2", "--out", str(tmp_path / "first")])
    call = f"source runs/common.sh && continue_sft {tmp_path / 'first' / 'final'} {tmp_path / 'cont'} {' '.join(args[2:])}"
    env = {**os.environ, "PY": sys.executable, "DATA": str(tiny_index), "DEV_N": "3", "MORE": "2", "EVERY": "1"}
    r = subprocess.run(["bash", "-c", call], cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    scores = {}
    for k in (3, 4):  # the candidates: every checkpoint the continued run saved
        res = next(iter(json.loads((tmp_path / f"dev-cont-{k}" / "results.json").read_text()).values()))
        assert res["n"] == 3
        scores[k] = (res["f1_recall"] + res["routing_acc"]) / 2
    best = 3 if scores[3] >= scores[4] else 4
    assert (tmp_path / "cont" / "best").resolve() == (tmp_path / "cont" / f"step_{best}").resolve()
    assert f"dev-picked: {tmp_path / 'cont'} step {best}" in r.stdout
    r = subprocess.run(["bash", "-c", call], cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0 and "dev-picked" not in r.stdout, r.stderr[-2000:]


@pytest.mark.slow
def test_checkpoint_loads_in_transformers_and_vllm_tied_and_equal_to_the_trainer(single_run, tiny_model, traj_dir):
    from transformers import AutoTokenizer
    assert (single_run / "latest").read_text() == "step_2\n" and (single_run / "final").resolve() == (single_run / "step_2").resolve()
    assert sorted(p.name for p in single_run.iterdir()) == ["final", "latest", "log.jsonl", "step_1", "step_2"]
    model = load(single_run / "final").eval()
    assert model.config.tie_word_embeddings is True
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    saved = load_file(single_run / "final" / "model.safetensors")
    assert "lm_head.weight" not in saved or torch.equal(saved["lm_head.weight"], saved["model.embed_tokens.weight"])
    assert torch.equal(model.lm_head.weight, saved["model.embed_tokens.weight"])
    # the trainer's model after step 2 scored the dev set (eval_loss in the log): the loaded one scores the same
    dev = sft.load_rows(traj_dir / "dev.jsonl", 512, 10**9)
    with torch.no_grad():
        s, n = sft.loss_sum(model, *sft.collate(dev, 2, "cpu"))
    assert read_log(single_run)[-1]["eval_loss"] == pytest.approx((s / n).item(), rel=1e-5)
    # vLLM (what rollout.py samples with) loads the folder as is: same logprobs as transformers, not the initial model's
    ids = dev[0][0][:300]
    got = torch.tensor(vllm_prompt_logprobs(single_run / "final", ids))
    with torch.no_grad():
        lp = [m(input_ids=torch.tensor([ids])).logits[0, :-1].log_softmax(-1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
              for m in (model, load(tiny_model))]
    assert (got - lp[0]).abs().max() < 1e-3 < (got - lp[1]).abs().max()
    tok = AutoTokenizer.from_pretrained(single_run / "final")
    assert tok.chat_template == AutoTokenizer.from_pretrained(tiny_model).chat_template
    state = torch.load(single_run / "step_2" / "trainer_state.pt", weights_only=True)  # plain data, no pickled code
    assert state["step"] == 2 and state["args"]["optim"] == "sgd"
    assert (single_run / "step_2" / "trainer" / ".metadata").exists()  # the sharded model and optimizer state

#### bad input

@pytest.mark.slow
def test_bad_input_exits_with_one_line_naming_the_problem(tiny_model, traj_dir, tmp_path):
    good = [json.loads(line) for line in open(traj_dir / "train.jsonl")]

    def run(rows=None, raw=None, model=tiny_model):
        d = tmp_path / f"data{len(list(tmp_path.iterdir()))}"
        d.mkdir()
        (d / "train.jsonl").write_text(raw if raw is not None else "".join(json.dumps(r) + "\n" for r in rows))
        shutil.copy(traj_dir / "dev.jsonl", d / "dev.jsonl")
        with pytest.raises(SystemExit) as e:
            sft.main(["--model", str(model), "--data", str(d), "--out", str(tmp_path / "o"), *FAST])
        msg = str(e.value.code)
        assert msg.startswith("error: ") and "\n" not in msg
        return msg, d

    assert "not a model folder" in run(good, model=tmp_path / "nope")[0]
    msg, d = run(raw="".join(json.dumps(r) + "\n" for r in good[:2]) + '{"ids": [1, 2\n')
    assert f"{d / 'train.jsonl'}:3:" in msg
    assert "row 2" in run([good[0], dict(good[1], mask=good[1]["mask"][:-1])])[0]  # ids and mask lengths differ
    assert "row 3" in run([good[0], good[1], dict(good[2], mask=[0] * len(good[2]["mask"]))])[0]  # no policy token
    assert "row 1" in run([{k: v for k, v in good[0].items() if k != "ids"}])[0]
    assert "fewer than one global batch" in run(good[:3])[0]
    (d / "train.jsonl").unlink()
    # the real command line: one line on stderr, no traceback
    r = subprocess.run([sys.executable, "sft.py", "--model", str(tiny_model), "--data", str(d), "--out", str(tmp_path / "o")],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and r.stderr.strip() == f"error: {d / 'train.jsonl'}: file not found"

def test_a_disk_too_full_for_the_next_checkpoint_stops_before_it_with_one_line(tiny_model, traj_dir, tmp_path, monkeypatch):
    """Step 2's checkpoint finds less free disk than it needs: the run exits naming the folder, the two sizes and the
    last whole checkpoint, before writing anything of step 2 (no step_2/, no .step_2.tmp/); --resume auto goes on."""
    args = ["--model", str(tiny_model), "--data", str(traj_dir), "--train_steps", "2", "--save_every", "1",
            "--eval_every", "0", "--out", str(tmp_path / "o"), "--resume", "auto", *FAST]
    real, out = trainutil.shutil.disk_usage, tmp_path / "o"
    def full_after_step_1(path):  # 1000 bytes free once step 1's checkpoint is whole
        return real(path)._replace(free=1000) if (out / "latest").is_file() else real(path)
    monkeypatch.setattr(trainutil.shutil, "disk_usage", full_after_step_1)
    had_group = torch.distributed.is_initialized()  # an in-process vLLM engine's, which the run reuses
    with pytest.raises(SystemExit) as e:
        sft.main(args)
    if not had_group:  # the exit left the group the run made, as a process's end would
        torch.distributed.destroy_process_group()
    msg = str(e.value.code)
    assert re.fullmatch(rf"error: {re.escape(str(out))}: 0 MiB free, step 2's checkpoint needs ~\d+ MiB "
                        r"\(the last whole checkpoint: step_1\); free space \(or lower --keep\) and rerun with --resume auto", msg), msg
    assert sorted(p.name for p in out.iterdir() if p.name.startswith((".step", "step"))) == ["step_1"]
    monkeypatch.setattr(trainutil.shutil, "disk_usage", real)
    sft.main(args)
    assert (out / "final").resolve().name == "step_2"
    need = trainutil.checkpoint_bytes(torch.nn.Linear(10, 10))  # 110 trainable fp32 weights + 2 AdamW moments, exported
    assert need == 110 * 12 + 110 * 4

def test_gpu_budget_of_a_7b_run():
    """The start-up memory check on docs/gpu.md's 7B budget: a ~7.6B-parameter policy in fp32 shards over 8 H100s of
    80 GiB (3.8 GB of shards, 7.6 GB of Adam state each) fits beside an engine taking half of each GPU; over 2 GPUs
    (15.2 GB of shards + 30.4 GB of Adam) it does not, and the line says which part takes how much."""
    gib, P, V = 2**30, 7.6e9, 152064  # Qwen2.5-7B's vocabulary; 1024: RolloutConfig.update_tokens at the defaults
    assert memory.gpu_budget_error(80 * gib, 4 * P / 8, 4 * P / 8, 0.5, 8, 1024, V) is None
    error = memory.gpu_budget_error(80 * gib, 4 * P / 2, 4 * P / 2, 0.5, 2, 1024, V, device=1)
    assert error.startswith("error: GPU 1 (80.0 GiB) cannot hold the rollout phase (84.0 GiB: vLLM engine (50%) 40.0 GiB")
    assert "Adam state 28.3 GiB, CUDA context 0.5 GiB, NCCL buffers 1.0 GiB)" in error

def test_gpu_budget_of_a_32b_lora_run_with_and_without_offload():
    """docs/gpu.md's 32B LoRA estimate on 2 x 80 GiB: the frozen base's fp32 shards (61.3 GiB a GPU) beside the
    engine's half do not fit, and the line points to --offload; offloaded, the GPU holds the engine's 85% (the
    shards, Adam and the gradients in host memory) and the update's logits, and the check passes."""
    gib, P, lora, V = 2**30, 32.76e9, 134.2e6, 152064  # Qwen2.5-32B; LoRA r 16 on every linear layer
    error = memory.gpu_budget_error(80 * gib, 4 * (P + lora) / 2, 4 * lora / 2, 0.5, 2, 1536, V)
    assert error.startswith("error: GPU 0 (80.0 GiB) cannot hold the rollout phase (103.3 GiB") and "--offload" in error
    assert memory.gpu_budget_error(80 * gib, 0, 4 * lora / 2, 0.85, 2, 1536, V, offload=True) is None
    update = memory.gpu_budget(80 * gib, 0, 4 * lora / 2, 0.85, 2, 1536, V, offload=True)["update"]
    assert update["Adam state"] == update["gradients"] == 0 and round(sum(update.values()) / gib, 1) == 3.2

def test_a_released_structure_trajectory_gives_one_row_a_chat(tiny_index, tok, tmp_path):
    # synth.py --structure released writes each trajectory with its chats' boundaries: sft trains on each chat alone
    ret = retrievers.Retriever(tiny_index, "bm25")
    qs = dataio.load_questions(tiny_index, "train")[:6]
    trajs = rollout.rollout(rollout.GoldPolicy(tok, qs), ret, qs, s=rollout.Settings(structure="released"))
    dataio.write_jsonl(tmp_path / "train.jsonl", trajs)
    rows = sft.load_rows(tmp_path / "train.jsonl", 4096, 10**9)
    assert rows == [(x["ids"][a:b], x["mask"][a:b], []) for x in trajs for a, b in x["segments"]]
    assert len(rows) == sum(len(x["spans"]) for x in trajs)
    assert all(tok.decode(ids).count("<|im_start|>system") == 1 for ids, _, _ in rows)
