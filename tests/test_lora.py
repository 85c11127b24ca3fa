"""LoRA and QLoRA (peft, bitsandbytes) in sft.py and stepgrpo.py: only the adapters get gradients and optimizer state,
the reference is the base with adapters off, the merged weights are what the trainer computes with (on the meta
device too), 2-rank LoRA SFT equals one process, exact resume, the merged export loads in transformers and vLLM and
equals the adapted model, Step-GRPO from an SFT-LoRA checkpoint keeps its engine equal to the trainer (nf4 too).

Policy: the tiny random Llama (tied embeddings); data: the tiny world's golden trajectories (conftest.py)."""
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from conftest import vllm_prompt_logprobs
from one_launch import launch

import engines
import prepare
import sft
import stepgrpo
import trainutil

FAST = ["--max_len", "512", "--batch_size", "2", "--warmup_steps", "0", "--dtype", "fp32",
        "--lora_r", "4", "--lora_dropout", "0", "--eval_every", "0"]
ADAPTERS = "adapter/adapter_model.safetensors"

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

@pytest.fixture(scope="module")
def group():
    own = trainutil.init_group(1)
    yield
    if own and torch.distributed.is_initialized():  # an in-process Step-GRPO run's vLLM teardown destroys it too
        torch.distributed.destroy_process_group()

@pytest.fixture(scope="module")
def lora_run(tiny_model_dir, traj_dir, tmp_path_factory):
    """One process, AdamW, 2 steps of a global batch of 8 = 2 rows x 4 micro-batches; checkpoints at steps 1, 2."""
    out = tmp_path_factory.mktemp("lora") / "single"
    sft.main(["--model", str(tiny_model_dir), "--data", str(traj_dir), "--out", str(out), "--grad_accum", "4",
              "--train_steps", "2", "--save_every", "1", "--lr", "1e-2", *FAST])
    return out

def adapter_diff(a, b):
    a, b = load_file(Path(a) / ADAPTERS), load_file(Path(b) / ADAPTERS)
    assert a.keys() == b.keys() and len(a) == 2 * 7 * 2  # A and B of 7 linear layers x 2 blocks
    return max((a[k] - b[k]).abs().max().item() for k in a)

#### the adapters, the merge and the reference, in process

def test_only_the_adapters_get_gradients_and_the_merge_is_the_adapted_model(tiny_model_dir, traj_dir, group):
    from transformers import AutoModelForCausalLM
    rows = sft.load_rows(traj_dir / "train.jsonl", 256, 10**9)[:2]
    ids, labels = sft.collate(rows, 0, torch.device("cpu"))
    grads = []
    for ckpt in (False, True):  # activation checkpointing gives the same gradients
        model = trainutil.load_sharded(tiny_model_dir, torch.device("cpu"), 1, ckpt, bf16=False, lora=trainutil.Lora(4))
        trained = {n for n, p in model.named_parameters() if p.requires_grad}
        assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
        s, n = sft.loss_sum(model, ids, labels)
        (s / n).backward()
        assert {n for n, p in model.named_parameters() if p.grad is not None} == trained
        grads.append({n: trainutil.full(p.grad) for n, p in model.named_parameters() if p.grad is not None})
    assert all(torch.allclose(grads[0][k], grads[1][k], atol=1e-6) for k in grads[0])
    assert all(g.abs().max() > 0 for k, g in grads[0].items() if ".lora_B." in k)  # B = 0 at the start: A's grad is 0
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    merged = dict(trainutil.policy_params(model))
    assert merged.keys() == dict(base.named_parameters()).keys()  # the base model's names, no adapters
    assert all(torch.equal(merged[k], v) for k, v in base.named_parameters())  # B = 0: the adapted model is the base
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                trainutil.local(p).normal_(0, 0.1)
        merged = dict(trainutil.policy_params(model))
        base_logits = base(ids).logits
        assert (model(ids).logits - base_logits).abs().max() > 1e-2
        with trainutil.reference(model, None) as ref:  # the KL reference: the same model, adapters off
            assert torch.allclose(ref(ids).logits, base_logits, atol=1e-5)
        base.load_state_dict(merged, strict=False)
        assert torch.allclose(model(ids).logits, base(ids).logits, atol=1e-4)  # W + (alpha / r) B A

def test_a_bf16_lora_step_whose_first_forward_is_the_reference_gets_fp32_gradients(tiny_model_dir, traj_dir, group):
    """Step-GRPO with --kl_coef under bf16: the first forward of the step is the reference's, adapters off. FSDP2 picks
    each unit's gradient dtypes at the first forward from requires_grad, which peft's disable turns off: the adapters'
    bf16 gradients then failed against their fp32 shards at backward (found on a GPU)."""
    rows = sft.load_rows(traj_dir / "train.jsonl", 256, 10**9)[:2]
    ids, labels = sft.collate(rows, 0, torch.device("cpu"))
    model = trainutil.load_sharded(tiny_model_dir, torch.device("cpu"), 1, bf16=True, lora=trainutil.Lora(4))
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    with torch.no_grad(), trainutil.reference(model, None) as ref:
        ref(ids)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == trained
    s, n = sft.loss_sum(model, ids, labels)
    (s / n).backward()
    assert {n for n, p in model.named_parameters() if p.grad is not None} == trained
    assert all(p.grad.dtype == torch.float32 for p in model.parameters() if p.grad is not None)

def test_the_merge_on_the_meta_device_makes_no_tensor_elsewhere(tiny_model_dir):
    """policy_params of a model whose weights are on a non-CPU device (meta): a stray CPU tensor in the merge fails."""
    from transformers import AutoConfig, AutoModelForCausalLM
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_model_dir))
    model = trainutil.add_lora(model, trainutil.Lora(4, targets=("q_proj", "down_proj")))
    out = dict(trainutil.policy_params(model))
    assert all(t.device.type == "meta" for t in out.values())
    shapes = {k.replace(".base_layer.", "."): v.shape for k, v in model.get_base_model().named_parameters() if ".lora_" not in k}
    assert {k: v.shape for k, v in out.items()} == shapes

def test_a_vl_policy_gets_adapters_in_its_decoder_and_vision_tower_and_merges_to_its_own_names(tiny_model_dir, tmp_path, group):
    vl = prepare.prepare_vl(tmp_path / "idefics3", text_model=tiny_model_dir)
    model = trainutil.load_sharded(vl, torch.device("cpu"), 1, bf16=False, lora=trainutil.Lora(4))
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any("vision_model" in n for n in trained) and any("text_model" in n for n in trained)
    hf = engines.auto_model(vl).from_pretrained(vl, dtype=torch.float32)
    merged = dict(trainutil.policy_params(model))
    assert merged.keys() == dict(hf.named_parameters()).keys()
    assert all(torch.equal(merged[k], v) for k, v in hf.named_parameters())

def test_lora_flags_that_cannot_work_exit_with_one_line(tiny_model_dir):
    from transformers import AutoConfig, AutoModelForCausalLM
    assert trainutil.lora_of(0) is None and trainutil.lora_of(8).r == 8 and trainutil.lora_of(8).alpha == 16.0
    assert trainutil.lora_of(8, alpha=32.0, dropout=0.05).alpha == 32.0  # sft.py's flags
    with pytest.raises(SystemExit, match="a rank is a positive number"):
        trainutil.lora_of(-4)
    with pytest.raises(SystemExit, match="--quant nf4 quantises a frozen base: it needs LoRA adapters"):
        trainutil.lora_of(0, "nf4")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_model_dir))
    with pytest.raises(SystemExit, match="--lora_targets qkv_proj: .*not found"):
        trainutil.add_lora(model, trainutil.Lora(4, targets=("qkv_proj",)))

def test_an_adapter_whose_merge_is_not_w_plus_scaling_b_a_is_refused_with_one_line(tiny_model_dir):
    """policy_params merges each LoRA layer as W + scaling B A: a fork's DoRA (its magnitude vector), lora_bias, LoRA on
    the embeddings or an adapter not named "default" would reach the engine as silently wrong weights, so add_lora
    refuses them. rsLoRA changes only the scale, which peft's scaling holds: accepted, and its merge is the model."""
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM
    load = lambda: AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    refused = ((LoraConfig(r=4, use_dora=True), r"use_dora=True"),
               (LoraConfig(r=4, lora_bias=True), r"lora_bias=True"),
               (LoraConfig(r=4, target_modules=["embed_tokens", "q_proj"]), r"model\.embed_tokens \(Embedding\)"))
    for cfg, what in refused:
        with pytest.raises(SystemExit, match=rf"^error: LoRA .*{what}.*unsupported.*trainutil\.policy_params") as e:
            trainutil.add_lora(load(), cfg)
        assert "\n" not in str(e.value)
    assert trainutil.add_lora(load(), trainutil.Lora(4)).peft_config["default"].r == 4  # the scripts' plain LoRA
    model = trainutil.add_lora(load(), LoraConfig(r=4, lora_alpha=8, use_rslora=True, target_modules="all-linear"))
    ids = torch.arange(1, 33)[None]
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.normal_(0, 0.1)
        base = load()
        base.load_state_dict(dict(trainutil.policy_params(model)), strict=False)
        assert torch.allclose(model(ids).logits, base(ids).logits, atol=1e-4)  # W + (alpha / sqrt(r)) B A
        assert (base(ids).logits - load()(ids).logits).abs().max() > 1e-2

#### sft.py: 2 ranks, resume, the checkpoints

@pytest.fixture(scope="module")
def lora_ranks(lora_run, tiny_model_dir, traj_dir, tiny_index, tmp_path_factory):
    """The 2-rank runs, in one launch (tests/one_launch.py): LoRA SFT as lora_run's global batches (2 rows x 2
    micro-batches a rank, activation checkpointing), then Step-GRPO from lora_run's checkpoint for 2 steps, the engine
    checked after every sync, and the same resumed from its step-1 checkpoint. -> (folders by name, stdout)."""
    root = tmp_path_factory.mktemp("lora-ranks")
    sft_args = ["--model", tiny_model_dir, "--data", traj_dir, "--out", root / "ddp", "--grad_accum", "2",
                "--train_steps", "2", "--save_every", "1", "--lr", "1e-2", "--activation_checkpointing", *FAST]
    grpo = lambda out, *extra: ("stepgrpo", grpo_args(lora_run / "final", tiny_index, out, "--train_steps", "2", *extra))
    stdout = launch([("sft", sft_args), grpo(root / "grpo"), ("copy", (root / "grpo", 1, root / "resumed")),
                     grpo(root / "resumed", "--resume")])
    return {name: root / name for name in ("ddp", "grpo", "resumed")}, stdout

@pytest.mark.slow
def test_two_ranks_lora_sft_equal_one_process(lora_run, lora_ranks, tiny_model_dir):
    runs, stdout = lora_ranks
    out = runs["ddp"]
    assert "M trained), world 2" in stdout
    for step in (1, 2):
        assert adapter_diff(out / f"step_{step}", lora_run / f"step_{step}") < 1e-5
    cfg = json.loads((out / "step_2" / "adapter" / "adapter_config.json").read_text())  # peft's writer on rank 0
    assert cfg["inference_mode"] and cfg["base_model_name_or_path"] == str(tiny_model_dir)
    assert adapter_diff(lora_run / "step_2", lora_run / "step_1") > 1e-3  # step 2 did something

@pytest.mark.slow
def test_lora_sft_resumes_exactly_and_keeps_checkpoints_small(lora_run, tiny_model_dir, traj_dir, tmp_path):
    b = tmp_path / "b"
    b.mkdir()
    shutil.copytree(lora_run / "step_1", b / "step_1")
    (b / "latest").write_text("step_1\n")
    sft.main(["--model", str(tiny_model_dir), "--data", str(traj_dir), "--out", str(b), "--grad_accum", "4",
              "--train_steps", "2", "--save_every", "1", "--lr", "1e-2", *FAST, "--resume"])
    assert adapter_diff(lora_run / "step_2", b / "step_2") == 0.0
    resumed = json.loads((b / "step_2" / "adapter" / "adapter_config.json").read_text())
    assert resumed["base_model_name_or_path"] == str(tiny_model_dir)  # --model, not the checkpoint resumed from
    a, c = load_file(lora_run / "step_2" / "model.safetensors"), load_file(b / "step_2" / "model.safetensors")
    assert all(torch.equal(a[k], c[k]) for k in a)
    # an intermediate checkpoint holds adapters and their optimizer state only; the final one the merged weights too
    assert not (lora_run / "step_1" / "model.safetensors").exists() and (lora_run / "step_2" / "config.json").exists()
    trainer = sum(f.stat().st_size for f in (lora_run / "step_1" / "trainer").iterdir())
    embedding = load_file(tiny_model_dir / "model.safetensors")["model.embed_tokens.weight"]
    assert trainer < embedding.nelement() * 4  # no base weights: less than the embedding (the tied head) alone
    with pytest.raises(SystemExit, match="not a model folder: LoRA adapters"):
        trainutil.resolve_start(str(lora_run / "step_1"), tmp_path / "c", None)
    with pytest.raises(SystemExit, match="is a LoRA checkpoint but --lora_r is 0"):
        trainutil.resolve_start(str(tiny_model_dir), lora_run, "yes")

@pytest.mark.slow
def test_the_adapter_folder_is_peft_s_own_and_names_the_base_the_run_started_from(lora_run, tiny_model_dir, traj_dir):
    """The adapter folder as peft's save_pretrained writes it: its config names the base folder the run started from
    (and the base's class), so peft builds the adapted model from the folder alone, whose logits are the merged
    export's; the config is in inference mode, the safetensors file marked "format": "pt" as the Hub expects."""
    from peft import AutoPeftModel, PeftConfig
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM
    adapter = lora_run / "final" / "adapter"
    cfg = PeftConfig.from_pretrained(adapter)
    assert cfg.base_model_name_or_path == str(tiny_model_dir) and cfg.inference_mode
    with safe_open(adapter / "adapter_model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}
    adapted = AutoPeftModel.from_pretrained(adapter).eval()
    merged = AutoModelForCausalLM.from_pretrained(lora_run / "final", dtype=torch.float32).eval()
    x = torch.tensor([sft.load_rows(traj_dir / "dev.jsonl", 300, 10**9)[0][0]])
    with torch.no_grad():
        assert (adapted(x).logits - merged(x).logits).abs().max() < 1e-4


@pytest.mark.slow
def test_merged_export_loads_in_transformers_and_vllm_and_equals_the_adapted_model(lora_run, tiny_model_dir, traj_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    final = lora_run / "final"
    load = lambda d: AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    merged, base = load(final), load(tiny_model_dir)
    adapted = PeftModel.from_pretrained(load(tiny_model_dir), final / "adapter").eval()  # peft's own reading of the adapter files
    ids = sft.load_rows(traj_dir / "dev.jsonl", 300, 10**9)[0][0]
    x = torch.tensor([ids])
    with torch.no_grad():
        lp = [m(x).logits[0, :-1].log_softmax(-1).gather(1, x[0, 1:, None])[:, 0] for m in (merged, adapted, base)]
    assert (lp[0] - lp[1]).abs().max() < 1e-4 < (lp[0] - lp[2]).abs().max()
    assert merged.lm_head.weight.data_ptr() == merged.model.embed_tokens.weight.data_ptr()  # still tied
    got = torch.tensor(vllm_prompt_logprobs(final, ids))
    assert (got - lp[1]).abs().max() < 1e-3 < (got - lp[2]).abs().max()

#### stepgrpo.py: from the SFT-LoRA checkpoint, engine = trainer after each sync, exact resume; QLoRA

def grpo_args(model, data, out, *extra):
    # the tiny random policy earns no reward: the entropy bonus moves the adapters (B = 0 gives the KL no gradient at
    # the start), then the KL to the base with adapters off is > 0
    return ["--model", str(model), "--data", str(data), "--out", str(out), "--batch_questions", "2", "-n", "2",
            "--retriever", "bm25", "--eval_questions", "0", "--lr", "1e-2", "--kl_coef", "0.1", "--entropy_coef", "0.5",
            "--save_every", "1", "--dtype", "fp32", "--lora_r", "4", *map(str, extra)]

def records(out):
    return [json.loads(line) for line in open(Path(out) / "log.jsonl")]

@pytest.mark.slow
def test_lora_step_grpo_from_an_sft_lora_checkpoint_keeps_the_engine_equal_to_the_trainer(lora_run, lora_ranks):
    out = lora_ranks[0]["grpo"]
    recs = records(out)
    assert [r["step"] for r in recs] == [1, 2]
    assert all(r["sync_max_diff"] < 1e-4 for r in recs)  # the engine samples from the merged adapted policy
    assert recs[1]["kl"] > 0  # moved away from the start (the SFT-LoRA checkpoint's merged weights, adapters off)
    start, final = load_file(lora_run / "final" / "model.safetensors"), load_file(out / "final" / "model.safetensors")
    assert max((start[k] - final[k]).abs().max().item() for k in start) > 1e-4

@pytest.mark.slow
def test_lora_step_grpo_resumes_exactly(lora_ranks):
    straight, resumed = lora_ranks[0]["grpo"], lora_ranks[0]["resumed"]
    a, b = records(straight), records(resumed)
    assert adapter_diff(straight / "step_2", resumed / "step_2") == 0.0
    assert adapter_diff(straight / "step_2", straight / "step_1") > 1e-4
    assert [r["step"] for r in b] == [1, 2]
    for key in ("loss", "kl", "entropy", "tokens", "grad_norm"):
        assert a[1][key] == pytest.approx(b[1][key], rel=1e-6, abs=1e-9), key

@pytest.mark.slow
def test_qlora_nf4_base_on_cpu_trains_adapters_and_syncs_the_dequantised_policy(tiny_model_dir, tiny_index, tmp_path):
    pytest.importorskip("bitsandbytes")
    stepgrpo.main(grpo_args(tiny_model_dir, tiny_index, tmp_path / "q", "--train_steps", "1", "--quant", "nf4"))
    recs = records(tmp_path / "q")
    assert recs[0]["sync_max_diff"] < 1e-4
    base, final = load_file(tiny_model_dir / "model.safetensors"), load_file(tmp_path / "q" / "final" / "model.safetensors")
    # the export is the dequantised nf4 base plus the adapters: bitsandbytes' own round trip of the base weight
    import bitsandbytes.functional as bf
    q, ad = "model.layers.0.self_attn.q_proj", load_file(tmp_path / "q" / "final" / ADAPTERS)
    a, b = (ad[f"base_model.model.{q}.lora_{x}.weight"] for x in "AB")
    nf4 = bf.dequantize_4bit(*bf.quantize_4bit(base[q + ".weight"], quant_type="nf4", compress_statistics=True))
    assert torch.allclose(final[q + ".weight"] - 2.0 * b @ a, nf4, atol=1e-6)  # stepgrpo.py's scale alpha / r = 2
    assert (nf4 - base[q + ".weight"]).abs().max() > 1e-3 and (b @ a).abs().max() > 0
    assert torch.equal(base["model.embed_tokens.weight"], final["model.embed_tokens.weight"])  # not quantised, frozen
