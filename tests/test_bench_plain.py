"""bench/plain.py's two sides do the same work: on the tests' tiny model and golden rows in fp32, sft.py's steps and
the plain loop's, and learner.update and the plain clipped loss, give the same loss at every step (the same rows in
the same order, the same weights after each update: the same loss, the same clip, the same AdamW), so the ratios it
prints compare like with like."""
import pytest
import torch

import sft
import trainutil
from bench import plain as bench_plain

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

@pytest.fixture(scope="module")
def torch_group():
    """A process group of one (the trainers' side at world size 1)."""
    own = trainutil.init_group(1, device=torch.device("cpu"))
    yield
    if own:
        torch.distributed.destroy_process_group()

@pytest.fixture(scope="module")
def inputs(tiny_model_dir, traj_dir):
    tok, _, rows, _ = sft.load_inputs(str(tiny_model_dir), str(traj_dir), ["train"], None, 2048, print)
    return tok, rows

def same_steps(recs):
    """Both sides' losses, step by step, equal; the updates moved them."""
    (a, b) = recs.values()
    assert len(a) == len(b) == 3 and [n for *_, n in a] == [n for *_, n in b]  # the same rows
    assert [x for _, x, _ in a] == pytest.approx([x for _, x, _ in b], rel=1e-4)
    assert abs(a[2][1] - a[0][1]) > 1e-3

def test_the_plain_loop_takes_sft_pys_steps_on_the_same_rows(tiny_model_dir, inputs, torch_group):
    tok, rows = inputs
    sides = bench_plain.sft_sides(str(tiny_model_dir), tok, tok.eos_token_id, 2, 2, "fp32", 1e-3)
    recs, _ = bench_plain.run(sides, [rows[4 * s:4 * s + 4] for s in range(3)])
    same_steps(recs)

def test_the_plain_clipped_loss_takes_the_updates_steps(tiny_model_dir, inputs, torch_group):
    """learner.update against the plain loop's clipped loss: step 1 has ratio 1 (old logprobs are the starting
    weights'), steps 2 and 3 compare the ratios after one and two updates, some of them clipped."""
    tok, rows = inputs
    urows = bench_plain.update_rows(rows[:12], str(tiny_model_dir), 0)
    assert any(r["adv"][0] > 0 for r in urows) and any(r["adv"][0] < 0 for r in urows)
    torch.manual_seed(0)
    sides = bench_plain.update_sides(str(tiny_model_dir), tok.eos_token_id, 2, "fp32", 3e-3)
    recs, _ = bench_plain.run(sides, [urows[4 * s:4 * s + 4] for s in range(3)])
    same_steps(recs)
