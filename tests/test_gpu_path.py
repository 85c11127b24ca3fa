"""The GPU path's choices, checked on the CPU (CUDA and flash-attn monkeypatched, a fake vLLM engine, tiny models):
trajectories of another tokenizer refused, flash-attn for bf16 only, bounded image caches, the sync's free-then-wake
order, int8 QLoRA's old logprobs, --device cuda failing fast, the download hint for a Hub model name."""
import json
import sys
import types
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import dataio
import engines
import grpo
import memory
import prepare
import sft
import stepgrpo
import synth
import trainutil
import transcript
import vision

def one_line_exit(fn, *a):
    with pytest.raises(SystemExit) as e:
        fn(*a)
    msg = str(e.value.code)
    assert msg.startswith("error: ") and "\n" not in msg
    return msg

def test_trajectories_of_another_tokenizer_are_refused(tiny_model_dir, tmp_path, capsys):
    from transformers import AutoTokenizer
    tok, other = AutoTokenizer.from_pretrained(tiny_model_dir), AutoTokenizer.from_pretrained(tiny_model_dir)
    other.add_tokens(["<another-vocab>"])
    other.name_or_path = "models/another"
    rows = [dict(ids=[1, 2, 3], mask=[0, 1, 1], logprobs=[0.0] * 3)]
    mine, theirs, bare = tmp_path / "mine", tmp_path / "theirs", tmp_path / "bare"
    fmt = dict(structure="transcript", max_pairs=1, max_rets=1)
    synth.write_trajectories(mine, "train", rows, tok, fmt)
    synth.write_trajectories(theirs, "train", rows, other, fmt)
    meta = json.loads((mine / "meta.json").read_text())
    assert meta["tokenizer"] == str(tiny_model_dir) and len(meta["vocab_sha256"]) == 16
    assert json.loads((mine / "train.jsonl").read_text()) == dict(ids=[1, 2, 3], mask=[0, 1, 1])
    assert transcript.check_tokenizer(mine, tok, print) == fmt  # the same vocabulary passes; the format goes on
    with pytest.raises(dataio.DataError, match="models/another"):
        transcript.check_tokenizer(theirs, tok, print)
    # sft.py exits with one line naming both, before any training (one row: else "fewer than one global batch")
    msg = one_line_exit(sft.main, ["--model", str(tiny_model_dir), "--data", str(theirs), "--out", str(tmp_path / "o"),
                                   "--eval_every", "0"])
    assert "models/another" in msg and str(tiny_model_dir) in msg
    # a folder without meta.json (hand-written, older synth.py) passes with one warning line
    bare.mkdir()
    transcript.check_tokenizer(bare, tok, print)
    out = capsys.readouterr().out
    assert out.startswith("warning: ") and out.count("\n") == 1

def test_a_picture_cap_goes_from_the_trajectories_to_training_and_an_engines_context_from_the_flag(tiny_model_dir, tmp_path):
    # synth.py --max_pixels records the cap its image expansions were made with; sft.py builds its processor with it
    # (transcript.data_meta), which the checkpoint saves (the Qwen2.5-VL round trip is runs/gpu_check.py's visual check:
    # Idefics3, the CPU suite's VL policy, has no such cap). Both engines take --max_model_len and --max_pixels.
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    fmt = dict(structure="transcript", max_pairs=1, max_rets=1)
    synth.write_trajectories(tmp_path / "capped", "train", [dict(ids=[1, 2], mask=[0, 1])], tok, fmt, 401408)
    synth.write_trajectories(tmp_path / "text", "train", [dict(ids=[1, 2], mask=[0, 1])], tok, fmt)
    assert transcript.data_meta(tmp_path / "capped")["max_pixels"] == 401408
    assert transcript.data_meta(tmp_path / "text")["max_pixels"] is None and transcript.data_meta(tmp_path) == {}
    engine = engines.make_engine("hf", tiny_model_dir, seed=0, max_model_len=1234, max_pixels=401408, device="cpu")
    assert engine.max_len == 1234 and engine.vis is None  # a text policy: no processor to cap

def test_flash_attn_only_for_bf16_compute_on_cuda(monkeypatch):
    cuda = torch.device("cuda", 0)  # a device object only: nothing is allocated
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))  # installed
    assert trainutil.attention(cuda, bf16=True) == "flash_attention_2"
    assert trainutil.attention(cuda, bf16=False) == "sdpa"  # --dtype fp32: flash-attn has no fp32 kernels
    assert trainutil.attention(cuda, bf16=True, tree_mask=True) == "sdpa"  # packed groups' 4D masks
    assert trainutil.attention(cuda, bf16=True, tree_mask=True, flex=True) == "flex_attention"  # as block masks
    assert trainutil.attention(torch.device("cpu"), bf16=True) == "sdpa"
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # not installed: the import fails
    assert trainutil.attention(cuda, bf16=True) == "sdpa"

def test_image_caches_keep_the_most_recent_pictures(tiny_model_dir, tmp_path, monkeypatch):
    from PIL import Image
    monkeypatch.setattr(vision.VisionIO, "CACHE", 3, raising=False)
    vis = vision.VisionIO.load(prepare.prepare_vl(tmp_path / "vl", text_model=tiny_model_dir))
    paths = [str(tmp_path / f"{i}.png") for i in range(5)]
    for i, p in enumerate(paths):
        Image.new("RGB", (40 + 8 * i, 32), (40 * i, 255 - 40 * i, 7)).save(p)
    first = [vis.expand(p) for p in paths]
    assert list(vis._pixels) == paths[2:] and list(vis._expanded) == paths[2:]
    vis.image(paths[2])  # used again: now the most recent
    vis.image(paths[0])  # evicted before: decoded again, the same picture; evicts paths[3], the least recent
    assert list(vis._pixels) == [paths[4], paths[2], paths[0]]
    assert np.array_equal(np.asarray(vis.image(paths[0])), np.asarray(Image.open(paths[0]).convert("RGB")))
    assert vis.expand(paths[0]) == first[0] and len(vis._expanded) == 3

class FakeLLM:
    """What VLLMEngine.sync_weights calls on vLLM's LLM, recorded in order."""
    def __init__(self, calls):
        self.calls = calls
        config = SimpleNamespace(hf_config=SimpleNamespace(tie_word_embeddings=False))
        self.llm_engine = SimpleNamespace(model_config=config)

    def wake_up(self, tags):
        self.calls.append(f"wake_up {' '.join(tags)}")

    def collective_rpc(self, method, kwargs):
        self.calls.append(f"{method} " + " ".join(name for name, _ in kwargs["weights_iterator"]))

    def reset_prefix_cache(self):
        self.calls.append("reset_prefix_cache")

def test_sync_frees_the_trainers_cache_before_waking_the_weights(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    engine = object.__new__(engines.VLLMEngine)  # no vLLM: the attributes sync_weights uses
    engine.llm, engine.asleep, engine.dtype, engine.vis, engine.params = FakeLLM(calls), True, "bfloat16", None, {"w"}
    engine.sync_weights({"w": torch.ones(2)})
    assert calls == ["empty_cache", "wake_up weights", "reload_weights w", "empty_cache", "wake_up kv_cache",
                     "reset_prefix_cache"]  # TRL's order: the trainer's cached blocks go before the weights come back
    assert not engine.asleep

def test_int8_qlora_takes_old_logprobs_from_the_trainer(monkeypatch, capsys):
    monkeypatch.delenv("RANK", raising=False)
    args = stepgrpo.get_args(["--lora_r", "8", "--quant", "int8"])
    stepgrpo.check_args(args, 1)
    assert args.old_logprobs == "trainer"
    out = capsys.readouterr().out
    assert out.startswith("note: --quant int8") and out.count("\n") == 1
    args = stepgrpo.get_args(["--lora_r", "8", "--quant", "nf4"])
    stepgrpo.check_args(args, 1)
    assert args.old_logprobs == "sampler" and capsys.readouterr().out == ""

def test_flex_attention_is_for_packed_groups_on_cuda():
    # FlexAttention has no backward on CPU, and on-policy rows are unpacked (no tree mask to give it)
    cuda = torch.device("cuda", 0)
    args = lambda *extra: stepgrpo.get_args(["--flex_attention", *extra])
    stepgrpo.check_args(args(), 1, cuda)  # teacher_prefix's packed groups on CUDA
    stepgrpo.check_args(args("--rollout", "branch"), 1, cuda)
    for a, device in ((args(), torch.device("cpu")), (args("--rollout", "onpolicy"), cuda)):
        assert "--flex_attention" in one_line_exit(stepgrpo.check_args, a, 1, device)
    assert stepgrpo.update_config(args()).flex and not stepgrpo.update_config(stepgrpo.get_args([])).flex
    cfg = stepgrpo.update_config(stepgrpo.get_args(["--micro_tokens", "4096", "--micro_batch", "3"]))
    assert (cfg.micro_tokens, cfg.micro_batch, cfg.flex) == (4096, 3, False)  # each flag to its field

def test_device_cuda_fails_fast_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "--device cuda" in one_line_exit(trainutil.env_rank, "cuda")
    assert trainutil.env_rank("auto")[2] == torch.device("cpu") == trainutil.env_rank("cpu")[2]
    assert "--device cuda" in one_line_exit(sft.main, ["--device", "cuda", "--model", "nowhere"])  # before the model
    assert stepgrpo.get_args(["--device", "cuda"]).device == "cuda" and stepgrpo.get_args([]).device == "auto"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU machine: --device cpu stays off it
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: pytest.fail("--device cpu set a CUDA device"))
    assert trainutil.env_rank("cpu")[2] == torch.device("cpu")

def test_a_hub_model_name_says_to_download_it_first(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no models/ here: the name is not a folder
    msg = one_line_exit(trainutil.resolve_start, "Qwen/Qwen2.5-VL-7B-Instruct", tmp_path / "out", None)
    assert "hf download Qwen/Qwen2.5-VL-7B-Instruct --local-dir models/Qwen2.5-VL-7B-Instruct" in msg
    msg = one_line_exit(trainutil.resolve_start, str(tmp_path / "a" / "b" / "nope"), tmp_path / "out", None)
    assert msg.endswith("nope: not a model folder (no such folder)")
    (tmp_path / "models").mkdir()  # a mistyped local folder is not a Hub name
    assert one_line_exit(trainutil.resolve_start, "models/nope", tmp_path / "out", None).endswith(
        "models/nope: not a model folder (no such folder)")

def test_a_run_folder_is_not_overwritten_without_resume(tmp_path, tiny_model_dir):
    out = tmp_path / "run"
    out.mkdir()
    assert trainutil.resolve_start(str(tiny_model_dir), out, None)[2] is False  # an empty folder: a new run
    (out / "log.jsonl").write_text("{}\n")
    msg = one_line_exit(trainutil.resolve_start, str(tiny_model_dir), out, None)
    assert "holds a run already: pass --resume" in msg
    assert trainutil.resolve_start(str(tiny_model_dir), out, "auto")[2] is False  # a restarted job with no checkpoint

def launch_commands(path):
    """The shell commands of a markdown file's ```bash blocks, continuation lines joined, comments dropped."""
    import re
    import shlex
    from pathlib import Path
    text = Path(path).read_text()
    cmds = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip()
            if line and not line.startswith("#"):
                words = shlex.split(line)
                while "&&" in words:  # `a && b`: two commands
                    cmds.append(words[:words.index("&&")])
                    words = words[words.index("&&") + 1:]
                cmds.append(words)
    return cmds

def test_every_folder_a_gpu_command_reads_is_made_by_an_earlier_line():
    # docs/gpu.md's blocks, read top to bottom as a user runs them: a model, data folder or checkpoint a line reads was
    # downloaded, generated, trained or copied by an earlier line; a local index exists for every line that retrieves
    # without a server; the retrieval server serves the folder both nodes mount, whose picture paths every node opens
    from pathlib import Path
    cmds = launch_commands(Path(__file__).resolve().parents[1] / "docs" / "gpu.md")
    made, indexed, served = set(), set(), []
    under = lambda p, folders: any(p == f or p.startswith(f + "/") for f in folders)  # noqa: E731
    for c in cmds:
        script = next((a for a in c if a.endswith(".py")), None)
        flag = lambda f: c[c.index(f) + 1] if f in c else None  # noqa: E731
        reads = [flag(f) for f in ("--model", "--data") if flag(f)] + (c[-3:-1] if c[0] == "cp" else [])
        reads = [p for p in reads if not p.startswith("-")]
        for p in reads:
            assert under(p, made), f"{' '.join(c)}: reads {p}, which no earlier line makes"
        if script in ("synth.py", "stepgrpo.py", "evaluate.py") or "serve" in c:
            assert (flag("--retriever") or "").startswith("http") or under(flag("--data"), indexed), \
                f"{' '.join(c)}: no index of {flag('--data')} is built before it"
        if "serve" in c:
            served.append(flag("--data"))
        if c[:2] == ["hf", "download"]:
            made.add(flag("--local-dir"))
        if c[0] == "cp":
            made.add(c[-1])
            if under(c[-2], indexed):
                indexed.add(c[-1])
        if script in ("corpus.py", "synth.py", "sft.py", "stepgrpo.py"):
            made.add(flag("--out"))
        if script == "retrievers.py" and "build" in c:
            indexed.add(flag("--data"))
    assert served and all(p.startswith("$SHARED/") for p in served)

def test_the_gpu_launch_commands_run_as_written():
    # docs/gpu.md holds the one copy of the GPU commands: every --model is a local folder (a Hub name only after an
    # `hf download` into that folder), sft.py's --data was synthesised with sft.py's own --model (its tokenizer), and
    # every script flag exists; README carries no copy
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    cmds = launch_commands(root / "docs" / "gpu.md")
    downloaded = {c[c.index("--local-dir") + 1] for c in cmds if c[:2] == ["hf", "download"]}
    synthesised = {}  # --out of synth.py -> its --model
    parsers = dict(sft=sft.get_args, stepgrpo=stepgrpo.get_args)
    seen = set()
    for c in cmds:
        script = next((a for a in c if a.endswith(".py")), None)
        if script is None:
            continue
        args = c[c.index(script) + 1:]
        flag = lambda f: args[args.index(f) + 1] if f in args else None  # noqa: E731
        model = flag("--model")
        if model:
            local = model.startswith(("out/", "models/", "$SHARED/", "data/"))
            assert local, f"{' '.join(c)}: --model {model} is not a local folder"
            assert not model.startswith("models/") or model in downloaded, f"{model} is never downloaded"
        if script == "synth.py":
            synthesised[flag("--out")] = model
        if script == "sft.py":
            assert synthesised.get(flag("--data")) == model, f"sft.py --data {flag('--data')} is not synthesised with {model}"
        if script in ("sft.py", "stepgrpo.py"):
            seen.add(script)
            parsed = parsers[script[:-3]]([a.replace("$", "") for a in args])  # every flag exists (argparse exits if not)
            # a 7B model's learning rate, not the 135M default (sft.py's 2e-4 is 10-20x a 7B full fine-tune's); a LoRA
            # run's is its own (~10x a full fine-tune's), but still said
            assert "--lr" in args, f"{' '.join(c)}: the 135M learning rate"
            assert parsed.lora_r or parsed.lr < parsers[script[:-3]]([]).lr / 4, f"{' '.join(c)}: the 135M learning rate"
    assert seen == {"sft.py", "stepgrpo.py"}
    gpu = lambda c: "torchrun" in c and ("--nnodes" in c or int(c[c.index("--nproc_per_node") + 1]) > 2)  # noqa: E731
    assert any(gpu(c) for c in cmds) and not any(gpu(c) for c in launch_commands(root / "README.md"))

def test_no_grad_forwards_leave_the_root_sharded(tiny_model_dir):
    # FSDP2 reshards a root after its backward only: the KL reference (never a backward) and the policy after the sync
    # check (a no-grad forward, then the rollout) must not keep the embeddings and head gathered (--offload: one
    # process's model is FSDP2's only with it, the plain module without; 2+ ranks' root acts alike)
    from torch.distributed.tensor import DTensor

    own = trainutil.init_group(1)
    try:
        cpu = torch.device("cpu")
        ids = torch.tensor([[5, 6, 7, 8]])
        sel, attn = torch.ones(1, 3, dtype=torch.bool), torch.ones(1, 4)
        ref = trainutil.load_sharded(tiny_model_dir, cpu, 1, train=False, bf16=True, offload=True)
        with torch.no_grad():
            grpo.token_logprobs(ref, ids, attn, sel)
        assert all(isinstance(p, DTensor) for p in ref.parameters())
        model = trainutil.load_sharded(tiny_model_dir, cpu, 1, bf16=True, offload=True)
        trainutil.trainer_logprobs(model, dict(ids=[5, 6, 7, 8]))
        assert all(isinstance(p, DTensor) for p in model.parameters())
    finally:
        if own:
            torch.distributed.destroy_process_group()

def test_each_rank_restores_its_own_cuda_generator(monkeypatch):
    # a checkpoint of 8 ranks resumed on 4 GPUs (or under CUDA_VISIBLE_DEVICES): rank r takes rank r's saved state on its
    # own device, never rank 0's for every visible GPU (torch.cuda.set_rng_state_all indexes one GPU per saved state)
    calls = []
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: calls.append((state, device)))
    saved = [torch.full((4,), r, dtype=torch.uint8) for r in range(8)]
    for rank in range(4):
        trainutil.restore_device_rng(saved, rank, torch.device("cuda", rank))
    assert [(int(s[0]), d.index) for s, d in calls] == [(r, r) for r in range(4)]
    calls.clear()
    trainutil.restore_device_rng(saved[:2], 3, torch.device("cuda", 3))  # more ranks than saved: left as seeded
    trainutil.restore_device_rng(saved, 0, torch.device("cpu"))          # a CPU run has no CUDA generator
    trainutil.restore_device_rng(None, 0, torch.device("cuda", 0))       # a checkpoint written on the CPU
    assert calls == [] and trainutil.device_rng(torch.nn.Linear(2, 2)) is None

def test_the_memory_check_gives_the_same_verdict_fresh_and_resumed(tiny_model_dir):
    # memory_allocated() counts the parameters and, once a resume has loaded it, the Adam state, which the budget adds
    # on its own: taken out first, the verdict of a 7B job on 4 x 80 GB does not flip on resume. The check's own
    # function, with the model on the CPU and the allocated bytes a GPU would report.
    own = trainutil.init_group(1)
    try:
        model = trainutil.load_sharded(tiny_model_dir, torch.device("cpu"), 1, bf16=False)
        opt = torch.optim.AdamW(model.parameters(), lr=0.0)
        shards = sum(trainutil.local(p).numel() * p.element_size() for p in model.parameters())
        allocated = lambda: shards + memory.optimizer_bytes(opt)  # noqa: E731  (torch.cuda.memory_allocated's)
        total = 2 * (shards + 2 * shards + memory.CUDA_CONTEXT)  # the rollout phase's edge: it just fits fresh
        verdict = lambda o: memory.model_budget_error(model, o, total, allocated(), 0.5, 1, 16)  # noqa: E731
        assert verdict(opt) is None and memory.optimizer_bytes(opt) == 0
        sum(p.sum() for p in model.parameters()).backward()
        opt.step()  # what a resume's load leaves: Adam's moments allocated
        assert memory.optimizer_bytes(opt) >= 2 * shards
        assert verdict(opt) is None  # resumed: the same verdict
        assert "cannot hold the rollout phase" in verdict(torch.optim.AdamW(model.parameters()))  # Adam counted twice
    finally:
        if own:
            torch.distributed.destroy_process_group()

def logits(budget):
    """The update phase's logits part of a memory.gpu_budget."""
    return next(v for k, v in budget["update"].items() if k.startswith("logits ("))

def test_each_part_of_the_gpu_budget_decides_at_its_edge(monkeypatch):
    # the parts torch's allocator does not see (CUDA context, NCCL), the loss's fp32 logits, vLLM's CUDA graphs: each
    # turns a verdict at the edge of its phase; the line names every part, on one line
    gib = 2**30
    kw = dict(allocated=2 * gib, trainable=gib, engine_fraction=0.5, world=2, tokens=1024, vocab=152064)
    parts = memory.gpu_budget(80 * gib, **kw)
    # bf16 logits and their gradient, 3 fp32 copies of one 512-row chunk
    assert logits(parts) == (2 * 2 * 1024 + 3 * 4 * 512) * 152064 and memory.LOSS_COPIES == 3
    edge = 2 * (sum(parts["rollout"].values()) - 40 * gib)  # the engine takes half: twice what is beside it
    error = lambda total, **k: memory.gpu_budget_error(total, **dict(kw, **k))  # noqa: E731
    assert error(edge) is None and error(edge - 2).startswith(f"error: GPU 0 ({(edge - 2) / gib:.1f} GiB) cannot hold "
                                                              "the rollout phase")
    assert all(name in error(edge - 2) for name in parts["rollout"]) and "\n" not in error(edge - 2)
    nccl = edge - 2 * memory.NCCL_BUFFERS
    assert error(nccl) is not None and error(nccl, world=1) is None  # one rank: no communicator with peers
    context = edge - 2 * memory.CUDA_CONTEXT
    assert error(context) is not None
    with monkeypatch.context() as m:
        m.setattr(memory, "CUDA_CONTEXT", 0)
        assert error(context) is None
    # 8192 tokens a micro-batch: the update phase is the larger; it fits with its logits at its sum, not a byte less
    update = sum(memory.gpu_budget(0, **dict(kw, tokens=8192))["update"].values())
    assert error(update, tokens=8192) is None and error(update - 1, tokens=0) is None
    assert "cannot hold the update phase" in error(update - 1, tokens=8192)
    assert "or a smaller --micro_batch" in error(update - 1, tokens=8192)
    # the layers' activations and FSDP2's gathered units count in the update: a byte of either turns it, and the line
    # names them and the recomputation that shrinks the first
    for part in ("activations", "gathered"):
        line = error(update, tokens=8192, **{part: 1})
        assert "cannot hold the update phase" in line and "(or --activation_checkpointing)" in line
        assert ("activations 0.0 GiB" if part == "activations" else "gathered weights 0.0 GiB") in line
    monkeypatch.setenv("VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS", "0")  # graphs outside vLLM's share: refused
    assert "VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0" in memory.model_budget_error(None, None, edge, 0, 0.5, 1, 1)

def saved_bytes(model, tokens):
    """Bytes of the tensors autograd keeps from `model`'s decoder forward over `tokens` positions for its backward:
    each storage once, the weights not."""
    weights, kept = {p.untyped_storage().data_ptr() for p in model.parameters()}, {}
    def pack(t):
        if t.untyped_storage().data_ptr() not in weights:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.model(torch.arange(tokens)[None] % 100)
    return sum(kept.values())

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_budgets_activations_are_what_autograd_keeps(tiny_model_dir, dtype):
    # memory.activation_bytes against the saved tensors of a forward (SDPA; flash-attn keeps the same q, k, v, output
    # and log-sum-exp) of the tiny Llama and of a Qwen2 with another MLP width and head count, 2 and 3 layers, in the
    # compute dtype: equal to the byte; recomputing (HF's gradient checkpointing, as trainutil.load_sharded turns it
    # on), each layer keeps its input, and the budget adds the one layer the backward rebuilds at a time (a budget
    # without the term, or with a layer's MLP or norms miscounted, fails)
    import copy

    from transformers import AutoConfig, AutoModelForCausalLM, Qwen2Config
    llama = AutoConfig.from_pretrained(tiny_model_dir)
    qwen2 = Qwen2Config(vocab_size=128, hidden_size=96, intermediate_size=160, num_attention_heads=3,
                        num_key_value_heads=1)
    for config in (llama, qwen2):
        for layers in (2, 3):
            config.num_hidden_layers, config._attn_implementation = layers, "sdpa"
            model = AutoModelForCausalLM.from_config(config).to(dtype).train()
            full = memory.activation_bytes(config, 96, dtype.itemsize, False)
            assert saved_bytes(model, 96) == full > 0
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            fewer = copy.copy(config)
            fewer.num_hidden_layers = layers - 1
            one_layer = full - memory.activation_bytes(fewer, 96, dtype.itemsize, False)
            recomputed = memory.activation_bytes(config, 96, dtype.itemsize, True)
            # the rotary cos and sin go to each recomputed layer as keyword arguments: held, not saved tensors
            rotary = 2 * dtype.itemsize * config.hidden_size // config.num_attention_heads * 96
            assert saved_bytes(model, 96) + rotary == recomputed - one_layer and recomputed < full

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_budgets_logits_are_what_the_chunked_loss_holds(wide_model_dir, monkeypatch, dtype):
    # memory.loss_bytes, measured: torch's profiler records every allocation and free on the CPU, in order; the live
    # bytes of grpo.token_logprobs, grpo_loss and their backward peak at the [N, V] logits and their gradient in the
    # compute dtype plus at most LOSS_COPIES fp32 copies of one chunk's rows, plus the tiny model's own activations (hidden
    # size 64 against a 49152 vocabulary: a few hundredths of a copy); the whole [N, V] in one chunk held 6 fp32 copies
    import itertools

    import grpo
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(wide_model_dir, dtype=dtype)
    N, V, width = 512, model.config.vocab_size, torch.finfo(dtype).bits // 8
    ids = torch.randint(5, V, (1, N + 1), generator=torch.Generator().manual_seed(0))
    def peak(chunk):  # in fp32 [N, V] copies
        monkeypatch.setattr(grpo, "LOGIT_CHUNK", chunk)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            logp, entropy = grpo.token_logprobs(model, ids, torch.ones(1, N + 1), torch.ones(1, N, dtype=torch.bool))
            loss = grpo.grpo_loss(logp, logp.detach(), logp.detach(), torch.ones(N), (0.2, 0.2), 0.0, N, entropy)[0]
            loss.backward()
        events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                        key=lambda e: e.start_ns())  # nbytes: + an allocation, - a free
        return max(itertools.accumulate(e.nbytes() for e in events)) / (N * V * 4)
    for chunk in (32, 64):
        monkeypatch.setattr(memory, "LOGIT_CHUNK", chunk)
        budget = logits(memory.gpu_budget(0, 0, 0, 0.5, 1, N, V, compute_bytes=width)) / (N * V * 4)
        assert budget == memory.loss_bytes(N, V, width) / (N * V * 4) == 2 * width / 4 + 3 * chunk / N
        # within one fp32 copy of the chunk below the budget (2 to 3 copies at its peak), the activations above
        assert budget - chunk / N - 0.05 < peak(chunk) < budget + 0.1, (chunk, peak(chunk), budget)
    assert peak(N) > 5  # one chunk of every row: the fp32 copies of all of them

def test_each_phases_peak_is_broken_into_the_parts_alive_in_it(tiny_model_dir):
    # memory.held_parts counts what a rank holds off its tensors (the policy, its gradients' size, Adam's moments once
    # they exist, the engine's weights), the loss's logits by loss_bytes; memory.breakdown puts the gradients and the
    # logits in the update alone and gives each phase's rest
    import engines
    from memory import GIB
    own = trainutil.init_group(1)
    try:
        model = trainutil.load_sharded(tiny_model_dir, torch.device("cpu"), 1, bf16=False)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        engine = engines.HFEngine(tiny_model_dir)
        size = sum(p.numel() * 4 for p in model.parameters())
        parts = memory.held_parts(model, opt, None, None, engine, 100, bf16=False, before=3 * GIB)
        vocab = model.get_output_embeddings().weight.shape[0]
        assert parts == {"before the models": 3 * GIB, "policy weights": size, "gradients": size, "Adam state": 0,
                         "engine weights": size, "the loss's logits": memory.loss_bytes(100, vocab, 4)}
        sum(p.sum() for p in model.parameters()).backward()
        opt.step()
        assert memory.held_parts(model, opt, None, None, engine, 100, False)["Adam state"] >= 2 * size
    finally:
        if own:
            torch.distributed.destroy_process_group()
    parts = {"before the models": 2 * GIB, "policy weights": GIB, "gradients": GIB, "Adam state": 2 * GIB,
             "the loss's logits": GIB // 2}
    assert memory.breakdown({"rollout": 6.0, "update": 8.0}, parts) == [
        "rollout 6.00 GiB = before the models 2.00 + policy weights 1.00 + Adam state 2.00 + the rest 1.00",
        "update 8.00 GiB = before the models 2.00 + policy weights 1.00 + gradients 1.00 + Adam state 2.00 + the "
        "loss's logits 0.50 + the rest 1.50"]

def test_freed_memory_goes_back_to_the_system_between_phases():
    # stepgrpo.py calls memory.return_freed after the rollout and after the update: glibc keeps freed chunks of its
    # heap (a fragmented one cannot shrink from the top), so a phase's resident peak sat on the last phase's leftovers
    import psutil
    rss = lambda: psutil.Process().memory_info().rss  # noqa: E731
    chunks = [torch.ones(4096) for _ in range(32768)]  # 512 MiB in 16 KiB pieces: the heap, not their own mappings
    keep = chunks[::16]  # noqa: F841  (every 16th piece stays: the 480 MiB freed lie between them)
    del chunks
    held = rss()  # freed, still resident
    memory.return_freed()
    assert held - rss() > 240 * 2**20  # at least half of it handed back

def test_the_memory_check_gets_the_runs_world_and_micro_batch_tokens(tiny_model_dir, monkeypatch):
    # the loss's N: --micro_batch rows of n packed completions (teacher_prefix) or of whole trajectories (onpolicy), at
    # the step budgets evaluation gives (rollout.Settings: 96 new tokens a route, 96 an answer)
    assert stepgrpo.rollout_config(stepgrpo.get_args([])).update_tokens(2) == 2 * 8 * 96
    assert stepgrpo.rollout_config(stepgrpo.get_args(["--rollout", "onpolicy"])).update_tokens(2) == 2 * (3 * 96 + 96)
    two = stepgrpo.get_args(["-n", "4"])
    two.max_pairs = 2  # a multi-query policy's (its transcript.json)
    assert stepgrpo.rollout_config(two).update_tokens(2) == 2 * 4 * 2 * 96
    calls = []
    monkeypatch.setattr(memory, "check_gpu_budget", lambda *a: calls.append(a) or sys.exit("checked"))
    own = trainutil.init_group(1)
    try:
        for extra in ([], ["--rollout", "onpolicy", "--adv_estimator", "gae"],  # --backend vllm, the default
                      ["--micro_tokens", "5000"], ["--micro_tokens", "100"]):  # a token budget; a row past it alone
            args = stepgrpo.get_args(["--model", str(tiny_model_dir), "--micro_batch", "3", *extra])
            with pytest.raises(SystemExit, match="checked"):  # before the engine is built
                stepgrpo.setup_policy(args, tiny_model_dir, tiny_model_dir, False, None, 0, 1, torch.device("cpu"), print)
    finally:
        if own:
            torch.distributed.destroy_process_group()
    # the sync check's row: at most the engine's context; the compute dtype (--dtype auto on this CPU)
    assert calls[0][2:-2] == (engines.VLLMEngine.GPU_FRACTION, 1, 3 * 8 * 96, None, 4096)
    # the activations' positions: each packed row's prefix (within the context) and its 8 completions after the
    # prefix's last token; a trajectory within the context; a token budget, or one row past it
    assert [c[-1] for c in calls] == [3 * (4096 + 8 * 97), 3 * 4096, 5000, 4096 + 8 * 97]
    crit, crit_opt = calls[1][5]  # PPO: the critic, whose shards and Adam state the budget counts beside the policy's
    assert calls[1][4] == 3 * (3 * 96 + 96) and crit.get_output_embeddings().out_features == 1
    assert [c[4] for c in calls[2:]] == [5000, 8 * 96]
    assert isinstance(crit_opt, torch.optim.AdamW)
    # the budget adds gradients and Adam state for the critic's trainable bytes beside the policy's
    seen = []
    monkeypatch.setattr(memory, "gpu_budget_error", lambda total, alloc, trainable, *a, **k: seen.append(trainable))
    size = lambda m: sum(trainutil.local(p).numel() * p.element_size() for p in m.parameters() if p.requires_grad)  # noqa
    for c in (None, (crit, crit_opt)):
        memory.model_budget_error(calls[1][0], calls[1][1], 0, 0, 0.5, 1, 16, crit=c)
    assert seen == [size(calls[1][0]), size(calls[1][0]) + size(crit)]

def test_each_gpu_test_builds_its_vllm_engine_in_a_process_of_its_own(monkeypatch, tmp_path):
    # vLLM's sleep mode allows one engine a process (tests/test_gpu.py's in_own_process says where): the GPU tests that
    # build one do it in a child Python, never in the pytest process (here the children are recorded, not run)
    import subprocess

    import test_gpu
    children = []
    monkeypatch.setattr(engines, "VLLMEngine", lambda *a, **k: pytest.fail("a vLLM engine in the pytest process"))
    monkeypatch.setattr(subprocess, "run", lambda cmd, **k: children.append(cmd) or subprocess.CompletedProcess(cmd, 0))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # the VL test's 2-GPU torchrun part: not here
    test_gpu.test_engine_sleeps_and_follows_a_bf16_sync(tmp_path / "model")
    test_gpu.test_vl_engine_on_gpu_sleeps_syncs_and_trains(tmp_path, tmp_path / "model", tmp_path / "index")
    test_gpu.test_an_in_process_judge_beside_the_sleeping_policy_engine(tmp_path / "model")
    test_gpu.test_engine_sleep_gives_back_what_it_took(tmp_path / "model")
    assert [c[:2] for c in children] == [[sys.executable, "-c"]] * 4

def test_device_cpu_keeps_every_part_off_a_gpu(monkeypatch, tiny_model_dir, tiny_index):
    # one device decision (trainutil.env_rank's), passed down: on a machine with CUDA, --device cpu puts the HF engine,
    # the retrieval encoder and the memory readings on the CPU, and refuses vLLM (whose CUDA build runs on the GPU)
    import engines
    import retrievers
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cpu = torch.device("cpu")
    assert engines.HFEngine(tiny_model_dir, device=cpu).device == "cpu"
    ret = retrievers.make_retriever("dense", tiny_index, cpu)
    assert ret.encoder.device == "cpu" and retrievers.Encoder(device=cpu).device == "cpu"
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: pytest.fail("read CUDA memory on a CPU run"))
    peak = memory.PeakMemory(cpu)
    with peak("update"):
        pass
    assert peak.gib["update"] > 0  # this process's resident memory
    assert "use --backend hf" in one_line_exit(engines.VLLMEngine, tiny_model_dir, 4096, "auto", 0, 0.5, 16, None, cpu)

def test_a_run_names_the_vector_unit_its_speed_depends_on(monkeypatch):
    # the first line of sft.py / stepgrpo.py: the CPU's capability and whether it has native bf16, or the GPU's name
    kind = trainutil.device_kind(torch.device("cpu"))
    assert kind.startswith(f"cpu, {torch.backends.cpu.get_cpu_capability()}")
    assert ("+BF16" in kind) == torch.cpu._is_avx512_bf16_supported()
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA H100 80GB HBM3")
    assert trainutil.device_kind(torch.device("cuda", 0)) == "cuda, NVIDIA H100 80GB HBM3"
