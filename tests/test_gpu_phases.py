"""What a GPU run meets first, checked on the CPU where the code path allows (vLLM's LLM recorded with CUDA pretended,
tiny models, a real vLLM engine where vLLM itself refuses): only the policy's engine sleeps, and with its CUDA graphs;
the sync check scores the trainer before the engine wakes, a row the engine takes, in slices; the KL reference keeps
the policy's training flag under FlexAttention; no-grad forwards leave nothing gathered; the budget's sync check phase.
tests/test_gpu.py runs the same on a GPU. Each of these mutations makes one of its tests fail (tests/fork_mutations.py
--gpu applies each to a copy and runs that test):
   1. every vLLM engine built with sleep mode on a GPU (a judge beside the policy's dies)
   2. the CUDA graphs kept on the GPU through the engine's sleep
   3. the sync check's trainer forward after the engine wakes
   4. the sync check's forward left gathered
   5. a packed group scored whole by the sync check
   6. the KL reference in eval mode under FlexAttention
   7. the policy left gathered after a critic warm-up
"""
from types import SimpleNamespace

import pytest
import torch
from torch.distributed.tensor import DTensor

import engines
import grpo
import learner
import memory
import stepgrpo
import trainutil

@pytest.fixture
def group():
    own = trainutil.init_group(1)
    yield
    if own and torch.distributed.is_initialized():  # a vLLM engine's close destroys it too
        torch.distributed.destroy_process_group()

@pytest.fixture
def llm_args(monkeypatch):
    """vllm.LLM's keyword arguments of every engine built, on a pretended GPU host (no engine starts)."""
    import vllm
    seen = []

    class FakeLLM:
        def __init__(self, **kw):
            seen.append(kw)
            self.llm_engine = SimpleNamespace(engine_core=SimpleNamespace(shutdown=lambda: None))

        def get_tokenizer(self):
            return None
    monkeypatch.setattr(vllm, "LLM", FakeLLM)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(engines.VLLMEngine, "sleepers", 0)
    return seen

def sleeps(kw):
    return kw.get("enable_sleep_mode", False), kw.get("sleep_mode_offload_cudagraph", False)

def test_only_the_engine_that_sleeps_takes_vllms_sleep_mode(tiny_model_dir, llm_args):
    # sleep mode puts an engine in vLLM's CuMem allocator, one engine a process: a judge beside the policy's engine
    # (evaluate.py --judge, stepgrpo.py --w_rag --judge) starts without it; the sleeping one offloads its CUDA graphs
    import judge
    policy = engines.VLLMEngine(tiny_model_dir, sleep=True)
    assert sleeps(llm_args[-1]) == (True, True) and policy.can_sleep
    judge.Judge.load(str(tiny_model_dir))  # in-process, beside it
    assert sleeps(llm_args[-1]) == (False, False) and llm_args[-1]["gpu_memory_utilization"] == 0.3
    engines.make_engine("vllm", tiny_model_dir)  # evaluate.py's, synth.py's, serve.py's
    assert sleeps(llm_args[-1]) == (False, False)
    n = len(llm_args)
    with pytest.raises(SystemExit, match="^error: a second vLLM engine with sleep mode in one process"):
        engines.VLLMEngine(tiny_model_dir, sleep=True)
    assert len(llm_args) == n  # refused before vLLM is asked
    policy.close()
    engines.VLLMEngine(tiny_model_dir, sleep=True)  # closed: the next one may sleep
    assert sleeps(llm_args[-1]) == (True, True)

def test_step_grpo_builds_a_sleeping_policy_engine(monkeypatch):
    made = []
    monkeypatch.setattr(trainutil, "load_sharded", lambda *a, **k: torch.nn.Linear(2, 2))
    monkeypatch.setattr(engines.VLLMEngine, "__init__", lambda self, weights, **kw: made.append(kw))
    stepgrpo.setup_policy(stepgrpo.get_args([]), None, "w", False, None, 0, 1, torch.device("cpu"), print)
    assert made[-1]["sleep"] is True

def test_the_sync_check_scores_the_trainer_before_the_engine_wakes(tiny_model_dir, group, monkeypatch):
    # the weights are final after the optimizer step: the trainer's forward runs while the engine sleeps, and what it
    # gathered (FSDP2's root: --offload, one process's FSDP2 model; 2+ ranks' acts alike) is let go before the engine's
    # weights come back
    model = trainutil.load_sharded(tiny_model_dir, torch.device("cpu"), 1, bf16=True, offload=True)
    engine, seen = engines.HFEngine(tiny_model_dir), []
    model.register_forward_pre_hook(lambda *a: seen.append("trainer forward"))
    sync, score = engine.sync_weights, engine.prompt_logprobs
    monkeypatch.setattr(engine, "sync_weights", lambda w: seen.append(
        "engine sync, trainer sharded" if all(isinstance(p, DTensor) for p in model.parameters())
        else "engine sync, trainer gathered") or sync(w))
    monkeypatch.setattr(engine, "prompt_logprobs", lambda *a: seen.append("engine scores") or score(*a))
    timing = trainutil.sync_weights(model, engine, [dict(ids=[5, 6, 7, 8, 9])], 0, memory.PeakMemory(), True, "bf16")
    assert seen == ["trainer forward", "engine sync, trainer sharded", "engine scores"]
    assert timing["sync_mean_diff"] < 0.2 and timing["sync_max_diff"] >= timing["sync_mean_diff"]

def test_the_sync_checks_logprobs_in_slices_equal_the_whole(tiny_model_dir, group, monkeypatch):
    model = trainutil.load_sharded(tiny_model_dir, torch.device("cpu"), 1, bf16=False)
    ids = torch.randint(5, 200, (700,), generator=torch.Generator().manual_seed(0)).tolist()
    monkeypatch.setattr(trainutil, "SYNC_CHUNK", 64)  # 11 slices, the last one short
    sliced = trainutil.trainer_logprobs(model, dict(ids=ids))
    with torch.no_grad():
        whole = model(torch.tensor([ids])).logits[0, :-1].log_softmax(-1).gather(-1, torch.tensor(ids[1:])[:, None])
    assert sliced.shape == (699,) and torch.allclose(sliced, whole[:, 0], atol=1e-5)

def test_the_sync_check_scores_a_row_the_engine_takes():
    # a packed group (teacher_prefix) is its prompt and first completion; a row at the engine's length is cut one token
    # short (a prompt leaves room for one new token), before a picture it would cut through
    prefix, group = [1, 2, 3, 4], [([10, 11, 12], [0.0] * 3), ([20, 21], [0.0] * 2)]
    row = grpo.pack_group(prefix, group, [1.0, -1.0])
    assert trainutil.sync_row(row, 100) == dict(ids=[1, 2, 3, 4, 10, 11, 12], images=[])
    assert trainutil.sync_row(row, 6)["ids"] == [1, 2, 3, 4, 10]
    assert trainutil.sync_row(dict(ids=list(range(10))), None)["ids"] == list(range(10))  # the HF engine: no limit
    pics = [[1, 3, "a.png"], [6, 2, "b.png"]]
    assert trainutil.sync_row(dict(ids=list(range(10)), images=pics), 8) == dict(ids=list(range(6)), images=pics[:1])
    assert trainutil.sync_row(dict(ids=list(range(10)), images=pics), 9) == dict(ids=list(range(8)), images=pics)

def test_a_packed_group_longer_than_the_engines_context_is_checked(tiny_model_dir, group):
    # the whole packed row is longer than max_model_len, which vLLM refuses ("longer than the maximum model length")
    pytest.importorskip("vllm")
    engine = engines.VLLMEngine(tiny_model_dir, max_model_len=64, kv_tokens=1024)
    try:
        model = trainutil.load_sharded(tiny_model_dir, torch.device("cpu"), 1, bf16=False)
        rand = lambda n, s: torch.randint(5, 200, (n,), generator=torch.Generator().manual_seed(s)).tolist()  # noqa
        row = grpo.pack_group(rand(30, 0), [(rand(33, k), [0.0] * 33) for k in (1, 2, 3)], [1.0, 0.0, -1.0])
        assert len(row["ids"]) > 100
        timing = trainutil.sync_weights(model, engine, [row], 0, memory.PeakMemory(), True, "fp32")
        assert timing["sync_mean_diff"] < 1e-3
    finally:
        engine.close()

def test_the_reference_keeps_the_policys_training_flag_under_flex_attention(tiny_model_dir, group, tmp_path):
    # transformers compiles FlexAttention anew at each switch of the training flag; a reference in eval mode beside the
    # policy made every step recompile it twice, until Dynamo's limit left it eager
    from transformers import AutoConfig
    from transformers.integrations import flex_attention as fa
    cpu = torch.device("cpu")
    policy = trainutil.load_sharded(tiny_model_dir, cpu, 1, bf16=False, tree_mask=True, flex=True)
    ref = trainutil.load_sharded(tiny_model_dir, cpu, 1, train=False, bf16=False, tree_mask=True, flex=True)
    assert policy.training and ref.training and not any(p.requires_grad for p in ref.parameters())
    dense = trainutil.load_sharded(tiny_model_dir, cpu, 1, train=False, bf16=False, tree_mask=True)
    assert not dense.training  # SDPA: a frozen model stays in eval mode
    rows = [grpo.pack_group([5, 6, 7, 8], [([9, 10, 11], [0.0] * 3), ([12, 13], [0.0] * 2)], [1.0, -1.0])]
    ids, attn, pos, sel, _, _ = grpo.collate(rows, 0, cpu, flex=True)
    compiled = []  # the compiled functions transformers made: run eager (compiling took ~16 s on a fresh clone)
    with torch.no_grad(), torch.compiler.set_stance("force_eager"):
        for model in (policy, ref, policy, ref):
            grpo.token_logprobs(model, ids, attn, sel, pos)
            compiled.append(fa.WrappedFlexAttention._instance._compiled_flex_attention)
    assert all(c is compiled[0] for c in compiled)  # compiled once
    AutoConfig.from_pretrained(tiny_model_dir, attention_dropout=0.1).save_pretrained(tmp_path)
    for f in tiny_model_dir.iterdir():
        if f.name != "config.json":
            (tmp_path / f.name).symlink_to(f)
    with pytest.raises(SystemExit, match="^error: --flex_attention: .* has dropout"):
        trainutil.load_sharded(tmp_path, cpu, 1, train=False, bf16=False, tree_mask=True, flex=True)

def test_a_critic_warmup_leaves_the_policy_sharded(tiny_model_dir, group):
    # PPO's warm-up (bf16, --kl_in_reward): score_old's no-grad forwards gather the policy's root and no policy backward
    # follows to reshard it; it is let go before the sync and the rollout (--offload: one process's FSDP2 model)
    import critic
    cpu = torch.device("cpu")
    model = trainutil.load_sharded(tiny_model_dir, cpu, 1, bf16=True, offload=True)
    ref = trainutil.load_sharded(tiny_model_dir, cpu, 1, train=False, bf16=True, offload=True)
    crit = critic.load(str(tiny_model_dir), 1e-3, cpu, 1, None, bf16=True, offload=True)
    rows = [dict(ids=[5, 6, 7, 8, 9, 10], mask=[0, 0, 1, 1, 1, 1], old=[0.0] * 6, adv=[0.0] * 6, reward=[0.0] * 6)]
    cfg = learner.UpdateConfig(gae=True, kl_in_reward=0.1)
    learner.learn(model, ref, torch.optim.AdamW(model.parameters()), crit, rows, cfg, 0, cpu, None, 0, True,
                  memory.PeakMemory(), {})
    assert all(isinstance(p, DTensor) for p in model.parameters())

def meta_model(**config):
    """A Qwen2 of `config` on the meta device, sharded as load_sharded shards a trained bf16 policy."""
    from transformers import AutoModelForCausalLM, Qwen2Config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(Qwen2Config(**config))
    trainutil.shard(model, torch.device("cpu"), 1, True, False, True)
    return model

QWEN_3B = dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
               num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True)
QWEN_32B = dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
                num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False)

def test_the_budgets_sync_check_phase_on_the_3b_and_32b_recipes(group):
    gib = 2**30
    # Qwen2.5-3B on one 80 GB GPU (79.2 GiB): the rollout phase fits at 74.6 GiB. The sync check runs while the engine
    # sleeps: the shards and Adam, every weight gathered in bf16 (world size 1), a 4096-token row's bf16 logits and two
    # fp32 slices of their log-softmax. Beside the woken engine the same parts would not fit.
    m3 = meta_model(**QWEN_3B)
    P = sum(p.numel() for p in m3.parameters())
    assert 3.08e9 < P < 3.10e9 and memory.gathered_bytes(m3, 1, False, 2) == 2 * P
    total, V = 79.2 * gib, QWEN_3B["vocab_size"]
    kw = dict(total=total, allocated=4 * P, trainable=4 * P, engine_fraction=0.5, world=1, tokens=1536, vocab=V)
    sync = dict(row_tokens=4096, gathered=memory.gathered_bytes(m3, 1, False, 2), compute_bytes=2)
    phases = memory.gpu_budget(**kw, **sync)
    assert round(sum(phases["rollout"].values()) / gib, 1) == 74.6
    check = phases["sync check"]
    assert check["gathered weights"] == 2 * P and check[f"logits (4096 tokens x {V})"] == 2 * 4096 * V
    assert check["fp32 log-softmax slices"] == 2 * 4 * trainutil.SYNC_CHUNK * V
    assert round(sum(check.values()) / gib, 1) == 42.2 and memory.gpu_budget_error(**kw, **sync) is None
    beside = sum(phases["rollout"].values()) + sum(v for k, v in check.items() if k not in phases["rollout"])
    assert beside > total
    # where the sync check is the phase that does not fit (a 64k context), the line names it and the flag
    error = memory.gpu_budget_error(**dict(kw, total=53 * gib, engine_fraction=0.25, tokens=0),
                                    **dict(sync, row_tokens=65536))
    assert "cannot hold the sync check phase" in error and error.endswith("or a smaller --max_model_len")
    # Qwen2.5-32B LoRA on 2 GPUs with --offload: the root (embeddings and untied head) and two blocks gathered
    m32 = meta_model(**QWEN_32B)
    root = 2 * 152064 * 5120 + 5120
    block = (sum(p.numel() for p in m32.parameters()) - root) // 64
    assert memory.gathered_bytes(m32, 2, True, 2) == 2 * (root + 2 * block)
    lora = 134.2e6
    sync = dict(row_tokens=4096, gathered=memory.gathered_bytes(m32, 2, True, 2), compute_bytes=2)
    check = memory.gpu_budget(80 * gib, 0, 4 * lora / 2, 0.85, 2, 1536, 152064, offload=True, **sync)["sync check"]
    assert round(sum(check.values()) / gib, 1) == 7.7
    # one process in fp32 trains the plain module: nothing gathered
    assert memory.gathered_bytes(torch.nn.Linear(4, 4), 1, False, 4) == 0
