"""bench/plain.py's two sides do the same work: sft.py's steps and the plain loop's, on the tests' tiny model and
golden rows in fp32, give the same loss at every step (the same rows in the same order, the same weights after each
update: the same loss, the same clip, the same AdamW), so the ratio it prints compares like with like."""
import pytest

from bench import plain as bench_plain

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

def test_the_plain_loop_takes_sft_pys_steps_on_the_same_rows(tiny_model_dir, traj_dir):
    common = (3, 2, 2, "fp32", 1e-3, 0)  # steps, batch_size, grad_accum, dtype, lr, seed
    ours = bench_plain.ours(str(tiny_model_dir), str(traj_dir), *common)
    plain = bench_plain.plain(str(tiny_model_dir), str(traj_dir), *common, 2048)
    assert len(ours) == len(plain) == 3
    assert [n for _, n, _ in ours] == [n for _, n, _ in plain]  # the same rows, step by step
    # the loss after one and two updates: the same update on both sides (lr 1e-3 moves it)
    assert [x for _, _, x in ours] == pytest.approx([x for _, _, x in plain], rel=1e-4)
    assert abs(ours[2][2] - ours[0][2]) > 1e-3
