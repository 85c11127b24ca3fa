"""PPO with a critic (stepgrpo.py --adv_estimator gae, critic.py): GAE against the formula evaluated directly on
hand-made transcripts with masked evidence, the clipped value loss on hand cases, a critic that learns, 2 ranks equal
to 1 process, exact resume and a killed rank restarting a PPO job, and one-line errors on bad input."""
import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from conftest import interrupted_copy, kill_a_rank
from one_launch import launch

import critic
import grpo
import learner
import stepgrpo
import trainutil

ROOT = Path(__file__).resolve().parents[1]

def direct_gae(rewards, values, mask, gamma, lam):
    """GAE by its definition over the sequence of policy tokens p_0 .. p_{K-1} (the masked tokens dropped):
    delta_k = r_k + gamma V_{k+1} - V_k (V_K = 0), A_k = sum_l (gamma lam)^l delta_{k+l}, R_k = A_k + V_k."""
    adv, ret = [[0.0] * len(r) for r in rewards], [[0.0] * len(r) for r in rewards]
    for b, (r, v, m) in enumerate(zip(rewards, values, mask)):
        p = [t for t, on in enumerate(m) if on]
        delta = [r[p[k]] + gamma * (v[p[k + 1]] if k + 1 < len(p) else 0.0) - v[p[k]] for k in range(len(p))]
        for k, t in enumerate(p):
            adv[b][t] = sum((gamma * lam) ** l * delta[k + l] for l in range(len(p) - k))
            ret[b][t] = adv[b][t] + v[t]
    return adv, ret

@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.9, 0.8), (1.0, 0.5), (0.0, 1.0)])
def test_gae_skips_evidence_tokens_and_matches_the_formula(gamma, lam):
    # two transcripts: policy tokens (1), retrieved evidence and template between them (0), right padding (0); step
    # rewards on a step's last token, the outcome on the final answer's last one; the values are arbitrary
    mask = [[0, 1, 1, 1, 0, 0, 0, 1, 1, 0, 0, 1, 1, 1, 0],
            [0, 0, 1, 1, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0]]
    rewards = [[0, 0, 0, 0.7, 0, 0, 0, 0, 0.2, 0, 0, 0, 0, 1.2, 0],
               [0, 0, 0, 0.4, 0, 0, 0, 0, 0, 0.9, 0, 0, 0, 0, 0]]
    g = torch.Generator().manual_seed(0)
    values = (torch.randn(2, 15, generator=g) * 0.5).tolist()
    adv, ret = grpo.gae(torch.tensor(rewards), torch.tensor(values), torch.tensor(mask).bool(), gamma, lam)
    want_a, want_r = direct_gae(rewards, values, mask, gamma, lam)
    assert torch.allclose(adv, torch.tensor(want_a), atol=1e-6) and torch.allclose(ret, torch.tensor(want_r), atol=1e-6)
    fa, fr = grpo.gae(torch.tensor(rewards), torch.tensor(values), torch.tensor(mask).float(), gamma, lam)
    assert torch.equal(fa, adv) and torch.equal(fr, ret)  # a 0/1 float mask, verl's response_mask, as the bool one
    off = ~torch.tensor(mask).bool()
    assert (adv[off] == 0).all() and (ret[off] == 0).all()
    # the evidence neither resets the running advantage nor counts as a step: the same policy tokens packed together
    # give the same numbers
    packed = [[x for x, on in zip(row, m) if on] for row, m in zip(values, mask)]
    pr = [[x for x, on in zip(row, m) if on] for row, m in zip(rewards, mask)]
    n = max(map(len, packed))
    pm = torch.tensor([[1] * len(p) + [0] * (n - len(p)) for p in packed]).bool()
    pad = lambda rows: torch.tensor([p + [0.0] * (n - len(p)) for p in rows])  # noqa: E731
    pa, _ = grpo.gae(pad(pr), pad(packed), pm, gamma, lam)
    assert torch.allclose(pa[pm], adv[torch.tensor(mask).bool()], atol=1e-6)

def test_token_rewards_put_the_outcome_on_the_final_answer_and_step_rewards_on_each_step():
    spans = [dict(kind="route", step=0, start=2, end=5), dict(kind="answer", step=0, start=9, end=11),
             dict(kind="route", step=1, start=14, end=16), dict(kind="final", step=1, start=20, end=23)]
    r = grpo.token_rewards(25, spans, [1.2, 0.7, 1.0, 0.2], 1.0)
    assert {t: v for t, v in enumerate(r) if v} == {4: 1.2, 10: 0.7, 15: 1.0, 22: 0.2 + 1.0}
    assert {t: v for t, v in enumerate(grpo.token_rewards(25, spans, [1.2, 0.7, 1.0, 0.2], 1.0, "outcome")) if v} == {22: 1.0}

def test_value_loss_and_its_clip_on_hand_cases():
    v, old, R = torch.tensor([1.0, 0.0, 2.0, -1.0]), torch.tensor([0.0, 0.0, 1.8, 0.0]), torch.tensor([2.0, 1.0, 0.0, -3.0])
    loss, clipped = grpo.value_loss(v, old, R, 0.5, 4)
    # token 0: (1-2)^2 = 1 against clip(1, -0.5, 0.5) = 0.5: (0.5-2)^2 = 2.25 -> 2.25, clipped; token 1: 1 and 1;
    # token 2: (2-0)^2 = 4 against 2.0 inside the clip: 4; token 3: (-1+3)^2 = 4 against (-0.5+3)^2 = 6.25, clipped
    assert loss.item() == pytest.approx(0.5 * (2.25 + 1 + 4 + 6.25) / 4)
    assert clipped.tolist() == [1.0, 0.0, 0.0, 1.0]
    # whitening: the batch's mean and unbiased std
    x = torch.tensor([1.0, 2.0, 4.0])
    w = grpo.whiten(x, 3, x.sum().item(), (x ** 2).sum().item())
    assert torch.allclose(w, (x - x.mean()) / x.std(), atol=1e-6)

def critic_rows(n=6):
    """Fixed rows whose returns depend on their tokens, for a critic to learn."""
    g = torch.Generator().manual_seed(1)
    rows = []
    for i in range(n):
        ids = torch.randint(5, 120, (12,), generator=g).tolist()
        mask = [0] * 4 + [1] * 8
        rows.append(dict(ids=ids, mask=mask, old=[0.0] * 12, adv=[0.0] * 12,
                         reward=[0.0] * 11 + [float(ids[5] % 3) - 1.0]))  # the outcome: a function of one token
    return rows

def test_a_critic_learns_a_fixed_batch(tiny_model_dir):
    # on one fixed batch, repeated updates lower the value loss and the explained variance rises above 0.5
    own = trainutil.init_group(1)
    try:
        args = learner.UpdateConfig(micro_batch=6, gae=True)
        load = lambda: critic.load(str(tiny_model_dir), 1e-3, torch.device("cpu"), 1, None, bf16=False)
        crit, opt = load()
        assert [n for n, p in crit.named_parameters() if p.requires_grad and "lm_head" in n] == \
            ["lm_head.weight", "lm_head.bias"] and crit.get_output_embeddings().out_features == 1
        head = crit.get_output_embeddings()  # verl's critic head and optimizer: N(0, 0.02), bias 0; AdamW 0.9 / 0.999 / 0.01
        w = trainutil.full(head.weight)
        assert 0.015 < w.std().item() < 0.025 and trainutil.full(head.bias).abs().max() == 0
        assert torch.equal(w, trainutil.full(load()[0].get_output_embeddings().weight))
        assert opt.defaults["betas"] == (0.9, 0.999) and opt.defaults["weight_decay"] == 0.01
        micro, denom, _ = learner.micro_batches(critic_rows(), args, 0, torch.device("cpu"))
        losses, ev = [], []
        for _ in range(40):
            critic.advantages(crit, micro, [m.logp_sampler for m in micro], [None] * len(micro))
            sums, _ = critic.update(crit, opt, micro, denom)
            rec = critic.record(sums)
            losses.append(rec["value_loss"])
            ev.append(rec["explained_var"])
    finally:
        if own:
            torch.distributed.destroy_process_group()
    assert losses[0] > 0 and losses[-1] < 0.2 * losses[0] and ev[-1] > 0.5, (losses, ev)

#### end to end: PPO runs of the tiny random policy; its rewards are 0 (it never writes the step format), so the
#### per-token KL penalty in the reward (--kl_in_reward) and the entropy bonus are what the critic and policy learn from

def ppo_args(model, data, out, *extra):
    return ["--model", str(model), "--data", str(data), "--out", str(out), "--rollout", "onpolicy", "--adv_estimator",
            "gae", "--batch_questions", "2", "-n", "1", "--retriever", "bm25", "--eval_questions", "0", "--lr", "1e-2",
            "--critic_lr", "1e-2", "--kl_in_reward", "1.0", "--entropy_coef", "0.1",
            "--save_every", "1", "--dtype", "fp32", "--critic_warmup", "0", *map(str, extra)]

def records(out):
    return [json.loads(line) for line in open(Path(out) / "log.jsonl")]

def critic_state(run):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    dcp_to_torch_save(str(Path(run) / "trainer"), str(Path(run) / "flat.pt"))
    state = torch.load(Path(run) / "flat.pt", weights_only=True)
    (Path(run) / "flat.pt").unlink()
    return {k: v for k, v in state["critic"].items()}

@pytest.fixture(scope="module")
def ppo_straight(tmp_path_factory, tiny_model_dir, tiny_index):
    out = tmp_path_factory.mktemp("ppo") / "run"
    stepgrpo.main(ppo_args(tiny_model_dir, tiny_index, out, "--train_steps", 3))
    return out

@pytest.mark.slow
def test_ppo_trains_the_critic_and_resumes_exactly(ppo_straight, tmp_path, tiny_model_dir, tiny_index):
    recs = records(ppo_straight)
    assert [r["step"] for r in recs] == [1, 2, 3] and all(r["value_loss"] is not None for r in recs)
    assert all(r["critic_s"] > 0 and "explained_var" in r for r in recs) and recs[-1]["value_loss"] > 0
    first, last = critic_state(ppo_straight / "step_1"), critic_state(ppo_straight / "step_3")
    assert (last["lm_head.weight"] - first["lm_head.weight"]).abs().max() > 1e-4  # the critic moved
    resumed = interrupted_copy(ppo_straight, 1, tmp_path / "resumed")
    stepgrpo.main(ppo_args(tiny_model_dir, tiny_index, resumed, "--train_steps", 3, "--resume"))
    a, b = load_file(ppo_straight / "final" / "model.safetensors"), load_file(resumed / "final" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    ca, cb = critic_state(ppo_straight / "step_3"), critic_state(resumed / "step_3")
    assert ca.keys() == cb.keys() and all(torch.equal(ca[k], cb[k]) for k in ca)
    for key in ("loss", "value_loss", "explained_var", "grad_norm", "critic_grad_norm"):
        assert [r[key] for r in records(ppo_straight)[1:]] == pytest.approx([r[key] for r in records(resumed)[1:]],
                                                                              rel=1e-6, abs=1e-9), key

@pytest.mark.slow
def test_a_critic_warmup_holds_the_policy_and_a_critic_that_explains_nothing_stops_the_run(tmp_path, tiny_model_dir,
                                                                                          tiny_index):
    # the tiny random policy's returns are all 0 before its first update (its only reward, the KL penalty, is 0 at
    # the reference): after the warm-up the critic explains nothing, and the policy never starts
    out = tmp_path / "warm"
    with pytest.raises(SystemExit) as e:
        stepgrpo.main(ppo_args(tiny_model_dir, tiny_index, out, "--train_steps", 2, "--critic_warmup", 1))
    msg = str(e.value.code)
    assert msg.startswith("error: after --critic_warmup 1 steps the critic explains nothing") and "\n" not in msg, msg
    a, b = load_file(tiny_model_dir / "model.safetensors"), load_file(out / "step_1" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a) and records(out)[-1]["value_loss"] is not None
    assert not (out / "final").exists()
    with pytest.raises(SystemExit) as e:  # a resume from the checkpoint the gate stopped at is stopped again
        stepgrpo.main(ppo_args(tiny_model_dir, tiny_index, out, "--train_steps", 2, "--critic_warmup", 1, "--resume", "auto"))
    assert str(e.value.code) == msg and not (out / "step_2").exists()

def test_the_policy_starts_after_the_warmup_only_above_the_explained_variance_bar():
    warmup = 3  # --critic_warmup
    critic.check_warmup(dict(explained_var=0.31), 3, warmup)  # passes
    critic.check_warmup(dict(explained_var=0.0), 2, warmup)   # not the warm-up's last step: no check
    critic.check_warmup(dict(explained_var=0.0), 3, 0)  # told: no warm-up
    for rec, words in ((dict(explained_var=0.29), "explains 0.29 of"), (dict(explained_var=None), "explains nothing"),
                       (dict(explained_var=float("nan")), "explains nan")):
        with pytest.raises(SystemExit) as e:
            critic.check_warmup(rec, 3, warmup)
        assert str(e.value.code).startswith("error: after --critic_warmup 3 steps") and words in str(e.value.code)

def critic_run(argv):
    """Three critic updates on the same 8 rows, split over this launch's ranks (tests/one_launch.py) or alone in this
    process (a world of one, trainutil.init_group): rank 0 writes what the two are compared on to argv[1] (JSON)."""
    model, out = argv
    rank, world, device, _ = trainutil.env_rank()
    own = trainutil.init_group(world)
    try:
        args = learner.UpdateConfig(micro_batch=2, gae=True)
        crit, opt = critic.load(model, 1e-3, device, world, None, bf16=False)
        micro, denom, _ = learner.micro_batches(critic_rows(8)[rank::world], args, 0, device)
        for _ in range(3):
            critic.advantages(crit, micro, [m.logp_sampler for m in micro], [None] * len(micro))
            rec = critic.record(critic.update(crit, opt, micro, denom)[0])
        w = {n: trainutil.full(p) for n, p in crit.named_parameters()}
        if rank == 0:
            Path(out).write_text(json.dumps(dict(
                rec=rec, head=w["lm_head.weight"].flatten()[:16].tolist(), bias=w["lm_head.bias"].tolist(),
                embed=w["model.embed_tokens.weight"][5:9].flatten().tolist(),
                adv=micro[0].adv[:8].tolist())))  # row 0's whitened advantages (over the global batch)
        torch.distributed.barrier()  # the ranks leave together: neither tears gloo down mid-collective
    finally:
        if own:
            torch.distributed.destroy_process_group()

@pytest.fixture(scope="module")
def ppo_ranks(tmp_path_factory, tiny_model_dir, tiny_index):
    """One launch of 2 ranks (tests/one_launch.py): an uninterrupted PPO job of 2 steps (the killed job's reference)
    and the critic's updates of critic_run. -> (the job's folder, critic_run's JSON)."""
    root = tmp_path_factory.mktemp("ppo-ranks")
    plain, crit = root / "plain", root / "critic.json"
    launch([("stepgrpo", ppo_args(tiny_model_dir, tiny_index, plain, "--train_steps", 2)),
            ("test_ppo:critic_run", [tiny_model_dir, crit])])
    return plain, crit

@pytest.mark.slow
def test_two_ranks_train_the_critic_as_one_process(ppo_ranks, tmp_path, tiny_model_dir):
    # the same 8 rows on one process and split over 2 gloo ranks: the same whitened advantages, value loss and weights
    critic_run([tiny_model_dir, tmp_path / "one.json"])
    one, two = (json.loads(Path(p).read_text()) for p in (tmp_path / "one.json", ppo_ranks[1]))
    for k in ("value_loss", "explained_var", "vf_clipfrac"):
        assert one["rec"][k] == pytest.approx(two["rec"][k], rel=1e-5, abs=1e-7), k
    for k in ("head", "bias", "embed", "adv"):
        assert one[k] == pytest.approx(two[k], rel=1e-4, abs=1e-6), k

@pytest.mark.slow
def test_a_killed_rank_restarts_a_ppo_job(ppo_ranks, tmp_path, tiny_model_dir, tiny_index):
    # kill -9 one worker of a 2-rank PPO job after its first checkpoint: torchrun --max-restarts 1 restarts both
    # ranks, --resume auto picks up the newest whole checkpoint, critic included, each rank starts its vLLM engine
    # again from it, and the job ends with an uninterrupted run's weights (ppo_ranks'). The killed job runs with
    # --offload (FSDP2's CPUOffloadPolicy for the policy and the critic: their shards, gradients and Adam steps in host
    # memory, here the same memory), so the same weights also say offloading changes no update. One job for what a
    # GRPO job's restart needs (the policy, its engine) and what PPO's adds (the critic)
    plain, killed = ppo_ranks[0], tmp_path / "killed"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "--max-restarts",
           "1", str(ROOT / "stepgrpo.py")] + \
        ppo_args(tiny_model_dir, tiny_index, killed, "--train_steps", 2, "--resume", "auto", "--offload")
    text = kill_a_rank(cmd, killed, tmp_path / "job.log", ROOT)
    assert "exitcode: -9" in text and "resuming from" in text and "at step 2" not in text  # restarted mid-run
    a, b = load_file(plain / "final" / "model.safetensors"), load_file(killed / "final" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    ca, cb = critic_state(plain / "step_2"), critic_state(killed / "step_2")
    assert all(torch.equal(ca[k], cb[k]) for k in ca)
    assert [r["step"] for r in records(killed)] == [1, 2]
    assert all(r["sync_max_diff"] < 1e-4 for r in records(killed))  # the restarted engine scores like the trainer

def test_ppo_flags_that_cannot_work_exit_with_one_line(tmp_path):
    released = tmp_path / "released"  # a policy trained on R1-Router's released structure (its transcript.json)
    released.mkdir()
    (released / "transcript.json").write_text(json.dumps(dict(structure="released", max_pairs=1, max_rets=1)))
    acting = tmp_path / "acting"  # one trained with actions (backtrack, summary restart the chat)
    acting.mkdir()
    (acting / "transcript.json").write_text(json.dumps(dict(structure="transcript", max_pairs=1, max_rets=1, actions=True)))
    for extra, words in ((["--critic_warmup", "-1"], "--critic_warmup -1"),
                         (["--model", str(acting)], "trained with actions, which restart the chat"),
                         (["--dynamic_sampling"], "PPO (--adv_estimator gae) has no groups"),
                         (["--rollout", "teacher_prefix"], "needs --rollout onpolicy"),
                         (["--model", str(released)], "needs a --structure transcript policy"),
                         (["--adv_estimator", "grpo", "-n", "1"], "at least 2 samples")):
        args = stepgrpo.get_args(["--data", str(tmp_path), "--rollout", "onpolicy", "--adv_estimator", "gae", *extra])
        with pytest.raises(SystemExit) as e:
            stepgrpo.check_args(args, 1)
        msg = str(e.value.code)
        assert msg.startswith("error: ") and "\n" not in msg and words in msg, msg
    stepgrpo.check_args(stepgrpo.get_args(["--data", str(tmp_path), "--rollout", "onpolicy", "--adv_estimator", "gae",
                                           "-n", "1"]), 1)  # PPO needs no group

@pytest.mark.slow
def test_a_resume_without_a_critic_or_with_another_one_exits_with_one_line(ppo_straight, tmp_path, tiny_model_dir,
                                                                          wide_model_dir, tiny_index):
    grpo_run = tmp_path / "grpo"
    stepgrpo.main(ppo_args(tiny_model_dir, tiny_index, grpo_run, "--train_steps", 1, "--adv_estimator", "grpo", "-n", 2,
                           "--kl_in_reward", 0))
    with pytest.raises(SystemExit) as e:  # a GRPO checkpoint resumed as PPO: no critic in it
        stepgrpo.main(ppo_args(tiny_model_dir, tiny_index, grpo_run, "--train_steps", 2, "--resume"))
    assert str(e.value.code).startswith("error: --resume: ") and "holds no critic" in str(e.value.code)
    other = interrupted_copy(ppo_straight, 1, tmp_path / "other")
    with pytest.raises(SystemExit) as e:  # a critic of another model's shape (49,152 ids against 4,096)
        stepgrpo.main(ppo_args(wide_model_dir, tiny_index, other, "--train_steps", 2, "--resume"))
    msg = str(e.value.code)
    assert msg.startswith("error: --resume: ") and "its critic's" in msg and "\n" not in msg, msg
    assert sorted(p.name for p in other.glob("step_*")) == ["step_1"]  # nothing half-written
