"""bench/flops.py's FLOP count, against the parameter count of the real default policy: a forward is 2 FLOPs a
weight a token (the head read at that token) plus attention, which grows with the context; and a run's compute from
its log (the claim tables' columns)."""
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from bench import flops as bench_flops
import prepare

def test_a_token_costs_two_flops_a_weight():
    cfg = AutoConfig.from_pretrained(prepare.DEFAULT_MODEL)
    with torch.device("meta"):
        n = sum(p.numel() for name, p in AutoModelForCausalLM.from_config(cfg).named_parameters() if "norm" not in name)
    # embeddings tied to the head: the embedding lookup costs nothing, the head 2 d V; every other weight 2 a token
    assert bench_flops.forward_flops(cfg, 1, 1, 0) == pytest.approx(2 * n, rel=1e-6)
    no_head = bench_flops.forward_flops(cfg, 10, 0, 0)
    assert bench_flops.forward_flops(cfg, 10, 0, 100) - no_head == 4 * cfg.num_hidden_layers * cfg.hidden_size * 100 * 10
    assert bench_flops.forward_flops(cfg, 10, 3, 0) - no_head == 3 * 2 * cfg.hidden_size * cfg.vocab_size

def _run(folder, link, step, state, recs):
    """A run folder as sft.py / stepgrpo.py leave it: <link> -> step_<step> (the policy's config, trainer_state.pt)."""
    ck = folder / f"step_{step}"
    ck.mkdir(parents=True)
    (ck / "config.json").write_text((Path(prepare.DEFAULT_MODEL) / "config.json").read_text())
    torch.save(dict(step=step, **state), ck / "trainer_state.pt")
    (folder / link).symlink_to(ck.name)
    (folder / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return folder

def test_a_runs_compute_counts_its_own_steps_to_its_pick(tmp_path):
    cfg = AutoConfig.from_pretrained(prepare.DEFAULT_MODEL)
    F = lambda tokens, head, ctx: bench_flops.forward_flops(cfg, tokens, head, ctx)
    # a continued SFT run: its log starts at step 4; final is step 5; 3 forwards a step, the context half a row
    sft = _run(tmp_path / "sft", "final", 5, dict(global_batch=4, args={}),
               [dict(step=s, tokens=200, loss_tokens=80) for s in (4, 5)])
    assert bench_flops.run_compute(sft) == (5, 2, 8, 2 * 3 * F(200, 80, 25), None)
    # Step-GRPO picked at step 2 of 3 on 2 ranks (per-rank means logged), a run of 2 PPO epochs (recorded by runs made
    # when the flag existed), the old logprobs recomputed: 3 x 2 + 1 forwards over the update's tokens, one over the
    # rollouts'; step 3 and the step-0 dev record left out
    recs = [dict(step=0, dev_score=0.5)] + [dict(step=s, world=2, update_tokens=100, update_rows=2, update_policy=40,
                                                  rollout_tokens=120, rollout_generated=50) for s in (1, 2, 3)]
    args = dict(ppo_epochs=2, old_logprobs="trainer", kl_coef=0.0, batch_questions=4)
    grpo = _run(tmp_path / "grpo", "best", 2, dict(args=args), recs)
    step, updates, seen, train, rollout = bench_flops.run_compute(grpo)
    assert (step, updates, seen) == (2, 4, 8)
    assert train == pytest.approx(2 * 2 * 7 * F(100, 40, 25)) and rollout == pytest.approx(2 * 2 * F(120, 50, 25))
    del args["ppo_epochs"]  # today's runs: one pass a step
    step, updates, seen, train, _ = bench_flops.run_compute(_run(tmp_path / "grpo1", "best", 2, dict(args=args), recs))
    assert (step, updates, seen) == (2, 2, 8) and train == pytest.approx(2 * 2 * 4 * F(100, 40, 25))
    # PPO: the critic's forward and update, 4 forwards without the LM head, beside the policy's 4
    ppo = _run(tmp_path / "ppo", "best", 2, dict(args=dict(args, adv_estimator="gae")), recs)
    assert bench_flops.run_compute(ppo)[3] == pytest.approx(2 * 2 * (4 * F(100, 40, 25) + 4 * F(100, 0, 25)))
