"""A visual step's context: Qwen2.5-VL's processor allows 16k tokens a picture by default, so with a 4k context a
visual step would overflow. stepgrpo.py's --max_model_len and --max_pixels reach the engine (vLLM's LLM, with no
engine started) and the processor (the trainer's and the transcripts' VisionIO); Idefics3 ignores the pixel cap."""
import os
import types

import pytest
import torch

import engines
import prepare
import stepgrpo
import trainutil
import vision

@pytest.fixture(scope="module")
def tiny_vl(tiny_model_dir, tmp_path_factory):
    return prepare.prepare_vl(tmp_path_factory.mktemp("vl") / "idefics3", text_model=tiny_model_dir)

@pytest.fixture
def processor_kwargs(monkeypatch):
    """The keyword arguments of every AutoProcessor.from_pretrained call, which still loads the processor."""
    from transformers import AutoProcessor
    seen, load = [], AutoProcessor.from_pretrained
    monkeypatch.setattr(AutoProcessor, "from_pretrained", lambda path, **kw: seen.append(kw) or load(path, **kw))
    return seen

def test_max_pixels_reaches_the_processor(tiny_vl, tmp_path, processor_kwargs):
    from PIL import Image
    from transformers import AutoImageProcessor, Qwen2VLImageProcessorPil
    plain, capped = vision.VisionIO.load(tiny_vl), vision.VisionIO.load(tiny_vl, max_pixels=401408)
    assert processor_kwargs == [{}, {"max_pixels": 401408}]  # None: the processor's own settings
    assert capped.expand(None) == plain.expand(None)  # Idefics3's processor has no pixel cap: ignored
    # Qwen2.5-VL's processor hands it to its image processor (which needs no torchvision), and it caps a picture's
    # tokens: 401408 = 512 x 28 x 28 pixels, <= 512 tokens (its own default here, 1280 x 28 x 28, leaves 35 x 35)
    Qwen2VLImageProcessorPil().save_pretrained(tmp_path / "qwen")
    big = [[Image.new("RGB", (1400, 1400), "white")]]
    tokens = lambda ip: ip(big, return_tensors="pt")["image_grid_thw"].prod().item() // 4  # 2 x 2 patches a token
    assert tokens(AutoImageProcessor.from_pretrained(tmp_path / "qwen")) == 1225
    assert tokens(AutoImageProcessor.from_pretrained(tmp_path / "qwen", max_pixels=401408)) == 22 * 22

def test_the_engine_gets_the_context_and_the_pixel_cap(tiny_vl, tiny_model_dir, monkeypatch, processor_kwargs):
    import vllm
    seen = {}

    class FakeLLM:  # vllm.LLM's arguments, recorded; no engine starts
        llm_engine = types.SimpleNamespace(engine_core=None)  # its scheduler: not in this process

        def __init__(self, **kw):
            seen.clear()
            seen.update(kw)

        def get_tokenizer(self):
            return None
    monkeypatch.setattr(vllm, "LLM", FakeLLM)
    monkeypatch.setattr(os, "environ", dict(os.environ))  # the engine's environment defaults stay in this test
    engine = engines.VLLMEngine(tiny_vl, max_model_len=8192, max_pixels=401408)
    assert seen["max_model_len"] == engine.max_len == 8192 and seen["mm_processor_kwargs"] == {"max_pixels": 401408}
    assert processor_kwargs[-1] == {"max_pixels": 401408}  # the engine's VisionIO: transcripts expand as vLLM does
    engines.VLLMEngine(tiny_vl)
    assert seen["max_model_len"] == 4096 and "mm_processor_kwargs" not in seen and processor_kwargs[-1] == {}
    engines.VLLMEngine(tiny_model_dir, max_pixels=401408)  # a text policy: no multimodal arguments at all
    assert "mm_processor_kwargs" not in seen and "limit_mm_per_prompt" not in seen

def test_step_grpo_flags_reach_the_engine(monkeypatch):
    made = []

    class Engine:  # what setup_policy builds, recorded
        GPU_FRACTION = 0.5

        def __init__(self, weights, **kw):
            made.append(kw)
    monkeypatch.setattr(trainutil, "load_sharded", lambda *a, **k: torch.nn.Linear(2, 2))
    monkeypatch.setattr(engines, "VLLMEngine", Engine)
    monkeypatch.setattr(engines, "HFEngine", Engine)
    setup = lambda argv: stepgrpo.setup_policy(stepgrpo.get_args(argv), None, "w", False, None, 0, 1, torch.device("cpu"),
                                               print)
    setup([])
    assert made[-1]["max_model_len"] == 4096 and made[-1]["max_pixels"] is None
    setup(["--max_model_len", "8192", "--max_pixels", "401408"])
    assert made[-1]["max_model_len"] == 8192 and made[-1]["max_pixels"] == 401408
    setup(["--backend", "hf", "--max_model_len", "8192", "--max_pixels", "401408"])  # the HF engine takes both too
    assert made[-1]["max_model_len"] == 8192 and made[-1]["max_pixels"] == 401408

def test_sft_and_the_hf_engine_take_the_cap(tiny_vl, tiny_index, tmp_path, processor_kwargs):
    # synth.py --max_pixels records the cap its image expansions were made with (meta.json); sft.py builds its
    # processor with it, whose saved config carries it on (Qwen2.5-VL: runs/gpu_check.py's visual check); the HF
    # engine takes --max_pixels like vLLM's
    import dataio
    import retrievers
    import rollout
    import sft
    import synth
    import transcript
    vis = vision.VisionIO.load(tiny_vl)
    qs = dataio.load_questions(tiny_index, "visual_train")[:4]
    trajs = rollout.rollout(rollout.GoldPolicy(vis.tok, qs, vis), retrievers.Retriever(tiny_index, "bm25"), qs)
    synth.write_trajectories(tmp_path / "traj", "train", trajs, vis.tok, transcript.format_meta(rollout.Settings()), 401408)
    processor_kwargs.clear()
    sft.main([str(a) for a in ["--model", tiny_vl, "--data", tmp_path / "traj", "--out", tmp_path / "sft", "--train_steps",
                               1, "--grad_accum", 1, "--eval_every", 0, "--save_every", 0, "--dtype", "fp32"]])
    assert {"max_pixels": 401408} in processor_kwargs
    processor_kwargs.clear()
    engines.HFEngine(tmp_path / "sft" / "final", max_pixels=401408)
    assert processor_kwargs == [{"max_pixels": 401408}]


def test_picture_paths_are_absolute_and_a_missing_one_is_one_line_naming_it_and_the_node(tiny_vl, tiny_index,
                                                                                         monkeypatch):
    # a retrieval server sends its KB's `path` to every node, and a VL policy opens it there: relative to the server's
    # working folder it named no file on another node; a picture that is not there exits in one line
    import socket

    import dataio
    monkeypatch.chdir(tiny_index.parent)
    rel = tiny_index.name
    assert all(os.path.isabs(d["path"]) for d in dataio.load_kb(rel, "image"))
    assert all(os.path.isabs(q["image"]) for q in dataio.load_questions(rel, "visual_dev"))
    vis = vision.VisionIO.load(tiny_vl)
    with pytest.raises(SystemExit) as e:
        vis.image("/shared/mini/kb/images/portrait-0.png")
    msg = str(e.value.code)
    assert msg.startswith(f"error: image file not found on {socket.gethostname()}: /shared/mini/kb/images/portrait-0.png")
    assert "\n" not in msg
