"""A VL policy whose ranks differ in having pictures: the vision blocks are FSDP units and the model runs its vision
tower only when it has pixels, so a rank whose micro-batch has none would skip the all-gathers another rank's enters
(gloo: "Received data size doesn't match", NCCL: a hang). Such a micro-batch runs the tower on a dummy picture with
weight 0 (VisionIO.pixels always, trainutil.zero_vision_term): the same loss and gradients as no picture (Idefics3,
and a tiny random Qwen2.5-VL), and on 2 gloo ranks with one row with pictures and one without: SFT with its dev loss,
equal to one process, and Step-GRPO, each rank's VL engine synced and checked after every update, resumed exactly;
each under a timeout so that a hang fails. (2-rank runs of a VL policy live here; tests/test_vl.py, one process.)"""
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from one_launch import launch

import dataio
import engines
import prepare
import retrievers
import rollout
import sft
import vision


@pytest.fixture(scope="module")
def tiny_vl(tiny_model_dir, tmp_path_factory):
    return prepare.prepare_vl(tmp_path_factory.mktemp("vl") / "idefics3", text_model=tiny_model_dir)

def loss_and_grads(model, ids, labels, pix):
    model.zero_grad(set_to_none=True)
    s, _ = sft.loss_sum(model, ids, labels, pix)
    s.backward()
    return s.detach(), {k: p.grad for k, p in model.named_parameters()}

def assert_dummy_changes_nothing(model, ids, labels, pix, tower):
    """The loss and every gradient of `pix` (a dummy picture) equal those without pixels, bit for bit; the weights
    whose name holds one of `tower` (vision tower and connector) get a gradient of zeros, not None: they ran."""
    assert set(pix) == {"dummy"}
    loss, grads = loss_and_grads(model, ids, labels, {})
    loss_d, grads_d = loss_and_grads(model, ids, labels, pix)
    assert torch.equal(loss, loss_d)
    vis_names = {k for k in grads if any(t in k for t in tower)}
    assert vis_names and all(grads[k] is None and not grads_d[k].any() for k in vis_names)
    assert all(torch.equal(grads[k], grads_d[k]) for k in grads.keys() - vis_names)

def test_a_dummy_picture_changes_no_loss_and_no_gradient(tiny_vl):
    vis = vision.VisionIO.load(tiny_vl)
    model = engines.auto_model(tiny_vl).from_pretrained(tiny_vl, dtype=torch.float32)
    ids = torch.tensor([vis.tok.encode("<|im_start|>user\nWhich flag is it?<|im_end|>\n<|im_start|>assistant\nNone")])
    labels = torch.where(torch.arange(ids.shape[1]) >= ids.shape[1] - 3, ids, -100)
    pix = sft.pixels([(ids[0].tolist(), None, [])], vis, ids)
    assert pix["dummy"]["pixel_values"].shape[:2] == (1, 1)  # one picture, one tile
    assert_dummy_changes_nothing(model, ids, labels, pix, ("vision_model", "connector"))
    assert sft.pixels([(ids[0].tolist(), None, [])], None, ids) == {}  # a text policy: nothing

def test_a_dummy_picture_changes_nothing_for_qwen2_5_vl():
    # Qwen2.5-VL's 3-D RoPE positions come from image_grid_thw and mm_token_type_ids: the forward gets neither, so
    # they are a text batch's; the dummy's grid goes to the vision tower alone (pixels: [patches, 1176], one grid)
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessorPil
    cfg = Qwen2_5_VLConfig(text_config=dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                            num_attention_heads=2, num_key_value_heads=1, bos_token_id=0, eos_token_id=1,
                                            rope_scaling={"type": "mrope", "mrope_section": [4, 6, 6]}),
                           vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                                              fullatt_block_indexes=[1]),
                           image_token_id=250, video_token_id=251, vision_start_token_id=252, vision_end_token_id=253)
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(cfg)
    vis = object.__new__(vision.VisionIO)  # the image processor alone (Qwen's processor needs torchvision)
    vis.proc, vis._dummy = SimpleNamespace(image_processor=Qwen2VLImageProcessorPil()), None
    ids = torch.randint(0, 200, (2, 12))
    labels = torch.where(torch.arange(12) >= 4, ids, -100)
    pix = vis.pixels([[], []], "cpu", ids, always=True)
    assert pix["dummy"]["image_grid_thw"].tolist() == [[1, 16, 16]]
    assert_dummy_changes_nothing(model, ids, labels, pix, ("visual",))

#### 2 gloo ranks, one row with pictures and one without

def max_diff(a_dir, b_dir, part=""):
    """The largest difference between two checkpoints' weights (those whose name holds `part`)."""
    a, b = load_file(Path(a_dir) / "model.safetensors"), load_file(Path(b_dir) / "model.safetensors")
    return max((a[k] - b[k]).abs().max().item() for k in a if part in k)

def records(out):
    return [json.loads(line) for line in open(Path(out) / "log.jsonl")]

@pytest.fixture(scope="module")
def mixed_traj(tmp_path_factory, tiny_index, tiny_vl):
    """Gold-policy trajectories: train and dev each one visual question's (pictures) and one text question's (none)."""
    vis, ret = vision.VisionIO.load(tiny_vl), retrievers.Retriever(tiny_index, "bm25")
    out = tmp_path_factory.mktemp("mixed")
    for name, splits in (("train", ("visual_train", "train")), ("dev", ("visual_dev", "dev"))):
        rows = []
        for split in splits:
            qs = dataio.load_questions(tiny_index, split)[:8]
            trajs = rollout.rollout(rollout.GoldPolicy(vis.tok, qs, vis), ret, qs)
            rows.append(next(x for x in trajs if bool(x["images"]) == split.startswith("visual")))
        dataio.write_jsonl(out / f"{name}.jsonl", rows)
    return out

def sft_flags(tiny_vl, mixed_traj):
    return ["--model", tiny_vl, "--data", mixed_traj, "--batch_size", "1", "--dtype", "fp32", "--optim", "sgd",
            "--lr", "0.5", "--warmup_steps", "0", "--train_steps", "2", "--eval_every", "1", "--save_every", "1"]

def grpo_flags(tiny_vl, data):
    # 2 questions, one a rank: a visual one (its golden prefixes hold the question image and retrieved pictures) and
    # a text one whose gold route never searches the image KB (none); a KL term keeps every row live and runs the
    # reference model on both too, an entropy bonus gives a gradient whatever the rewards (the tiny policy's are all 0)
    return ["--model", tiny_vl, "--data", data, "--split", "mixed", "--batch_questions", "2", "-n", "2", "--retriever",
            "bm25", "--kl_coef", "0.1", "--entropy_coef", "0.1", "--lr", "1e-2", "--eval_questions", "0",
            "--train_steps", "2", "--save_every", "1", "--dtype", "fp32"]  # every sync checked

@pytest.fixture(scope="module")
def vl_ranks(tiny_vl, tiny_index, mixed_traj, tmp_path_factory):
    """The 2-rank runs, in one launch under a timeout, so that a hang fails (tests/one_launch.py): SFT (each step one
    rank's row has pictures and the other's none, the dev loss too), then Step-GRPO on a visual and a text question,
    one a rank, each rank's VL engine checked after every sync, and the same resumed from its step-1 checkpoint. ->
    the launch's folder."""
    root = tmp_path_factory.mktemp("vl-ranks")
    data = root / "data"
    shutil.copytree(tiny_index, data)
    visual = (data / "questions" / "visual_train.jsonl").read_text().splitlines()[0]
    text = next(line for line in (data / "questions" / "train.jsonl").read_text().splitlines()
                if all(s["kb"] != "image" for s in json.loads(line)["steps"]))
    (data / "questions" / "mixed.jsonl").write_text(f"{visual}\n{text}\n")
    launch([("sft", [*sft_flags(tiny_vl, mixed_traj), "--grad_accum", "1", "--out", root / "two"]),
            ("stepgrpo", [*grpo_flags(tiny_vl, data), "--out", root / "grpo"]),
            ("copy", (root / "grpo", 1, root / "resumed")),
            ("stepgrpo", [*grpo_flags(tiny_vl, data), "--out", root / "resumed", "--resume"])], timeout=300)
    return root

@pytest.mark.slow
def test_sft_on_two_ranks_with_and_without_pictures_equals_one_process(vl_ranks, tiny_vl, mixed_traj, tmp_path):
    # without the dummy picture gloo failed at step 0. The same global batch on one process (2 micro-batches, one
    # with the dummy) gives the same weights and dev loss: the dummy adds nothing
    two = vl_ranks / "two"
    sft.main([*map(str, sft_flags(tiny_vl, mixed_traj)), "--grad_accum", "2", "--out", str(tmp_path / "one")])
    for step in (1, 2):
        assert max_diff(two / f"step_{step}", tmp_path / "one" / f"step_{step}") < 1e-6
    dev = [[r["eval_loss"] for r in records(run_) if "eval_loss" in r] for run_ in (two, tmp_path / "one")]
    assert len(dev[0]) == 2 and max(abs(a - b) for a, b in zip(*dev)) < 1e-5
    assert max_diff(two / "final", tiny_vl) > 1e-4

@pytest.mark.slow
def test_step_grpo_on_two_ranks_with_and_without_pictures_syncs_and_resumes(vl_ranks, tiny_vl):
    out, resumed = vl_ranks / "grpo", vl_ranks / "resumed"
    recs = records(out)
    assert [r["step"] for r in recs] == [1, 2] and all(r["sync_max_diff"] < 1e-4 for r in recs)
    assert recs[1]["kl"] > 0 and all(r["grad_norm"] > 0 and r["overflow"] == 0.0 for r in recs)
    assert max_diff(out / "final", tiny_vl) > 1e-4
    assert max_diff(out / "final", tiny_vl, "vision_model") > 1e-5  # the tower learned from the rank with pictures
    assert [r["step"] for r in records(resumed)] == [1, 2] and max_diff(out / "final", resumed / "final") == 0.0
