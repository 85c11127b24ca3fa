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

import engines
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
    fmt = dict(gold_think="kb_last", structure="transcript", max_pairs=1, max_rets=1)
    synth.write_trajectories(mine, "train", rows, tok, fmt)
    synth.write_trajectories(theirs, "train", rows, other, fmt)
    meta = json.loads((mine / "meta.json").read_text())
    assert meta["tokenizer"] == str(tiny_model_dir) and len(meta["vocab_sha256"]) == 16
    assert json.loads((mine / "train.jsonl").read_text()) == dict(ids=[1, 2, 3], mask=[0, 1, 1])
    assert transcript.check_tokenizer(mine, tok, print) == fmt  # the same vocabulary passes; the format goes on
    with pytest.raises(sft.corpus.DataError, match="models/another"):
        transcript.check_tokenizer(theirs, tok, print)
    # sft.py exits with one line naming both, before any training (one row: else "fewer than one global batch")
    msg = one_line_exit(sft.main, ["--model", str(tiny_model_dir), "--data", str(theirs), "--out", str(tmp_path / "o"),
                                   "--eval_every", "0", "--wandb_mode", "disabled"])
    assert "models/another" in msg and str(tiny_model_dir) in msg
    # a folder without meta.json (hand-written, older synth.py) passes with one warning line
    bare.mkdir()
    transcript.check_tokenizer(bare, tok, print)
    out = capsys.readouterr().out
    assert out.startswith("warning: ") and out.count("\n") == 1

def test_flash_attn_only_for_bf16_compute_on_cuda(monkeypatch):
    cuda = torch.device("cuda", 0)  # a device object only: nothing is allocated
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))  # installed
    assert trainutil.attention(cuda, bf16=True) == "flash_attention_2"
    assert trainutil.attention(cuda, bf16=False) == "sdpa"  # --dtype fp32: flash-attn has no fp32 kernels
    assert trainutil.attention(cuda, bf16=True, tree_mask=True) == "sdpa"  # packed groups' 4D masks
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
