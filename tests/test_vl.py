"""Vision-language policies: visual questions through the step loop, images in transcripts, vLLM against HF with
images, weight sync into a VL engine, image tokens never sampled or trained on, SFT's exact resume. Its 2-rank runs (SFT,
Step-GRPO with engine sync and resume): tests/test_vl_ranks.py.

The VL policy is prepare.prepare_vl around the tiny random Llama of conftest.py (Idefics3: a 2-layer SigLIP on 64 x 64
pictures, 4 tokens an image); the questions are the tiny world's visual split (corpus.py), whose images the retriever
looks at."""
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from conftest import interrupted_copy

import dataio
import engines
import prepare
import retrievers
import rollout
import grpo
import sft
import trainutil
import vision

pytestmark = pytest.mark.slow  # a VL policy and its engines: the whole module is in `make test` only

@pytest.fixture(scope="module")
def tiny_vl(tiny_model_dir, tmp_path_factory):
    return prepare.prepare_vl(tmp_path_factory.mktemp("vl") / "idefics3", text_model=tiny_model_dir)

@pytest.fixture(scope="module")
def vis(tiny_vl):
    return vision.VisionIO.load(tiny_vl)

@pytest.fixture(scope="module")
def ret(tiny_index):
    return retrievers.Retriever(tiny_index, "bm25")

@pytest.fixture(scope="module")
def visual(tiny_index):
    return dataio.load_questions(tiny_index, "visual_train")

@pytest.fixture(scope="module")
def hf(tiny_vl):
    return engines.HFEngine(tiny_vl)

@pytest.fixture(scope="module")
def engine(tiny_vl):
    return engines.VLLMEngine(tiny_vl, max_model_len=2048)

def test_visual_questions_through_the_loop_with_and_without_pixels(tiny_index, ret, visual, vis, tiny_model_dir):
    # the gold policy on visual questions: the question image finds its entity's picture at step 1 whatever the
    # policy; a VL transcript holds the question image and every retrieved picture as the processor's expansion
    # (context, mask 0), a text transcript holds captions only, and both take the same steps
    from transformers import AutoTokenizer
    vl = rollout.rollout(rollout.GoldPolicy(vis.tok, visual, vis), ret, visual)
    text = rollout.rollout(rollout.GoldPolicy(AutoTokenizer.from_pretrained(tiny_model_dir), visual), ret, visual)
    s = rollout.Settings()
    for q, x, y in zip(visual, vl, text):
        assert x["format_ok"] and x["final_answer"] == q["answers"][0] and y["final_answer"] == q["answers"][0]
        assert [st["retrieved"] for st in x["steps"]] == [st["retrieved"] for st in y["steps"]]
        assert x["steps"][0]["retrieved"][0] == q["steps"][0]["doc_id"]  # found by the question image
        image_steps = sum(st["kb"] == "image" for st in x["steps"])
        assert len(x["images"]) == 1 + image_steps * s.topk and y["images"] == []
        first_user = x["ids"].index(vis.tok.convert_tokens_to_ids("<|im_start|>"), 1) + len(vis.tok.encode("<|im_start|>user\n"))
        assert x["images"][0] == [first_user, len(vis.expand(q["image"])), q["image"]]
        for start, n, path in x["images"]:
            assert x["ids"][start:start + n] == vis.expand(path) and not any(x["mask"][start:start + n])
        assert vis.tok.decode(y["ids"]).count("<image>") == 0
    assert vis.expand(visual[0]["image"])[:2] == vis.tok.convert_tokens_to_ids(["<fake_token_around_image>", "<global-img>"])

def test_sft_rows_keep_images_out_of_the_loss(tmp_path, ret, visual, vis):
    trajs = rollout.rollout(rollout.GoldPolicy(vis.tok, visual[:4], vis), ret, visual[:4])
    dataio.write_jsonl(tmp_path / "ok.jsonl", trajs)
    rows = sft.load_rows(tmp_path / "ok.jsonl", 4096, 10**9, vl=True)
    ids, labels = sft.collate(rows, 0, "cpu")
    for b, (_, _, images) in enumerate(rows):
        assert images and all((labels[b, s:s + n] == -100).all() for s, n, _ in images)
    cut = sft.load_rows(tmp_path / "ok.jsonl", rows[0][2][1][0] + 2, 10**9, vl=True)[0]  # max_len inside the 2nd image
    assert len(cut[0]) == rows[0][2][1][0] and cut[2] == rows[0][2][:1]  # the row ends before the image it would split
    with pytest.raises(dataio.DataError, match="holds images, but the model has no vision tower"):
        sft.load_rows(tmp_path / "ok.jsonl", 4096, 10**9, vl=False)
    bad = dict(trajs[0], mask=list(trajs[0]["mask"]))
    start = bad["images"][0][0]
    bad["mask"][start] = 1
    dataio.write_jsonl(tmp_path / "bad.jsonl", [bad])
    with pytest.raises(dataio.DataError, match=f"bad.jsonl: row 1: the image at token {start} is marked as policy tokens"):
        sft.load_rows(tmp_path / "bad.jsonl", 4096, 10**9, vl=True)
    gone = dict(trajs[0], images=[[s, n, "/nonexistent/pic.png"] for s, n, _ in trajs[0]["images"]])
    dataio.write_jsonl(tmp_path / "gone.jsonl", [gone])
    with pytest.raises(dataio.DataError, match="row 1: image file not found: /nonexistent/pic.png"):
        sft.load_rows(tmp_path / "gone.jsonl", 4096, 10**9, vl=True)

def test_vllm_and_hf_agree_greedily_on_prompts_with_images(ret, visual, vis, hf, engine):
    from vllm import SamplingParams
    s = rollout.Settings(temperature=0.0, route_tokens=16, answer_tokens=16)
    a, b = rollout.rollout(hf, ret, visual[:6], s=s), rollout.rollout(engine, ret, visual[:6], s=s)
    assert [x["ids"] for x in a] == [x["ids"] for x in b] and all(x["images"] for x in a)
    _, prefixes = rollout.golden_prefixes(vis.tok, ret, visual[:6], vis=vis)
    with_images = [(ids, images) for _, _, ids, images in prefixes if len(images) > 1][:6]  # evidence pictures too
    assert len(with_images) == 6
    outs = [e.generate([p for p, _ in with_images], 8, 0.0, images=[im for _, im in with_images]) for e in (hf, engine)]
    assert [o[0] for o in outs[0]] == [o[0] for o in outs[1]]
    for ids, images in with_images[:2]:  # vLLM expands the bare placeholders exactly as the transcript holds them
        out = engine.llm.generate([engine.tokens_prompt(ids, images)], SamplingParams(max_tokens=1), use_tqdm=False)[0]
        assert list(out.prompt_token_ids) == ids

def trainer_logprobs(model, vis, ids, images, suppress=()):
    """The trainer's logprob of every token of ids after the first (grpo.token_logprobs, pixels included)."""
    T = len(ids)
    with torch.no_grad():
        return grpo.token_logprobs(model, torch.tensor([ids]), torch.ones(1, T, dtype=torch.long),
                                       torch.ones(1, T - 1, dtype=torch.bool), pix=vis.pixels([images], "cpu"),
                                       suppress=suppress)[0]

def test_sync_into_a_vl_engine_and_image_tokens_never_sampled(ret, visual, vis, tiny_vl, engine):
    # after a sync the engine scores a prompt with images exactly as the trainer does, and not as the old weights did
    # (the vision tower changed too: stale vision embeddings in the encoder cache would show); then a head that makes
    # <image> the likeliest token: neither engine samples an image token, and vLLM's logprob of what it sampled is the
    # trainer's with image tokens suppressed
    _, prefixes = rollout.golden_prefixes(vis.tok, ret, visual[:2], vis=vis)
    ids, images = next((p, im) for _, _, p, im in prefixes if len(im) > 1)
    model = engines.auto_model(tiny_vl).from_pretrained(tiny_vl, dtype=torch.float32).eval()
    old = torch.tensor(engine.prompt_logprobs(ids, images))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "vision_model" in name or "layers.0." in name:
                p.add_(0.05 * torch.randn_like(p))
    engine.sync_weights(dict(trainutil.policy_params(model)))
    new, mine = torch.tensor(engine.prompt_logprobs(ids, images)), trainer_logprobs(model, vis, ids, images)
    assert (new - mine).abs().max() < 1e-4 and (new - old).abs().max() > 1e-2
    image_id = vis.tok.convert_tokens_to_ids("<image>")
    with torch.no_grad():  # tied head: <image>'s logit becomes 50 x the greedy choice's
        emb = model.get_input_embeddings().weight
        first = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=1, do_sample=False, **vis.pixels([images], "cpu"))[0, -1]
        emb[image_id] = 50 * emb[first]
        plain = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=1, do_sample=False, **vis.pixels([images], "cpu"))[0, -1]
    assert plain.item() == image_id  # unsuppressed, the model would write an image token
    engine.sync_weights(dict(trainutil.policy_params(model)))
    outs = engine.generate([ids] * 4, 12, 1.0, seed=0, images=[images] * 4)
    hf = engines.HFEngine(model)
    assert all(not set(o) & set(vis.special_ids) for o, _ in outs + hf.generate([ids] * 4, 12, 1.0, seed=0, images=[images] * 4))
    tokens, lps = outs[0]
    mine = trainer_logprobs(model, vis, ids + tokens, images, vis.special_ids)[len(ids) - 1:]
    assert torch.allclose(torch.tensor(lps), mine, atol=1e-4)

#### training: 2-rank SFT equals one process, exact resume, Step-GRPO syncing a VL engine

FAST = ["--max_len", "1024", "--batch_size", "2", "--warmup_steps", "0", "--dtype", "fp32",
        "--eval_every", "2"]

@pytest.fixture(scope="module")
def vl_traj(tmp_path_factory, tiny_index, ret, vis):
    out = tmp_path_factory.mktemp("vltraj")
    for split, name, n in (("visual_train", "train", 16), ("visual_dev", "dev", 4)):
        qs = dataio.load_questions(tiny_index, split)[:n]
        dataio.write_jsonl(out / f"{name}.jsonl", rollout.rollout(rollout.GoldPolicy(vis.tok, qs, vis), ret, qs))
    return out

def max_diff(a_dir, b_dir):
    a, b = load_file(Path(a_dir) / "model.safetensors"), load_file(Path(b_dir) / "model.safetensors")
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)

def test_vl_sft_trains_the_tower_saves_a_vl_folder_and_resumes_exactly(tiny_vl, vl_traj, tmp_path):
    # AdamW, 4 steps straight against the step-2 checkpoint of the same run resumed (2 ranks against one process:
    # tests/test_vl_ranks.py)
    args = ["--model", str(tiny_vl), "--data", str(vl_traj), "--grad_accum", "2", "--train_steps", "4", "--save_every", "2",
            *FAST]
    a, b = tmp_path / "a", tmp_path / "b"
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        sft.main([*args, "--out", str(a)])
        sft.main([*args, "--out", str(interrupted_copy(a, 2, b)), "--resume"])
    finally:
        torch.set_num_threads(n)
    assert max_diff(a / "step_4", b / "step_4") == 0.0 and max_diff(a / "step_4", a / "step_2") > 1e-5
    x, y = load_file(a / "step_2" / "model.safetensors"), load_file(tiny_vl / "model.safetensors")
    assert max((x[k] - y[k]).abs().max().item() for k in x if "vision_model" in k) > 1e-4  # the vision tower learned
    assert (a / "final" / "processor_config.json").is_file()  # the checkpoint is a VL folder: processor and all
    assert vision.VisionIO.load(a / "final").expand(None) == vision.VisionIO.load(tiny_vl).expand(None)
