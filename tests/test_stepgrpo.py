"""stepgrpo.py: per-step advantages on hand-made rewards, the loss against a direct computation, masking, and
2-rank torchrun runs with vLLM sync, exact resume and dev-picked checkpoints. Each of these mutations of the trainer
makes one of its tests fail (tests/fork_mutations.py --trainer applies each to a copy and runs that test):
   1. the ratio's high clip fixed at 0.2 whatever --clip_high
   2. the ratio's low clip fixed at 0.2 whatever --clip_low
   3. GSPO's sequence ratio dropped (every ratio per token)
   4. the TIS weights dropped from the loss
   5. the sampler's logprobs as old under --old_logprobs trainer
   6. the first minibatch share run in place of every other
   7. a share's old logprobs taken from the front of the list
   8. an optimizer step taken on a non-finite gradient
   9. an empty minibatch share where a rank has fewer rows
"""
import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from conftest import interrupted_copy
from one_launch import launch

import branches
import dataio
import prepare
import reward
import rollout
import groups
import grpo
import learner
import memory
import stepgrpo
import steprewards
import transcript

def sp(kind, step):
    return dict(kind=kind, step=step, start=0, end=1)

def test_group_advantages_normalise_each_step_against_the_same_step():
    # three samples: two retrieve once then stop, one retrieves twice (so route step 1 is a stop for the first two)
    spans = [[sp("route", 0), sp("answer", 0), sp("route", 1), sp("final", 1)],
             [sp("route", 0), sp("answer", 0), sp("route", 1), sp("final", 1)],
             [sp("route", 0), sp("answer", 0), sp("route", 1), sp("answer", 1), sp("route", 2), sp("final", 2)]]
    rewards = [[1.0, 1.0, 1.0, 0.2], [0.5, 0.0, 1.0, 0.2], [0.0, 1.0, 0.3, 0.0, 0.6, 0.2]]
    outcomes = [1.0, 0.0, 0.5]
    adv = grpo.group_advantages(spans, rewards, outcomes)
    n = lambda v: (np.array(v) - np.mean(v)) / (np.std(v, ddof=1) + 1e-4)
    R = n(outcomes)
    assert adv[0][0] == pytest.approx(n([1.0, 0.5, 0.0])[0] + R[0])          # route 0 across all three
    assert adv[1][1] == pytest.approx(n([1.0, 0.0, 1.0])[1] + R[1])          # answer 0 across all three
    assert adv[2][2] == pytest.approx(n([1.0, 1.0, 0.3])[2] + R[2])          # route 1: two stops and one retrieval
    assert adv[2][3] == pytest.approx(0.0 + R[2])                            # answer 1: only sample 2 has one -> 0
    assert adv[2][4] == pytest.approx(R[2]) and adv[0][3] == pytest.approx(R[0])  # finals all equal -> only R
    out = grpo.group_advantages(spans, rewards, outcomes, mode="outcome")
    assert all(a == pytest.approx(R[i]) for i, s in enumerate(out) for a in s)  # plain GRPO: one value per sample

def test_balance_kb_weighs_each_gold_route_class_equally():
    # 3 questions, max 3 steps: [text, text] -> text, text, stop; [table] -> table, stop; [t, t, image] (3 steps: no stop)
    q = lambda *kbs: dict(steps=[dict(sub_question=f"q{i}?", kb=k, answer="a") for i, k in enumerate(kbs)])
    qs = [q("text", "text"), q("table"), q("text", "text", "image")]
    f = steprewards.kb_balance(qs, max_steps=3)
    n = dict(text=4, stop=2, table=1, image=1)  # 8 route steps, 4 classes
    assert f == pytest.approx({c: 8 / (4 * k) for c, k in n.items()})
    assert sum(f[c] * k for c, k in n.items()) == pytest.approx(8)  # the total weight is unchanged
    # the flag: on by default (the recipe), --no-balance_kb turns it off
    base = ["--model", "m", "--data", "d"]
    assert [stepgrpo.get_args(base + a).balance_kb for a in ([], ["--no-balance_kb"])] == [True, False]
    # group_advantages scales only the per-step part of the keys given, never the outcome part
    spans = [[sp("route", 0), sp("answer", 0), sp("final", 0)]] * 2
    rewards, outcomes = [[1.0, 1.0, 0.2], [0.0, 0.0, 0.2]], [1.0, 0.0]
    plain = grpo.group_advantages(spans, rewards, outcomes)
    scaled = grpo.group_advantages(spans, rewards, outcomes, scale={("route", 0): 3.0})
    R = grpo.norm(outcomes)
    for i in range(2):
        assert scaled[i][0] - R[i] == pytest.approx(3.0 * (plain[i][0] - R[i]))
        assert scaled[i][1:] == plain[i][1:]

def test_identical_rewards_give_zero_advantage():
    spans = [[sp("route", 0), sp("final", 0)]] * 4
    adv = grpo.group_advantages(spans, [[0.7, 0.2]] * 4, [1.0] * 4)
    assert np.allclose(adv, 0.0)
    # exactly 0 (so main() can skip the row): the mean of 7 copies of 0.1 is not 0.1 in floating point
    assert np.mean([0.1] * 7) != 0.1 and grpo.norm([0.1] * 7).tolist() == [0.0] * 7

def verl_vanilla_loss(logp, old, adv, low, high):
    """verl's compute_policy_loss (vanilla, its dual clip left out), written out: pg_losses1 = -A ratio, pg_losses2 =
    -A clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high), the max of the two per token; pg_clipfrac: pg2 > pg1."""
    ratio = torch.exp(logp - old)
    pg1, pg2 = -adv * ratio, -adv * torch.clamp(ratio, 1 - low, 1 + high)
    return torch.maximum(pg1, pg2), (pg2 > pg1).float()

def test_loss_matches_a_direct_computation_and_verls_policy_loss():
    torch.manual_seed(0)
    N = 8
    logp, old, ref = -torch.rand(N) * 3, -torch.rand(N) * 3, -torch.rand(N) * 3
    adv = torch.randn(N)
    eps, beta = 0.2, 0.05
    per_tok = []
    for i in range(N):
        ratio = math.exp(logp[i] - old[i])
        a = adv[i].item()
        pg = -min(ratio * a, min(max(ratio, 1 - eps), 1 + eps) * a)
        d = (ref[i] - logp[i]).item()
        per_tok.append(pg + beta * (math.exp(d) - d - 1))
    loss, kl, low, high = grpo.grpo_loss(logp, old, ref, adv, (eps, eps), beta, N)
    assert loss.item() == pytest.approx(sum(per_tok) / N, rel=1e-5)
    assert torch.all(kl >= 0)
    ent = torch.rand(N) * 2  # the entropy bonus: -coef H_t on every token
    loss = grpo.grpo_loss(logp, old, ref, adv, (eps, eps), beta, N, ent, 1e-3)[0]
    assert loss.item() == pytest.approx(sum(p - 1e-3 * h for p, h in zip(per_tok, ent.tolist())) / N, rel=1e-5)
    # DAPO's clip-higher against verl's formula on hand-made ratios: 1.25 with A > 0 is inside [0.8, 1.28], 1.3 is
    # clipped above; 0.75 with A < 0 is clipped below, 0.75 with A > 0 is not (the min takes the unclipped term)
    ratios = torch.tensor([1.25, 1.3, 0.75, 0.75, 1.3, 1.0])
    A = torch.tensor([1.0, 1.0, -1.0, 1.0, -2.0, 0.5])
    lp, o = torch.log(ratios), torch.zeros(6)
    mine, low, high = grpo.grpo_loss(lp, o, lp, A, (0.2, 0.28), 0.0, 1.0)[0], *grpo.grpo_loss(lp, o, lp, A, (0.2, 0.28), 0.0, 1.0)[2:]
    verl, frac = verl_vanilla_loss(lp, o, A, 0.2, 0.28)
    assert mine.item() == pytest.approx(verl.sum().item(), rel=1e-6)
    assert (low + high).tolist() == frac.tolist() == [0.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    assert low.tolist() == [0, 0, 1, 0, 0, 0] and high.tolist() == [0, 1, 0, 0, 0, 0]
    # by hand: -1.25, -1.28, -(-0.8), -0.75, -(-2 x 1.3), -0.5
    assert mine.item() == pytest.approx(-1.25 - 1.28 + 0.8 - 0.75 + 2.6 - 0.5, rel=1e-6)

def test_the_clipped_gradient_stops_where_verls_does():
    # the gradient of each token's loss is 0 exactly where the clip acts, on both sides, as verl's
    lp = torch.log(torch.tensor([1.35, 1.25, 0.7, 0.9])).requires_grad_()
    A = torch.tensor([1.0, 1.0, -1.0, -1.0])
    grpo.grpo_loss(lp, torch.zeros(4), lp.detach(), A, (0.2, 0.28), 0.0, 1.0)[0].backward()
    assert lp.grad[0] == 0 and lp.grad[2] == 0 and lp.grad[1] == pytest.approx(-1.25) and lp.grad[3] == pytest.approx(0.9)

def test_gspo_sequence_ratio_is_the_geometric_mean_of_each_span():
    # GSPO: s_i = exp(mean_t(logp - old)) over sequence i, the same value on each of its tokens, and the gradient of
    # the token-mean loss -A s_i equals that of the sequence-level objective written directly
    sel = torch.tensor([[0, 1, 1, 0, 1, 1, 1], [1, 1, 0, 0, 0, 0, 0]]).bool()
    seq = grpo.spans_of(sel)
    assert seq.tolist() == [0, 0, 1, 1, 1, 2, 2]
    torch.manual_seed(1)
    old = -torch.rand(7)
    lp = (old + 0.1 * torch.randn(7)).requires_grad_()
    A = torch.tensor([1.0, 1.0, -0.5, -0.5, -0.5, 2.0, 2.0])
    s = grpo.policy_ratio(lp, old, seq)
    for i, idx in enumerate(([0, 1], [2, 3, 4], [5, 6])):
        assert torch.allclose(s[idx], torch.exp((lp - old)[idx].mean()).expand(len(idx)))
    grpo.grpo_loss(lp, old, lp.detach(), A, (1.0, 1.0), 0.0, 7.0, seq=seq)[0].backward()
    direct = lp.detach().clone().requires_grad_()
    total = sum(-A[idx[0]] * torch.exp((direct - old)[idx].mean()) * len(idx) for idx in ([0, 1], [2, 3, 4], [5, 6])) / 7
    total.backward()
    assert torch.allclose(lp.grad, direct.grad, atol=1e-6)
    # outside the clip: 3e-4 / 4e-4 (GSPO's), a sequence ratio of exp(0.01) is clipped for A > 0: no gradient
    lp2 = torch.tensor([0.01, 0.01]).requires_grad_()
    grpo.grpo_loss(lp2, torch.zeros(2), lp2.detach(), torch.ones(2), (3e-4, 4e-4), 0.0, 2.0, seq=torch.tensor([0, 0]))[0].backward()
    assert lp2.grad.abs().max() == 0

def test_truncated_importance_weights_and_dapos_overlong_shaping():
    # TIS: min(exp(old - sampler), C) per token, detached; the loss scales by it
    old, sampler = torch.log(torch.tensor([0.5, 0.2, 0.9])), torch.log(torch.tensor([0.25, 0.2, 0.1]))
    w = grpo.tis_weights(old, sampler, 2.0)
    assert w.tolist() == pytest.approx([2.0, 1.0, 2.0]) and not w.requires_grad
    lp, A = torch.zeros(3), torch.tensor([1.0, -1.0, 0.5])
    plain = grpo.grpo_loss(lp, lp, lp, A, (0.2, 0.2), 0.0, 1.0)[0]
    weighted = grpo.grpo_loss(lp, lp, lp, A, (0.2, 0.2), 0.0, 1.0, tis=w)[0]
    assert plain.item() == pytest.approx(-0.5) and weighted.item() == pytest.approx(-2.0 + 1.0 - 1.0)
    # DAPO's soft overlong punishment at L_max 64, L_cache 0.2 x 64 = 13: 0 up to 51 tokens, then linear to -1 at 64
    assert [grpo.overlong(n, 64, n == 64, "penalty")[0] for n in (40, 51, 52, 58, 64)] == \
        pytest.approx([0.0, 0.0, -1 / 13, -7 / 13, -1.0])
    assert grpo.overlong(64, 64, True, "mask") == (0.0, False) and grpo.overlong(64, 64, False, "mask") == (0.0, True)
    assert grpo.overlong(64, 64, True, "none") == (0.0, True)

def test_entropy_bonus_gradient_and_trainer_old_logprobs(tiny_model_dir):
    # --entropy_coef: the loss's gradient is the PPO gradient minus coef x the entropy's own gradient;
    # --old_logprobs trainer: the update's ratio uses the trainer's logprobs (ratio 1 before the first step), and
    # old_gap is the mean |sampler - trainer| over the policy tokens
    import trainutil
    own = trainutil.init_group(1)
    try:
        model = trainutil.load_sharded(tiny_model_dir, torch.device("cpu"), 1, bf16=False)
        # A < 0: against the sampler's logprobs (ratio ~exp(-6)) every token would be clipped below
        rows = [dict(ids=[5, 6, 7, 8], mask=[0, 1, 1, 1], old=[0.0, -4.2, -4.3, -4.4], adv=[0.0, -0.5, -0.5, -0.5])]
        ids, attn, pos, sel, old, adv = grpo.collate(rows, 0, torch.device("cpu"))

        def grad(coef, only_entropy=False):
            model.zero_grad()
            logp, ent = grpo.token_logprobs(model, ids, attn, sel, pos, entropy_grad=True)
            loss = -ent.sum() if only_entropy else grpo.grpo_loss(logp, old, logp.detach(), adv, (0.2, 0.2), 0.0, 3.0, ent,
                                                                        coef)[0]
            loss.backward()
            return trainutil.local(model.lm_head.weight.grad).clone()
        g0, g1, gh = grad(0.0), grad(0.5), grad(0.0, only_entropy=True)
        assert gh.abs().max() > 0 and torch.allclose(g1, g0 + 0.5 / 3.0 * gh, atol=1e-6)
        model.zero_grad()
        with torch.no_grad():
            mine = grpo.token_logprobs(model, ids, attn, sel, pos)[0]
        args = learner.UpdateConfig(old_logprobs="trainer")
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        micro = [learner.Micro(ids, attn, pos, sel, old, adv, {}, 1.0)]
        olds, refs, _, old_gap = learner.score_old(model, None, micro, args)
        sums, _ = learner.update(model, opt, micro, olds, refs, 3.0, args)
        # PPO's KL in the reward is against the trainer's own logprobs, also where the ratio takes the sampler's
        kl_args = dataclasses.replace(args, old_logprobs="sampler", kl_in_reward=0.001)
        k_old, _, k_mine, _ = learner.score_old(model, model, micro, kl_args)  # the policy as its own reference
        assert torch.equal(k_old[0], old) and torch.allclose(k_mine[0], mine)
    finally:
        if own:
            torch.distributed.destroy_process_group()
    assert old_gap.item() == pytest.approx((mine - old).abs().sum().item(), rel=1e-6)
    assert sums["clip_low"].item() == sums["clip_high"].item() == 0  # ratio exp(logp - logp) = 1, although the sampler's logprobs are far off

def test_recomputed_activations_give_the_same_gradients_and_the_main_job_recomputes(tiny_model_dir, tiny_index, tmp_path):
    # --activation_checkpointing (the main job's Step-GRPO passes it: its update's peak): each layer runs again in the
    # backward (fails with the flag ignored: one forward a layer) and every gradient is the kept activations' to the bit
    import trainutil
    from conftest import make_demo
    cpu, grads, calls = torch.device("cpu"), [], []
    rows = [dict(ids=[5, 6, 7, 8, 9], mask=[0, 1, 1, 1, 1], old=[0.0, -4.2, -4.3, -4.4, -4.5], adv=[0.0] + [0.5] * 4),
            dict(ids=[9, 8, 7], mask=[0, 1, 1], old=[0.0, -4.1, -4.0], adv=[0.0, -0.5, -0.5])]
    own = trainutil.init_group(1)
    try:
        ids, attn, pos, sel, old, adv = grpo.collate(rows, 0, cpu)
        for recompute in (False, True):
            model = trainutil.load_sharded(tiny_model_dir, cpu, 1, recompute, bf16=False)
            n = []
            model.model.layers[0].register_forward_pre_hook(lambda *a: n.append(1))  # the recomputation stops early
            logp, ent = grpo.token_logprobs(model, ids, attn, sel, pos, entropy_grad=True)
            grpo.grpo_loss(logp, old, logp.detach(), adv, (0.2, 0.2), 0.0, 6.0, ent, 0.1)[0].backward()
            grads.append({k: p.grad.clone() for k, p in model.named_parameters()})
            calls.append(len(n))
    finally:
        if own:
            torch.distributed.destroy_process_group()
    assert calls == [1, 2]
    assert all(torch.equal(grads[0][k], grads[1][k]) and grads[0][k].abs().max() > 0 for k in grads[0])
    plan = make_demo(tmp_path, tiny_model_dir, tiny_index, plan=True)[1]
    assert [line for line in plan.replace("\\\n", " ").splitlines()
            if " stepgrpo.py " in line and "--activation_checkpointing" in line]

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_logprobs_equal_the_whole_ones_bit_for_bit(tiny_model_dir, monkeypatch, dtype):
    # grpo.token_logprobs' fp32 softmax work a chunk of rows at a time (checkpointed under autograd): the logprobs,
    # the entropies and every weight's gradient equal those of all rows in one chunk, exactly, with a temperature,
    # suppressed tokens and the entropy's gradient; without autograd too (the old and the reference logprobs)
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=dtype)
    ids = torch.randint(5, model.config.vocab_size, (2, 97), generator=torch.Generator().manual_seed(0))
    sel = torch.rand(2, 96, generator=torch.Generator().manual_seed(1)) < 0.7  # 2 x 96 positions, ~134 selected
    def scored(chunk):
        monkeypatch.setattr(grpo, "LOGIT_CHUNK", chunk)
        model.zero_grad()
        logp, ent = grpo.token_logprobs(model, ids, torch.ones_like(ids), sel, temperature=0.7, entropy_grad=True,
                                        suppress=[3, 7])
        (logp.sum() + 0.1 * ent.sum()).backward()
        with torch.no_grad():
            nograd = grpo.token_logprobs(model, ids, torch.ones_like(ids), sel, temperature=0.7, suppress=[3, 7])
        return [logp, ent, *nograd] + [p.grad.clone() for p in model.parameters()]
    whole, chunked = scored(10**6), scored(13)
    assert whole[0].shape == (int(sel.sum()),)
    assert all(torch.equal(a, b) for a, b in zip(whole, chunked))

def test_only_policy_tokens_reach_the_loss(tiny_model_dir):
    # token_logprobs gives exactly the logprobs of the selected (policy) tokens, as a full forward would
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    seqs = [dict(ids=[5, 6, 7, 8, 9], mask=[0, 0, 1, 1, 0], old=[0.0] * 5, adv=[0.0, 0.0, 2.0, 2.0, 0.0]),
            dict(ids=[5, 9, 11], mask=[0, 1, 1], old=[0.0, -0.1, -0.2], adv=[0.0, -1.0, -1.0])]
    ids, attn, pos, sel, old, adv = grpo.collate(seqs, pad_id=0, device="cpu")
    assert pos is None and sel.tolist() == [[False, True, True, False], [True, True, False, False]]
    assert old.tolist() == pytest.approx([0.0, 0.0, -0.1, -0.2]) and adv.tolist() == [2.0, 2.0, -1.0, -1.0]
    logp, ent = grpo.token_logprobs(model, ids, attn, sel)
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=attn).logits[:, :-1].log_softmax(-1)  # [B, T-1, V]
    want = [full[0, 1, 7], full[0, 2, 8], full[1, 0, 9], full[1, 1, 11]]
    assert torch.allclose(logp, torch.stack(want), atol=1e-5) and ent.shape == (4,)

def test_packed_group_scores_like_separate_rows(tiny_model_dir):
    # a group's completions packed behind one copy of their prompt give the same logprobs, advantages and loss as one
    # row per completion, with padding in the batch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa")
    g = torch.Generator().manual_seed(0)
    rand = lambda n: torch.randint(3, 100, (n,), generator=g).tolist()
    groups = [(rand(9), [(rand(3), [-0.5, -1.0, -1.5]), (rand(1), [-0.2]), (rand(4), [-0.1, -0.3, -0.2, -0.4])], [1.0, -0.5, 0.25]),
              (rand(4), [(rand(2), [-0.7, -0.8]), (rand(5), [-1.0] * 5)], [-2.0, 2.0])]
    rows = [dict(ids=p + c, mask=[0] * len(p) + [1] * len(c), old=[0.0] * len(p) + lps, adv=[a] * (len(p) + len(c)))
            for p, group, adv in groups for (c, lps), a in zip(group, adv)]
    packed = [grpo.pack_group(p, group, adv) for p, group, adv in groups]
    assert len(packed[0]["ids"]) == 8 + 3 * 1 + 3 + 1 + 4
    A, B = grpo.collate(rows, 0, "cpu"), grpo.collate(packed, 0, "cpu")
    assert A[2] is None and B[1].shape == (2, 1, 19, 19)
    assert B[2][0].tolist() == list(range(12)) + [8, 9] + list(range(8, 13))  # each branch continues the prompt
    assert B[2][1].tolist()[:12] == [0, 1, 2, 3, 4, 5, 3, 4, 5, 6, 7, 8]
    for k in (4, 5):  # old, adv
        assert torch.equal(A[k], B[k])
    with torch.no_grad():
        la, ea = grpo.token_logprobs(model, A[0], A[1], A[3], A[2])
        lb, eb = grpo.token_logprobs(model, B[0], B[1], B[3], B[2])
    assert torch.allclose(la, lb, atol=1e-5) and torch.allclose(ea, eb, atol=1e-4)
    wrong = grpo.token_logprobs(model, B[0], torch.ones_like(B[0]), B[3])[0]  # the packed row with a plain causal mask
    assert not torch.allclose(la, wrong, atol=1e-3)
    loss = lambda L: grpo.grpo_loss(L, A[4] - 0.1, L, A[5], (0.2, 0.2), 0.0, len(la))[0]
    assert loss(la).item() == pytest.approx(loss(lb).item(), abs=1e-6)

def test_flex_block_mask_scores_packed_groups_as_the_dense_tree_mask(tiny_model_dir):
    # --flex_attention: collate's BlockMask through transformers' FlexAttention gives the dense tree mask's logprobs
    # (forward only: FlexAttention has no backward on CPU; tests/test_gpu.py compares gradients on CUDA, through the
    # compiled kernels; here eager, its mask_mod on every pair: compiling it took ~20 s of a fresh machine's suite),
    # and it skips blocks: completions of 150 tokens, 128-token blocks, so a later branch's queries never visit an
    # earlier branch
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask
    from transformers import AutoModelForCausalLM
    load = lambda attn: AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation=attn)
    g = torch.Generator().manual_seed(0)
    rand = lambda n: torch.randint(3, 100, (n,), generator=g).tolist()
    rows = [grpo.pack_group(rand(40), [(rand(150 + 9 * i), [-1.0] * (150 + 9 * i)) for i in range(3)], [1.0, -1.0, 0.5]),
            grpo.pack_group(rand(70), [(rand(120), [-1.0] * 120), (rand(5), [-1.0] * 5)], [1.0, -1.0])]
    ids, dense, pos, sel, _, _ = grpo.collate(rows, 0, "cpu")
    flex = grpo.collate(rows, 0, "cpu", flex=True)[1]
    T = ids.shape[1]  # a causal block mask lets branches see each other
    causal = create_block_mask(lambda b, h, q, kv: kv <= q, 2, None, T, T, device="cpu")
    assert isinstance(flex, BlockMask) and flex.sparsity() > causal.sparsity() + 5  # % of blocks skipped
    with torch.no_grad(), torch.compiler.set_stance("force_eager"):
        want = grpo.token_logprobs(load("sdpa"), ids, dense, sel, pos)[0]
        model = load("flex_attention")
        got = grpo.token_logprobs(model, ids, flex, sel, pos)[0]
        wrong = grpo.token_logprobs(model, ids, causal, sel, pos)[0]
    assert (got - want).abs().max() < 1e-5 and (wrong - want).abs().max() > 1e-3

def test_rows_end_to_end_score_as_padded_micro_batches(tiny_model_dir):
    # --micro_tokens: a step's packed groups end to end, one row a micro-batch (merge_rows), give every policy token the
    # logprob, old logprob and advantage the padded micro-batches of --micro_batch give it, with the same denominator;
    # without doc in the mask a row would see the rows before it
    import trainutil
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa")
    g = torch.Generator().manual_seed(0)
    rand = lambda n: torch.randint(3, 100, (n,), generator=g).tolist()
    rows = [grpo.pack_group(rand(p), [(rand(c + i), [-1.0 - i] * (c + i)) for i in range(3)], [1.0, -0.5, 0.25])
            for p, c in ((9, 4), (20, 2), (5, 7), (14, 3))]
    cpu = torch.device("cpu")
    scored = lambda micro: torch.cat([grpo.token_logprobs(model, m.ids, m.attn, m.sel, m.pos)[0] for m in micro])
    cat = lambda micro, key: torch.cat([getattr(m, key) for m in micro])
    own = trainutil.init_group(1)
    try:
        padded, d1, _ = learner.micro_batches(rows, learner.UpdateConfig(micro_batch=2), 0, cpu)
        merged, d2, _ = learner.micro_batches(rows, learner.UpdateConfig(micro_tokens=60), 0, cpu)
    finally:
        if own:
            torch.distributed.destroy_process_group()
    assert [m.ids.shape[0] for m in merged] == [1] * len(merged) and len(merged) == 3 and d1 == d2
    assert sum(m.ids.numel() for m in merged) == sum(len(r["ids"]) for r in rows)  # no padding
    for key in ("logp_sampler", "adv"):
        assert torch.equal(cat(padded, key), cat(merged, key))
    with torch.no_grad():
        want, got = scored(padded), scored(merged)
        one = grpo.merge_rows(rows)
        leaky = grpo.collate([dict(one, doc=[0] * len(one["ids"]))], 0, cpu)
        wrong = grpo.token_logprobs(model, leaky[0], leaky[1], leaky[3], leaky[2])[0]
    assert (got - want).abs().max() < 1e-5 and (wrong - want).abs().max() > 1e-3

def test_zero_advantage_rows_add_no_gradient(tiny_model_dir):
    # main() skips rows whose advantages are all 0 when --kl_coef is 0, keeping the full batch's denominator: the
    # gradient must equal the one over every row. With a KL term such a row does move the policy, so it is kept
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    live = [dict(ids=[5, 6, 7, 8], mask=[0, 1, 1, 1], old=[0.0, -4.0, -4.5, -4.0], adv=[0.0, 1.0, 1.0, 1.0]),
            dict(ids=[5, 9, 11], mask=[0, 1, 1], old=[0.0, -4.2, -4.4], adv=[0.0, -1.0, -1.0])]
    dead = dict(ids=[5, 12, 13, 14, 15], mask=[0, 0, 1, 1, 1], old=[0.0, 0.0, -4.1, -4.3, -4.6], adv=[0.0] * 5)
    def grads(rows, kl_coef, entropy_coef=0.0):
        model.zero_grad()
        ids, attn, pos, sel, old, adv = grpo.collate(rows, 0, "cpu")
        logp, ent = grpo.token_logprobs(model, ids, attn, sel, pos, entropy_grad=True)
        grpo.grpo_loss(logp, old, old - 0.3, adv, (0.2, 0.2), kl_coef, 8, ent, entropy_coef)[0].backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])
    full = grads(live + [dead], 0.0)
    assert full.abs().max() > 1e-4 and torch.allclose(grads(live, 0.0), full, atol=1e-7)
    assert not torch.allclose(grads(live, 0.1), grads(live + [dead], 0.1), atol=1e-5)
    assert not torch.allclose(grads(live, 0.0, 0.1), grads(live + [dead], 0.0, 0.1), atol=1e-5)
    # micro_batches keeps such a row when a KL or an entropy term gives it a gradient, and only then
    live_rows = lambda **kw: len(learner.micro_batches(live + [dead], learner.UpdateConfig(**{"micro_batch": 8, **kw}),
                                                       0, torch.device("cpu"))[0][0].logp_sampler)
    import trainutil
    own = trainutil.init_group(1)
    try:
        assert live_rows() == 5 and live_rows(kl_coef=0.1) == live_rows(entropy_coef=1e-3) == 8
    finally:
        if own:
            torch.distributed.destroy_process_group()

def test_the_first_sync_is_checked_and_stops_above_the_tolerance(tiny_model_dir, monkeypatch):
    # a process's first sync is checked and logged as sync_max_diff, later ones only at a checkpoint (check); an engine
    # that missed the update
    # (a sync that did nothing) is off by more than the tolerance and the run stops
    import engines
    import trainutil
    args = stepgrpo.get_args(["--dtype", "fp32", "--lr", "1e-2"])
    uniform = -math.log(json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"])  # the random policy's
    row = dict(ids=[5, 6, 7, 8], mask=[0, 1, 1, 1], old=[0.0] + [uniform] * 3, adv=[0.0, 1.0, 1.0, 1.0])
    own = trainutil.init_group(1)
    try:
        model = trainutil.load_sharded(tiny_model_dir, torch.device("cpu"), 1, bf16=False, tree_mask=True)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
        engine, peak = engines.HFEngine(tiny_model_dir), memory.PeakMemory()
        assert trainutil.sync_tol(args.dtype, engine) == 1e-3 and trainutil.sync_tol("bf16", engine) == 0.2

        def train(check=False):  # the loop's update and weight sync on one row
            learner.learn(model, None, opt, None, [row], stepgrpo.update_config(args), 0, torch.device("cpu"), None, 0,
                          False, peak, {})
            return trainutil.sync_weights(model, engine, [row], 0, peak, check, args.dtype)
        step = lambda: train()
        first, second = step(), step()
        assert first["sync_mean_diff"] <= first["sync_max_diff"] < 1e-4 and "sync_max_diff" not in second
        checked = [train(check=True)]
        assert checked[-1]["sync_max_diff"] < 1e-4  # a checkpoint's step
        peak = memory.PeakMemory()  # a new process (a resumed run): its first sync is checked again
        monkeypatch.setattr(engine, "sync_weights", lambda weights: None)  # the engine misses the update
        missed = "^error: after the weight sync the engine's logprobs differ .* on average \\(tolerance 0.001"
        with pytest.raises(SystemExit, match=missed):
            step()
    finally:
        if own:
            torch.distributed.destroy_process_group()

@pytest.mark.slow
def test_an_update_from_hf_samples_equals_the_one_from_the_same_samples_scored_by_vllm(tiny_model_dir, tiny_index):
    # --backend hf (setup_policy's HFEngine) samples; the update sees only the samples and their logprobs, and vLLM's
    # logprobs of the same tokens equal transformers', so one update from either set of rows gives the same weights
    # (while old logprobs shifted by 0.05, 500x the logprob tolerance, would not)
    import dataio
    import engines
    import retrievers
    import trainutil
    args = stepgrpo.get_args(["--model", str(tiny_model_dir), "--backend", "hf", "--dtype", "fp32", "--micro_batch", "4"])
    own, cpu = trainutil.init_group(1), torch.device("cpu")
    vllm = engines.VLLMEngine(tiny_model_dir, max_model_len=2048)
    try:
        policy, *_ = stepgrpo.setup_policy(args, tiny_model_dir, tiny_model_dir, False, None, 0, 1, cpu, print)
        model, hf = policy.model, policy.engine
        assert isinstance(hf, engines.HFEngine) and hf.max_len == engines.MAX_LEN
        qs = dataio.load_questions(tiny_index, "train")[:2]
        _, prefixes = rollout.golden_prefixes(hf.tok, retrievers.Retriever(tiny_index, "bm25"), qs)
        groups = []  # (prompt, the HF samples with their logprobs, the same samples with vLLM's)
        for _, _, prefix, _ in prefixes[:2]:
            outs = hf.generate([prefix] * 4, 12, temperature=1.0, seed=len(groups))
            theirs = [vllm.prompt_logprobs(prefix + ids)[len(prefix) - 1:] for ids, _ in outs]
            assert all(torch.allclose(torch.tensor(lps), torch.tensor(v), atol=1e-4) for (_, lps), v in zip(outs, theirs))
            groups.append((prefix, outs, [(ids, v) for (ids, _), v in zip(outs, theirs)]))

        def updated(k, shift=0.0, model=None):
            rows = [grpo.pack_group(p, [(ids, [lp + shift for lp in lps]) for ids, lps in g[k]], [1.0, -1.0, 0.5, -0.5])
                    for p, *g in groups]
            model = model or trainutil.load_sharded(tiny_model_dir, cpu, 1, bf16=False, tree_mask=True)
            cfg = stepgrpo.update_config(args)
            micro, denom, _ = learner.micro_batches(rows, cfg, 0, cpu)
            learner.update(model, torch.optim.SGD(model.parameters(), lr=1.0), micro, *learner.score_old(model, None,
                            micro, cfg)[:2], denom, cfg)
            return {n: trainutil.full(p).clone() for n, p in model.named_parameters()}
        a, b, c = updated(0, model=model), updated(1), updated(1, shift=0.05)
    finally:
        vllm.close()  # its teardown destroys the default process group too (as at the end of stepgrpo.main)
        if own and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    base = load_file(tiny_model_dir / "model.safetensors")
    gap = lambda x, y: max((x[k] - y[k]).abs().max().item() for k in base)
    assert gap(a, base) > 1e-3 and gap(a, b) < 1e-5 and gap(b, c) > 1e-4

#### end to end: 2-rank torchrun runs with vLLM sync (sharing their launches: tests/one_launch.py), torchrun's refused
#### restarts (the real command line); exact resume and the dev pick (single-process runs, in this process)

ROOT = Path(__file__).resolve().parents[1]

def common(model, data, out):
    # the tiny random policy cannot write the step format, so every reward and advantage is 0: the entropy bonus and
    # the KL term (once the policy has moved away from the reference) are what change the weights here
    return ["--model", str(model), "--data", str(data), "--out", str(out), "--batch_questions", "2", "-n", "2",
            "--retriever", "bm25", "--eval_questions", "0", "--lr", "1e-2", "--entropy_coef", "0.1",
            "--kl_coef", "0.1", "--save_every", "1"]

def records(out):
    return [json.loads(l) for l in open(Path(out) / "log.jsonl")]

MODES = [("teacher_prefix", "transcript", "vllm"), ("onpolicy", "transcript", "vllm"), ("onpolicy", "released", "hf"),
         ("branch", "transcript", "vllm")]

@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory, tiny_model_dir, tiny_index):
    """The 2-rank runs of 2 steps (fp32, a checkpoint a step, so the engine is checked against the trainer after every
    sync) of the sync test's cases and the zero-advantage test, in two launches (tests/one_launch.py): the vLLM
    engine's, then the HF engine's where vllm cannot be imported (--backend hf needs none of it). -> {case: run folder}.
    (A killed rank restarting a job with a vLLM engine: tests/test_ppo.py's killed PPO job, whose critic is restored
    too.)"""
    root = tmp_path_factory.mktemp("two-ranks")
    runs = {}
    for mode, structure, engine in MODES:
        policy = tiny_model_dir  # teacher_prefix, the default rollout: the model as it is
        if mode != "teacher_prefix":  # the tiny model, marked as trained on `structure` (stepgrpo.py takes its format)
            policy = root / f"policy-{structure}"
            if not policy.exists():
                shutil.copytree(tiny_model_dir, policy)
                (policy / "transcript.json").write_text(json.dumps(dict(structure=structure, max_pairs=1, max_rets=1)))
        runs[mode, structure, engine] = common(policy, tiny_index, root / f"{mode}-{structure}-{engine}") + [
            "--rollout", mode, "--train_steps", "2", "--dtype", "fp32", "--backend", engine]
    skip = common(tiny_model_dir, tiny_index, root / "skip") + ["--train_steps", "2", "--dtype", "fp32", "--backend", "hf"]
    skip[skip.index("--kl_coef") + 1], skip[skip.index("--entropy_coef") + 1] = "0", "0"
    runs["skip"] = skip
    for engine, env in (("vllm", None), ("hf", hidden_vllm(root))):  # a run's last flag: its --backend
        launch([("stepgrpo", args) for args in runs.values() if args[-1] == engine], env=env)
    return {case: Path(args[args.index("--out") + 1]) for case, args in runs.items()}

@pytest.fixture(scope="module")
def straight(tmp_path_factory, tiny_model_dir, tiny_index):
    """One single-process run of 3 steps, in this process like the runs compared with it (the resume and the dev-eval
    tests'; one process has no start-up to pay, and rounds the same for all three): their uninterrupted run."""
    out = tmp_path_factory.mktemp("straight") / "run"
    stepgrpo.main(common(tiny_model_dir, tiny_index, out) + ["--train_steps", "3"])
    return out

def hidden_vllm(tmp_path):
    """An environment in which `import vllm` fails (a stand-in package first on PYTHONPATH), as on a machine without it."""
    hide = tmp_path / "novllm" / "vllm"
    hide.mkdir(parents=True)
    (hide / "__init__.py").write_text("raise ImportError('vllm is hidden in this test')\n")
    return dict(os.environ, PYTHONPATH=str(hide.parent))

@pytest.mark.parametrize("mode,structure,engine", MODES)
@pytest.mark.slow
def test_two_ranks_sync_the_engine_after_every_update(two_rank_runs, tiny_model_dir, mode, structure, engine):
    out = two_rank_runs[mode, structure, engine]
    recs = records(out)
    assert [r["step"] for r in recs] == [1, 2]
    assert all(r["sync_max_diff"] < 1e-4 for r in recs)  # checked at every checkpoint: the engine scores like the trainer
    # the rollouts' forward work (bench/flops.py --runs): with no row skipped, the update's rows are the rollouts, a
    # packed teacher-prefix group with the prompt's last token once more a completion (grpo.pack_group; -n 2)
    extra = lambda r: (2 - 1) * r["update_rows"] if mode == "teacher_prefix" else 0
    assert all(r["rollout_tokens"] + extra(r) == r["update_tokens"] > 0 for r in recs if structure == "transcript"
               and r["skipped"] == 0 and mode != "branch")
    # branch: every trajectory ends at its first (malformed) step, so a group's row is the prefix once and the n
    # branched steps, while the rollouts also generated the sampled trajectory's own step (rollout_generated counts it)
    assert all(r["rollout_tokens"] - r["rollout_generated"] + (2 - 1) * r["update_rows"] == r["update_tokens"] -
               r["update_policy"] and r["rollout_generated"] > r["update_policy"] > 0 for r in recs
               if mode == "branch" and r["skipped"] == 0)
    assert all(0 < r["rollout_generated"] < r["rollout_tokens"] for r in recs)
    assert recs[1]["kl"] > 0  # the policy moved away from the frozen reference
    before, after = load_file(tiny_model_dir / "model.safetensors"), load_file(out / "final" / "model.safetensors")
    assert max((before[k] - after[k]).abs().max().item() for k in before) > 1e-4
    assert (out / "curves.png").stat().st_size > 10_000

@pytest.mark.slow
def test_two_ranks_skip_zero_advantage_rows_without_a_kl_term(two_rank_runs, tiny_model_dir):
    # the tiny random policy earns 0 advantage everywhere: with --kl_coef 0 every row is skipped, yet both ranks still
    # run one (zero-weight) micro-batch so FSDP's collectives match, and without an entropy bonus nothing moves (the
    # HF engine: the engine is not what this checks)
    out = two_rank_runs["skip"]
    assert [r["skipped"] for r in records(out)] == [1.0, 1.0]
    before, after = load_file(tiny_model_dir / "model.safetensors"), load_file(out / "final" / "model.safetensors")
    assert all(torch.equal(before[k], after[k]) for k in before)

@pytest.mark.slow
def test_resume_continues_exactly(straight, tmp_path, tiny_model_dir, tiny_index):
    resumed = interrupted_copy(straight, 1, tmp_path / "resumed")
    stepgrpo.main(common(tiny_model_dir, tiny_index, resumed) + ["--train_steps", "3", "--resume"])
    a, b = load_file(straight / "final" / "model.safetensors"), load_file(resumed / "final" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    ra, rb = records(straight), records(resumed)
    assert [r["step"] for r in rb] == [1, 2, 3]
    for i in (1, 2):
        for key in ("loss", "kl", "entropy", "tokens", "grad_norm"):
            assert ra[i][key] == pytest.approx(rb[i][key], rel=1e-6, abs=1e-9), key

@pytest.mark.slow
def test_resume_continues_a_branch_run_exactly(tmp_path, tiny_model_dir, tiny_index):
    # --rollout branch: the branch points and the branches' sampling come from the step's seed alone
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    args = lambda out: common(tiny_model_dir, tiny_index, out) + ["--train_steps", "3", "--rollout", "branch"]
    stepgrpo.main(args(straight))
    stepgrpo.main(args(interrupted_copy(straight, 1, resumed)) + ["--resume"])
    a, b = load_file(straight / "final" / "model.safetensors"), load_file(resumed / "final" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    ra, rb = records(straight), records(resumed)
    assert [r["step"] for r in rb] == [1, 2, 3] and all(r["skipped"] == 0 for r in ra)
    for i in (1, 2):
        for key in ("loss", "kl", "entropy", "tokens", "grad_norm", "rollout_generated", "update_rows"):
            assert ra[i][key] == pytest.approx(rb[i][key], rel=1e-6, abs=1e-9), key

def test_an_interrupted_checkpoint_is_never_resumed_from(tmp_path, tiny_model_dir):
    # a save killed while writing leaves .step_2.tmp (or, killed between the rename and `latest`, a whole step_2 that
    # `latest` does not name yet): --resume auto takes the checkpoint `latest` names, never the newest folder
    import shutil

    import trainutil
    out = tmp_path / "run"
    assert trainutil.resolve_start(str(tiny_model_dir), out, "auto") == (tiny_model_dir,) * 2 + (False,)  # nothing yet
    shutil.copytree(tiny_model_dir, out / "step_1")
    (out / "step_1" / "trainer_state.pt").write_bytes(b"")
    (out / "latest").write_text("step_1\n")
    (out / ".step_2.tmp").mkdir()
    assert trainutil.resolve_start(str(tiny_model_dir), out, "auto") == (out / "step_1", out / "step_1", True)
    shutil.copytree(out / "step_1", out / "step_2")
    assert trainutil.resolve_start(str(tiny_model_dir), out, "auto") == (out / "step_1", out / "step_1", True)

@pytest.mark.slow
def test_max_restarts_with_the_shared_rendezvous_store_is_refused(tmp_path, tiny_model_dir, tiny_index):
    # one worker: each refuses alone, before any work
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1", "--max-restarts", "1",
           str(ROOT / "stepgrpo.py")] + common(tiny_model_dir, tiny_index, tmp_path / "run")
    env = {k: v for k, v in os.environ.items() if k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    assert r.returncode != 0 and "error: torchrun --max-restarts needs TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in r.stderr

def teacher_setup(tiny_index, spans="route"):
    from transformers import AutoTokenizer

    import dataio
    import retrievers
    tok = AutoTokenizer.from_pretrained(prepare.DEFAULT_MODEL)
    qs = dataio.load_questions(tiny_index, "train")[:6]
    ret = retrievers.Retriever(tiny_index, "bm25")
    # stepgrpo's own defaults (3 steps, top 3, T 1, one pair and one retriever a step, kb_last, transcript), so a new
    # flag reaches these tests without a hand-kept copy of the argument list
    args = stepgrpo.get_args(["--model", "m", "--data", "d", "-n", "2", "--teacher_spans", spans,
                              "--route_credit", "whole", "--adv_std"])
    return tok, qs, ret, args, rollout.golden_prefixes(tok, ret, qs)[1]

def test_teacher_prefix_groups_with_the_gold_policy(tiny_index, encoder):
    # GoldPolicy as the engine writes the gold step at every golden prefix: one packed group per span kept, each
    # completion parses and routes to the gold KB with the full route reward, so every advantage is 0
    for spans in ("all", "route"):
        tok, qs, ret, args, prefixes = teacher_setup(tiny_index, spans)
        n_route = sum(sp["kind"] == "route" for _, sp, _, _ in prefixes)
        seqs, st, _ = stepgrpo.groups.teacher_prefix_batch(rollout.GoldPolicy(tok, qs), ret, qs, stepgrpo.rollout_config(args),
                                                        encoder.encode, steprewards.Weights(), seed=0)
        groups = len(prefixes) if spans == "all" else n_route
        assert len(seqs) == groups and sum(1 + s["seg"][-1] for s in seqs) == 2 * groups
        assert st["kb_acc"] == [1.0] * 2 * n_route and st["route_r"] == pytest.approx([1.2] * 2 * n_route)
        # one per sampled retrieval (every route prefix but each question's stop): the gold never re-asks
        assert st["reask"] == [0.0] * (2 * n_route - 2 * len(qs))
        assert (st["answer_r"] == []) == (spans == "route")
        assert all(a == 0.0 for s in seqs for a in s["adv"])
        completions = [tok.decode([t for t, m in zip(s["ids"], s["mask"]) if m]) for s in seqs]
        assert (spans == "route") == all("</ret>" in c and "<answer>" not in c for c in completions)
        # unanimous groups: no spread in the KB choice, no group with mixed choices
        assert st["kb_entropy"] == [0.0] * n_route and st["kb_mixed"] == [0.0] * n_route

def test_the_policy_engines_kv_cache_holds_a_steps_rollouts_at_once(tiny_model_dir, tiny_index, encoder):
    # stepgrpo.py sizes its vLLM engine's KV cache for a rank's step (RolloutConfig.kv_tokens): here the main job's 3
    # questions x 8 completions of every golden prefix, the tiny random policy writing each to its token limit (the
    # most a step can hold); the cache never fills, so no request waited or was recomputed
    import engines
    import retrievers
    args = stepgrpo.get_args(["--batch_questions", "3"])
    run = stepgrpo.rollout_config(args)
    T = rollout.TRAJECTORY_TOKENS + 2 * 3 * rollout.EVIDENCE_TOKENS  # --topk 3: two more documents a step
    assert run.n == 8 and run.kv_tokens(3) == 3 * (T + 8 * 4 * (32 + 96))  # a trajectory, 8 completions a step
    assert run.kv_tokens(3, dev_questions=40) == 40 * T  # the dev evaluation's, if more
    onpolicy = stepgrpo.rollout_config(stepgrpo.get_args(["--rollout", "onpolicy"]))
    assert onpolicy.kv_tokens(3) == 3 * 8 * T and onpolicy.kv_tokens(30) == 64 * T  # at most max_active in flight
    qs = dataio.load_questions(tiny_index, "train")[:3]
    engine = engines.VLLMEngine(tiny_model_dir, kv_tokens=run.kv_tokens(len(qs)))
    try:
        cache = engine.kv_manager.block_pool.num_gpu_blocks * engines.CPU_BLOCK
        assert cache >= run.kv_tokens(len(qs)) and engine.kv_used() == 0.0
        _, st, _ = stepgrpo.groups.teacher_prefix_batch(engine, retrievers.Retriever(tiny_index, "bm25"), qs, run,
                                                        encoder.encode, steprewards.Weights(), seed=0)
        used = engine.kv_used()
        held = engine.held()  # the KV cache off its tensors; the engine's start-up growth beside it
        assert held["KV cache"] == cache * engines.kv_bytes_per_token(tiny_model_dir, "float32")
        assert held.keys() == {"KV cache", "engine (weights, buffers)"}
        assert st["rollout_generated"] > 0.9 * 8 * 96 * len(st["route_r"]) / 8  # completions at their limit
        assert 0.0 < used < 1.0, used
        print(f"KV cache {cache} tokens, {used:.0%} of it used at most; the step's tokens {st['rollout_tokens']}")
    finally:
        engine.close()

def test_split_credit_puts_the_kb_half_on_the_ret_tokens_only():
    # two completions that differ only in the KB: the wording's reward is equal, so the tokens before <ret> get 0 and
    # the decision tokens get the whole relative advantage
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(prepare.DEFAULT_MODEL)
    texts = [reward.format_route("The next fact to look up.", [("Where was Ly Normi born?", kb)]) for kb in ("text", "table")]
    group = [(tok.encode(t, add_special_tokens=False), None) for t in texts]
    cut = [grpo.ret_start(tok, ids) for ids, _ in group]
    for (ids, _), k in zip(group, cut):
        assert "<ret>" not in tok.decode(ids[:k]) and "<ret>" in tok.decode(ids[:k + 1])
        assert tok.decode(ids[k:]).lstrip(">").startswith(("Text", "Table", "\nText", "\nTable"))
    adv = grpo.split_credit(tok, group, [1.2, 0.7], [0.5, 0.0], std=True, scale=1.0)
    for a, (ids, _), k, sign in zip(adv, group, cut, (1, -1)):
        assert len(a) == len(ids) and a[:k] == [0.0] * k
        assert a[k:] == pytest.approx([sign * 0.25 / (0.5 ** 0.5 / 2 + 1e-4)] * (len(ids) - k))
    assert grpo.split_credit(tok, group, [1.2, 0.7], [0.5, 0.0], std=False, scale=2.0)[0][-1] == pytest.approx(0.5)
    # a completion without <ret> (malformed): all its tokens are wording
    assert grpo.ret_start(tok, tok.encode("<think>no route", add_special_tokens=False)) == len(
        tok.encode("<think>no route", add_special_tokens=False))

def test_choice_entropy_of_a_group_in_bits():
    assert grpo.choice_entropy([("text",)] * 8) == 0.0
    assert grpo.choice_entropy([("text",), ("table",)] * 4) == pytest.approx(1.0)
    # four equally likely outcomes, a malformed route (None) one of them: 2 bits
    assert grpo.choice_entropy([("text",), ("table",), ("stop",), None] * 2) == pytest.approx(2.0)
    assert grpo.choice_entropy([("text",)] * 3 + [("image",)]) == pytest.approx(0.811278, abs=1e-6)

def test_teacher_prefix_leaves_out_golden_prefixes_that_do_not_fit(tiny_index, encoder):
    # an engine whose context holds about half the route prefixes plus a routing step: only those make groups (each
    # completion parses, full reward), the others are logged as overflows and never sent
    tok, qs, ret, args, prefixes = teacher_setup(tiny_index)
    lens = sorted(len(p) for _, sp, p, _ in prefixes if sp["kind"] == "route")
    eng = rollout.GoldPolicy(tok, qs)
    budget = groups.step_budget(tok, stepgrpo.rollout_config(args).steps, "route")[0]
    eng.max_len = lens[len(lens) // 2] + budget
    seqs, st, _ = groups.teacher_prefix_batch(eng, ret, qs, stepgrpo.rollout_config(args), encoder.encode, steprewards.Weights(), seed=0)
    fits = sum(n + budget <= eng.max_len for n in lens)
    assert 0 < fits < len(lens) and len(seqs) == fits
    assert st["overflow"] == pytest.approx([float(n + budget > eng.max_len)
                                            for _, sp, p, _ in prefixes if sp["kind"] == "route" for n in [len(p)]])
    assert st["route_r"] == pytest.approx([1.2] * 2 * fits)
    assert all(seg_start + budget <= eng.max_len
               for s in seqs for seg_start in [s["seg"].index(0) + 1])

def test_released_structure_trains_on_one_row_a_chat(tiny_index, encoder):
    # onpolicy rows and teacher-prefix groups of the released structure: every row is one single-turn chat that opens
    # with its own system prompt, and the rows hold exactly the trajectories' policy tokens
    tok, qs, ret, args, _ = teacher_setup(tiny_index, "all")
    args.structure, args.rollout, args.reward = "released", "onpolicy", "step"
    w = steprewards.Weights()
    rows, _, _ = groups.onpolicy_batch(rollout.GoldPolicy(tok, qs), ret, qs, stepgrpo.rollout_config(args), encoder.encode, w, seed=0)
    golds = rollout.rollout(rollout.GoldPolicy(tok, qs), ret, qs, 2, rollout.Settings(max_steps=3, topk=3, structure="released"))
    assert len(rows) == sum(len(x["segments"]) for x in golds) and sum(sum(r["mask"]) for r in rows) == sum(x["n_policy_tokens"] for x in golds)
    for r in rows:
        text = tok.decode(r["ids"])
        assert text.startswith("<|im_start|>system") and text.count("<|im_start|>system") == 1
    seqs, _, _ = groups.teacher_prefix_batch(rollout.GoldPolicy(tok, qs), ret, qs, stepgrpo.rollout_config(args), encoder.encode, w, seed=0)
    assert len(seqs) == sum(len(x["spans"]) for x in golds[::2])
    assert all(tok.decode(s["ids"]).count("<|im_start|>system") == 1 for s in seqs)

def test_teacher_prefix_logs_re_asks_of_a_gold_prefix_sub_question(tiny_index, encoder):
    # an engine that, past the first step, re-asks the previous gold sub-question: exactly those route completions are
    # logged as re-asks and score below the gold's 1.2 (wrong sub-question and KB for this step)

    class Reasker(rollout.GoldPolicy):
        def step_text(self, q, turn, phase):
            if phase == "route" and turn > 0:
                g = q["steps"][turn // 2 - 1]
                return reward.format_route(self.THINK, [(g["sub_question"], g["kb"])])
            return super().step_text(q, turn, phase)
    tok, qs, ret, args, prefixes = teacher_setup(tiny_index)
    st = groups.teacher_prefix_batch(Reasker(tok, qs), ret, qs, stepgrpo.rollout_config(args), encoder.encode, steprewards.Weights(), seed=0)[1]
    later = [sp["step"] > 0 for _, sp, _, _ in prefixes if sp["kind"] == "route" for _ in range(2)]
    assert any(later) and not all(later)
    assert [r < 1.2 - 1e-6 for r in st["route_r"]] == later
    # one per sampled retrieval (a question with no gold step stops at step 0)
    asked = [float(sp["step"] > 0) for x, sp, _, _ in prefixes if sp["kind"] == "route" and (sp["step"] or x["gold_steps"])
             for _ in range(2)]
    assert st["reask"] == asked and 0 < sum(asked) < len(asked)

def test_bad_flags_exit_with_an_error_naming_the_flag(tmp_path):
    for extra, flag in ((["--reward", "outcome"], "--reward"), (["-n", "1"], "-n"),
                        (["--rollout", "branch", "--branch_steps", "0"], "--branch_steps"),
                        (["--rollout", "branch", "--prefixes", str(tmp_path)], "--prefixes"),
                        (["--rollout", "branch", "--adv_estimator", "gae"], "--adv_estimator"),
                        (["--rollout", "onpolicy", "--w_rag", "2"], "--judge"),  # the judged reward needs its judge
                        (["--rollout", "onpolicy", "--w_rag", "2", "1", "1", "--judge", "j"], "--w_rag"),
                        (["--w_rag", "2", "--judge", "j"], "--rollout onpolicy or branch"),
                        (["--rollout", "onpolicy", "--judge_url", "http://x"], "--judge_url needs --judge"),
                        (["--rollout", "onpolicy", "--micro_tokens", "4096"], "--micro_tokens")):
        with pytest.raises(SystemExit) as e:
            stepgrpo.check_args(stepgrpo.get_args(["--data", str(tmp_path), *extra]), 1)
        msg = str(e.value.code)  # what the command prints: one line, not a traceback
        assert msg.startswith("error: ") and "\n" not in msg and flag in msg, msg
    # the transcript format is the policy's own (its transcript.json): a released-structure policy trains released,
    # and branch takes it with the outcome alone
    (tmp_path / "sft").mkdir()
    (tmp_path / "sft" / "transcript.json").write_text(json.dumps(dict(structure="released", max_pairs=1)))
    args = stepgrpo.get_args(["--model", str(tmp_path / "sft"), "--data", str(tmp_path), "--rollout", "branch",
                              "--reward", "outcome", "--branch_steps", "1"])
    assert (args.structure, args.max_pairs, args.max_rets) == ("released", 1, 1)
    stepgrpo.check_args(args, 1)
    assert stepgrpo.get_args(["--model", str(tmp_path)]).structure == "transcript"  # none recorded: R1-Router's
    with pytest.raises(SystemExit, match="under torchrun serve it and pass --judge_url"):  # two vLLM engines a rank
        stepgrpo.check_args(stepgrpo.get_args(["--rollout", "onpolicy", "--w_rag", "2", "--judge", "j"]), 2)
    # the real command line: a policy trained on other KBs than the prompt names
    (tmp_path / "sft" / "transcript.json").write_text(json.dumps(dict(structure="transcript", kbs=["text", "table"])))
    r = subprocess.run([sys.executable, "stepgrpo.py", "--model", str(tmp_path / "sft"), "--data", str(tmp_path)],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode != 0 and r.stderr.strip() == (f"error: {tmp_path / 'sft'} was trained on another transcript "
                                                      "format: the KBs text table image of dataio.KB_TABLE (trained: "
                                                      "text table); pass the trained values"), r.stderr

def test_questions_step_grpo_cannot_use_exit_with_one_line(tmp_path, tiny_model_dir, tiny_index):
    import shutil
    data = tmp_path / "data"
    shutil.copytree(tiny_index, data)
    qfile = data / "questions" / "train.jsonl"
    qs = [json.loads(l) for l in open(qfile)]
    for extra, words in ((["--batch_questions", str(len(qs) + 2)], f"is more than the {len(qs)} questions"),
                         ([], "have gold steps without a sub-question")):
        if not extra:  # gold steps as the HotpotQA import writes them: supporting paragraphs, no sub-questions
            next(q for q in qs if q["steps"])["steps"][0]["sub_question"] = ""
            qfile.write_text("".join(json.dumps(q) + "\n" for q in qs))
        with pytest.raises(SystemExit) as e:  # main() itself: the data read, checked before any process group or engine
            stepgrpo.main(["--model", str(tiny_model_dir), "--data", str(data), "--retriever", "bm25", "--out",
                           str(tmp_path / "run"), *extra])
        msg = str(e.value.code)
        assert msg.startswith("error: ") and "\n" not in msg and words in msg, msg
    assert not (tmp_path / "run").exists()  # nothing written

@pytest.mark.slow
def test_dev_eval_keeps_the_best_checkpoint_and_leaves_training_unchanged(straight, tmp_path, tiny_model_dir, tiny_index,
                                                                         capsys):
    plain, evald = straight, tmp_path / "eval"
    stepgrpo.main(common(tiny_model_dir, tiny_index, evald) + ["--train_steps", "3", "--eval_questions", "3"])
    a, b = load_file(plain / "final" / "model.safetensors"), load_file(evald / "final" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)  # the greedy dev rollouts do not disturb training
    recs = records(evald)
    assert [x["step"] for x in recs] == [0, 1, 2, 3] and all("dev_score" in x for x in recs)
    assert "loss" not in recs[0]  # step 0: the starting policy's dev score only
    scores = {x["step"]: x["dev_score"] for x in recs[1:]}
    best = max(scores, key=scores.get)  # the earliest of equal scores
    assert (evald / "best").resolve().name == f"step_{best}" and (evald / "best" / "model.safetensors").exists()
    # the newest KEEP checkpoints and the best one are kept
    assert sorted(p.name for p in evald.glob("step_*")) == sorted({f"step_{best}", "step_1", "step_2", "step_3"})
    assert f"best on dev (mean of F1-Recall and routing accuracy): step {best}" in capsys.readouterr().out

def wandb_tables(out, name):
    """step -> the rows (column -> cell) of the wandb Table `name` an offline run in `out` logged at that step (wandb
    0.31 writes each as wandb/offline-run-*/files/media/table/<name>_<step>_<hash>.table.json)."""
    tables = {}
    for f in Path(out).glob(f"wandb/offline-run-*/files/media/table/{name}_*.table.json"):
        t = json.loads(f.read_text())
        tables[int(f.name[len(name) + 1:].split("_")[0])] = [dict(zip(t["columns"], r)) for r in t["data"]]
    return tables

def test_wandb_tables_hold_the_steps_trajectories_and_the_dev_ones(tmp_path, tiny_model_dir, tiny_index, monkeypatch):
    # an offline wandb run (the default): at step 1 a table of the step's trajectories (onpolicy, 2 questions x 2
    # samples: all of them, stepgrpo.SAMPLES = 4), at each dev evaluation (steps 0 and 1) one of the dev trajectories;
    # their rewards and scores are the ones log.jsonl's means are of, and log.jsonl keeps its scalars alone
    monkeypatch.setenv("WANDB_MODE", "offline")
    out = tmp_path / "run"
    stepgrpo.main(common(tiny_model_dir, tiny_index, out) + ["--train_steps", "1", "--backend", "hf", "--rollout",
                                                             "onpolicy", "--eval_questions", "2"])
    recs, train, dev = records(out), wandb_tables(out, "samples"), wandb_tables(out, "dev_samples")
    assert list(train) == [1] and sorted(dev) == [0, 1] and len(train[1]) == stepgrpo.SAMPLES == 4
    assert all(list(r) == list(rollout.Sample.COLUMNS) for rows in [train[1], *dev.values()] for r in rows)
    _, batch = groups.step_questions(dataio.load_questions(tiny_index, "train"), 0, 2, 0, 0, 1)
    assert sorted(r["question"] for r in train[1]) == sorted(q["question"] for q in batch for _ in range(2))
    for r in train[1]:  # a line a policy step, its reward and advantage beside it
        assert len(r["steps"].split("\n")) == len(r["rewards"]) == len(r["advantages"]) >= 1
        assert r["gold"] == " | ".join(next(q["answers"] for q in batch if q["question"] == r["question"]))
    routes = [v for r in train[1] for line, v in zip(r["steps"].split("\n"), r["rewards"]) if line.startswith("route")]
    assert np.mean(routes) == pytest.approx(recs[-1]["route_r"], abs=1e-4)  # the table's rounded to 4 places
    assert np.mean([r["score"] for r in train[1]]) == pytest.approx(recs[-1]["outcome"])
    dev_qs = dataio.load_questions(tiny_index, "dev")[:2]
    for step, rows in dev.items():  # greedy and untrained: no rewards; scored by F1-Recall
        assert [r["question"] for r in rows] == [q["question"] for q in dev_qs]
        assert all(set(r["rewards"]) == set(r["advantages"]) == {None} for r in rows)
        assert 100 * np.mean([r["score"] for r in rows]) == pytest.approx(recs[step]["dev_f1_recall"])
    assert not {"samples", "dev_samples"} & {k for rec in recs for k in rec}

class TinyLM(torch.nn.Module):
    """embedding -> norm -> head, with the interface trainutil.selected_logits uses (HF models read tensor values
    while building masks, which the meta device has not)."""
    def __init__(self, vocab=128, dim=32):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.embed, self.model.norm = torch.nn.Embedding(vocab, dim), torch.nn.LayerNorm(dim)
        self.lm_head = torch.nn.Linear(dim, vocab)

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False):
        return Namespace(logits=self.lm_head(self.model.norm(self.model.embed(input_ids))))

def test_step_bookkeeping_stays_on_the_data_device(monkeypatch):
    # the training step's tensor bookkeeping on the meta device, as a GPU run does it on CUDA: collate (packed rows
    # too), the policy's logprobs, the loss, its backward and the logged sums; a tensor made on
    # the CPU anywhere in them meets a meta tensor and fails here, not on a user's cluster (sft.py's loss too)
    import sft
    meta = torch.device("meta")
    with meta:
        model = TinyLM()
    packed = grpo.pack_group([5, 6, 7], [([8, 9], [-0.5, -0.7]), ([10], [-0.2])], [1.0, -1.0])
    plain = dict(ids=[5, 6], mask=[0, 1], old=[0.0, -0.3], adv=[0.0, 0.5])
    assert all(t.device == meta for t in grpo.collate([packed, plain], 0, meta) if t is not None)
    # meta tensors have no values, so a boolean selection's size is unknown: with every position a policy token it
    # is all of them, which torch may then assume
    import torch.fx.experimental._config as fx_config
    monkeypatch.setattr(fx_config, "meta_nonzero_assume_all_nonzero", True)
    rows = [dict(ids=[5, 6, 7, 8], mask=[0, 1, 1, 1], old=[0.0, -0.2, -0.3, -0.4], adv=[0.0, 0.5, 0.5, 0.5]),
            dict(ids=[5, 9, 9, 8], mask=[0, 1, 1, 1], old=[0.0, -0.1, -0.3, -0.2], adv=[0.0, -1.0, -1.0, -1.0])]
    ids, attn, pos, sel, old, adv = grpo.collate(rows, 0, meta)
    logp, ent = grpo.token_logprobs(model, ids, attn, sel, pos)
    sums = {k: torch.zeros((), dtype=torch.float64, device=meta) for k in learner.SUMS}
    tis = grpo.tis_weights(old, old - 0.1, 2.0)
    seq = grpo.spans_of(sel)
    loss, kl, low, high = grpo.grpo_loss(logp, old, logp.detach() - 0.1, adv, (0.2, 0.28), 0.1, 5.0, seq=seq, tis=tis)
    loss.backward()
    learner.add_stats(sums, 1.0, loss, kl, low, high, ent, tis, 2.0)
    assert all(t.device == meta for t in (logp, ent, loss, kl, low, high, tis, seq, *sums.values()))
    assert all(p.grad is not None and p.grad.device == meta for p in model.parameters())
    s, n = sft.loss_sum(model, *sft.collate([([5, 6, 7], [1, 1, 1])], 0, meta))
    assert s.device == meta and n.device == meta

def test_the_logged_loss_does_not_depend_on_the_world_size(monkeypatch):
    # one process, then the same rows on two ranks (all_reduce sums two equal copies): micro_batches' denominator, the
    # loss each rank computes (scaled for FSDP's gradient average) and log_record must give the one-process loss
    import torch.distributed as dist

    import trainutil
    rows = [dict(ids=[5, 6, 7, 8], mask=[0, 1, 1, 1], old=[0.0, -4.2, -4.3, -4.4], adv=[0.0, 0.5, 0.5, 0.5]),
            dict(ids=[5, 9, 9], mask=[0, 1, 1], old=[0.0, -4.1, -4.3], adv=[0.0, -1.0, -1.0])]
    args = learner.UpdateConfig(micro_batch=2)

    def logged_loss():
        torch.manual_seed(0)
        model, cpu = TinyLM(), torch.device("cpu")
        micro, denom, _ = learner.micro_batches(rows, args, 0, cpu)
        backprop = []  # the loss the update backprops, as grpo_loss returns it
        loss_fn = learner.grpo_loss
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(learner, "grpo_loss", lambda *a, **k: (out := loss_fn(*a, **k), backprop.append(out[0].item()))[0])
            mp.setattr(learner.trainutil, "clip_grad_norm", lambda model, max_norm: 0.0)  # a plain module, no DTensors
            sums, _ = learner.update(model, torch.optim.SGD(model.parameters(), lr=0.0), micro, [m.logp_sampler for m in micro],
                                     [None], denom, args)
        return stepgrpo.log_record(1, 0, {k: [] for k in groups.STATS}, sums, 0.0, {}, rows, args)["loss"], backprop[0]

    own = trainutil.init_group(1)
    try:
        one, backprop1 = logged_loss()
        monkeypatch.setattr(dist, "get_world_size", lambda *a: 2)
        monkeypatch.setattr(dist, "all_reduce", lambda t, op=dist.ReduceOp.SUM, **k: t.mul_(2) if op == dist.ReduceOp.SUM else t)
        two, backprop2 = logged_loss()
        assert one != 0 and two == pytest.approx(one, rel=1e-9)
        # each of two ranks holding the same rows backprops the one-process loss: FSDP's average over ranks is that update
        assert backprop2 == pytest.approx(backprop1, rel=1e-9)
    finally:
        monkeypatch.undo()
        if own:
            dist.destroy_process_group()

def test_both_rollout_modes_score_gold_multi_query_steps_in_full(tiny_index, encoder):
    # GoldPolicy writing multi-query steps (--max_pairs 2) on comparison and chain questions: every teacher-prefix
    # route completion is the gold step (full reward 1.2, right KBs, ends at the end of turn); on-policy, every
    # trajectory earns its full outcome and each comparison asks its two lookups in one routing step
    import dataio
    tok, _, ret, args, _ = teacher_setup(tiny_index, "all")
    qs = dataio.load_questions(tiny_index, "train")
    qs = [q for q in qs if q["type"] == "comparison"][:3] + [q for q in qs if q["type"] == "2hop"][:3]
    args.max_pairs, args.rollout, args.reward = 2, "onpolicy", "step"
    w = steprewards.Weights(route_scale=steprewards.kb_balance(qs, 3, max_pairs=2))
    seqs, st, _ = groups.teacher_prefix_batch(rollout.GoldPolicy(tok, qs, max_pairs=2), ret, qs, stepgrpo.rollout_config(args), encoder.encode, w, seed=0)
    n_route = 2 * (3 * 2 + 3 * 3)  # 2 samples x (a comparison: 1 step + stop, a 2-hop: 2 steps + stop)
    assert st["route_r"] == pytest.approx([1.2] * n_route) and st["kb_acc"] == [1.0] * n_route
    assert st["answer_r"] == pytest.approx([1.2] * 2 * 9) and st["outcome"] == pytest.approx([1.2] * 2 * 6)
    routes = [s for s in seqs if tok.decode([t for t, m in zip(s["ids"], s["mask"]) if m]).count("</ret>")]
    assert len(routes) == n_route // 2 and all(s["ids"][-1] == tok.eos_token_id for s in routes)
    rows, st, _ = groups.onpolicy_batch(rollout.GoldPolicy(tok, qs, max_pairs=2), ret, qs, stepgrpo.rollout_config(args), encoder.encode, w, seed=0)
    assert st["outcome"] == [1.0] * 12 and st["format_ok"] == [1.0] * 12 and st["kb_acc"] == [1.0] * 2 * (3 * 2 + 3 * 3)
    assert st["retrievals"] == [2] * 12 and st["route_r"] == pytest.approx([1.2] * 2 * (3 * 2 + 3 * 3))
    assert len(rows) == 12 and all(a == 0.0 for r in rows for a in r["adv"])  # the same trajectory twice: no advantage

def test_teacher_written_prefixes_score_against_the_teacher(tiny_index, encoder):
    # a teacher that sends every first sub-question to a wrong KB writes the stored trajectories; GoldPolicy as the
    # engine writes the gold step at each of their prefixes. R1-Router's step reward scores that gold step against
    # the teacher's, so the right KB loses its half

    class WrongFirstKB(rollout.GoldPolicy):
        def step_text(self, q, turn, phase):
            if phase == "route" and turn == 0 and q["steps"]:
                g = q["steps"][0]
                kb = "table" if g["kb"] == "text" else "text"
                return reward.format_route(self.THINK, [(g["sub_question"], kb)])
            return super().step_text(q, turn, phase)
    tok, qs, ret, args, _ = teacher_setup(tiny_index)
    teacher = rollout.rollout(WrongFirstKB(tok, qs), ret, qs, 1, rollout.Settings(route_tokens=1024, answer_tokens=1024))
    store = {x["qid"]: x for x in teacher}
    routes = [(x, sp) for x, sp, _, _ in rollout.span_prefixes(teacher) if sp["kind"] == "route"]
    first = [sp["step"] == 0 and bool(x["gold_steps"]) for x, sp in routes for _ in range(2)]
    assert any(first) and not all(first)
    st = groups.teacher_prefix_batch(rollout.GoldPolicy(tok, qs), ret, qs, stepgrpo.rollout_config(args), encoder.encode, steprewards.Weights(),
                                       seed=0, store=store)[1]
    # the teacher's own later steps are the gold's: full reward there; the first step: format + cosine 1, wrong KB
    assert st["route_r"] == pytest.approx([0.7 if f else 1.2 for f in first])
    assert st["kb_acc"] == [0.0 if f else 1.0 for f in first]

def test_prefixes_folder_must_hold_synth_trajectories(tmp_path):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(prepare.DEFAULT_MODEL)
    (tmp_path / "train.jsonl").write_text(json.dumps({"qid": "q1", "ids": [1]}) + "\n")
    with pytest.raises(dataio.DataError, match=r"train.jsonl: row 1: not a synth.py trajectory"):
        transcript.load_trajectories(tmp_path, tok, print)

#### the field's standard RL: minibatches, dynamic sampling, overlong steps

class HalfWrong:
    """GoldPolicy's steps, except that on the questions in `mixed` every second routing completion of a batch names
    another KB: their route groups are mixed, every other question's unanimous."""
    def __init__(self, tok, qs, mixed):
        self.gold, self.tok, self.vis, self.mixed = rollout.GoldPolicy(tok, qs), tok, None, set(mixed)

    def generate(self, prompts, max_tokens, temperature=1.0, top_p=1.0, stop=(), seed=None, top_k=0, images=None,
                 keys=None):
        out = self.gold.generate(prompts, max_tokens, temperature, top_p, stop, seed, top_k, images, keys)
        if "</answer>" in stop:
            return out
        for i, (_, qid, turn) in enumerate(keys):
            plan = self.gold.plan(self.gold.by_id[qid])
            if qid in self.mixed and i % 2 and turn // 2 < len(plan):
                pairs = [(q, tuple("table" if kb != "table" else "text" for kb in kbs)) for q, kbs in reward.pairs_of(plan[turn // 2])]
                ids = self.tok.encode(reward.format_route(rollout_think(), pairs), add_special_tokens=False)[:max_tokens]
                out[i] = (ids, [0.0] * len(ids))
        return out

def rollout_think():
    return rollout.GoldPolicy.THINK

def test_dynamic_sampling_keeps_the_groups_with_a_gradient_and_draws_more_questions(tiny_index, encoder):
    tok, qs, ret, args, _ = teacher_setup(tiny_index)
    args.dynamic_sampling = True
    a, b, c, d = [q for q in qs if q["steps"]][:4]
    mine, pool = [a, b], [c, d]
    # one of the step's two questions (a) has a mixed group: a second round draws both of the pool's, of which c is
    # mixed, and the step is full
    policy = HalfWrong(tok, qs, mixed=[a["id"], c["id"]])
    rows, st, _ = groups.rollout_rows(policy, ret, mine, stepgrpo.rollout_config(args), encoder.encode, steprewards.Weights(), 7, None, pool)
    assert {r["group"][0] for r in rows} == {a["id"], c["id"]}
    assert all(any(v for v, m in zip(r["adv"], r["mask"]) if m) for r in rows)  # no unanimous group is trained
    assert st["informative"] == [1.0] and st["refilled"] == [0.5]
    # a pool with no mixed question: DYNAMIC_TRIES rounds, and the step trains the one question it has
    rows, st, _ = groups.rollout_rows(policy, ret, mine, stepgrpo.rollout_config(args), encoder.encode, steprewards.Weights(), 7, None, [b, d])
    assert {r["group"][0] for r in rows} == {a["id"]} and st["informative"] == [0.5] and st["refilled"] == [0.0]
    # off: every group, unanimous ones included, and no round but the first
    args.dynamic_sampling = False
    plain, st, _ = groups.rollout_rows(policy, ret, mine, stepgrpo.rollout_config(args), encoder.encode, steprewards.Weights(), 7, None, pool)
    assert len(plain) > len(rows) and {r["group"][0] for r in plain} == {q["id"] for q in mine} and st["refilled"] == []

def test_overlong_steps_are_masked_or_penalised(tiny_index, encoder):
    # a routing step cut at the budget: --overlong mask leaves its tokens out of the loss, penalty lowers its reward
    # by DAPO's soft punishment (-1 at the budget), none leaves both alone
    tok, qs, ret, args, _ = teacher_setup(tiny_index)

    class Rambles(rollout.GoldPolicy):  # every second completion: the budget's worth of text, never </ret>
        def generate(self, prompts, max_tokens, *a, keys=None, **k):
            out = super().generate(prompts, max_tokens, *a, keys=keys, **k)
            long = tok.encode("<think>" + " and then" * 200, add_special_tokens=False)[:max_tokens]
            return [(long, [0.0] * len(long)) if i % 2 else o for i, o in enumerate(out)]
    got = {}
    for mode in ("none", "mask", "penalty"):
        args.overlong = mode
        rows, st, _ = groups.teacher_prefix_batch(Rambles(tok, qs), ret, qs[:2], stepgrpo.rollout_config(args), encoder.encode,
                                                 steprewards.Weights(), seed=0)
        got[mode] = rows
        assert st["cut"] == [0.0, 1.0] * (len(st["cut"]) // 2)
    trained = lambda rows: sum(sum(r["mask"]) for r in rows)
    assert trained(got["mask"]) < trained(got["none"]) == trained(got["penalty"])
    for r in got["mask"]:  # only the completion that ended at </ret> is trained: segment 0 of each packed group
        assert {s for s, m in zip(r["seg"], r["mask"]) if m} == {0}
    # the cut completion scores 0 (no parse) either way; with the penalty, -1 more: a larger gap in the group
    gap = lambda rows: max(abs(a) for r in rows for a in r["adv"])
    assert gap(got["penalty"]) > gap(got["none"])

def test_minibatches_split_the_rows_once_and_one_is_the_whole_batch_bit_for_bit(tiny_model_dir):
    # rows of different lengths (a share run twice would count other tokens) whose old logprobs are the trainer's
    # own, each row's its own (a share scored against another share's old logprobs would not have ratio 1)
    import trainutil
    rows = [dict(ids=[5, 6 + i, 7, 8 + i] + [9] * i, mask=[0, 1, 1, 1] + [1] * i, old=[0.0] * (4 + i),
                 adv=[0.0, 0.5 - 0.25 * i, 0.5, 0.5] + [-0.5] * i) for i in range(6)]
    assert learner.minibatch_rows(rows, 1, 0) == [rows]
    shares = learner.minibatch_rows(rows, 4, 3)
    assert sorted(id(r) for s in shares for r in s) == sorted(map(id, rows)) and [len(s) for s in shares] == [2, 2, 1, 1]
    args = stepgrpo.get_args(["--dtype", "fp32", "--lr", "1e-2", "--micro_batch", "2"])
    own = trainutil.init_group(1)
    try:
        start = trainutil.load_sharded(tiny_model_dir, torch.device("cpu"), 1, bf16=False)
        for r in rows:  # the sampler's logprobs: the starting policy's own, so every ratio starts at 1
            c = grpo.collate([r], 0, torch.device("cpu"))
            with torch.no_grad():
                r["old"] = [0.0] + grpo.token_logprobs(start, c[0], c[1], c[3], c[2])[0].tolist()

        def weights(k, direct=False, opt_of=None):
            torch.manual_seed(0)
            model = trainutil.load_sharded(tiny_model_dir, torch.device("cpu"), 1, bf16=False)
            opt = (opt_of or (lambda ps: torch.optim.AdamW(ps, lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0)))(
                model.parameters())
            cfg = dataclasses.replace(stepgrpo.update_config(args), minibatches=k)
            if direct:  # one update over every row: what a step ran before minibatches
                micro, denom, _ = learner.micro_batches(rows, cfg, 0, torch.device("cpu"))
                olds, refs, _, _ = learner.score_old(model, None, micro, cfg)
                learner.update(model, opt, micro, olds, refs, denom, cfg)
                sums = None
            else:
                sums = learner.learn(model, None, opt, None, rows, cfg, 0, torch.device("cpu"), None, 0, False,
                                     memory.PeakMemory(), {})[1]
            return {n: trainutil.full(p).clone() for n, p in model.named_parameters()}, sums
        one, direct, two = weights(1)[0], weights(1, direct=True)[0], weights(2)
        frozen = weights(2, opt_of=lambda ps: torch.optim.SGD(ps, lr=0.0))[1]  # no step moves the policy
    finally:
        if own:
            torch.distributed.destroy_process_group()
    assert all(torch.equal(one[n], direct[n]) for n in one)
    assert any(not torch.equal(one[n], two[0][n]) for n in one)
    assert two[1]["tokens"].item() == frozen["tokens"].item() == sum(sum(r["mask"]) for r in rows)  # each row once
    # each share against its own rows' old logprobs: ratio 1 everywhere while the policy stands still
    assert frozen["clip_low"].item() == frozen["clip_high"].item() == 0
    # the second minibatch's ratio is against the rollout's logprobs, after one step at lr 1e-2: the clip can act
    assert two[1]["clip_low"].item() + two[1]["clip_high"].item() > 0

@pytest.mark.slow
def test_the_fields_rl_tricks_run_end_to_end_and_resume_exactly(tmp_path, tiny_model_dir, tiny_index):
    # on-policy with clip-higher, GSPO's ratio, TIS, two minibatches and the overlong penalty (dynamic sampling would
    # drop every group of the tiny random policy, all unanimous: its own test uses a scripted policy)
    flags = ["--rollout", "onpolicy", "--clip_high", "0.28", "--ratio", "sequence", "--tis_cap", "2", "--minibatches",
             "2", "--overlong", "penalty", "--train_steps", "2", "--dtype", "fp32"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    stepgrpo.main(common(tiny_model_dir, tiny_index, straight) + flags)
    recs = records(straight)
    # the TIS weights held to their cap (the loss's terms themselves: test_clip_higher_gspos_ratio_and_tis_...)
    assert all(0 < r["tis_weight"] <= 2 and r["cut"] > 0 and 0 <= r["clip_high_frac"] <= 1 for r in recs)
    assert all(r["old_gap"] >= 0 for r in recs)  # --tis_cap recomputes the trainer's old logprobs
    interrupted_copy(straight, 1, resumed)
    stepgrpo.main(common(tiny_model_dir, tiny_index, resumed) + flags + ["--resume"])
    a, b = load_file(straight / "final" / "model.safetensors"), load_file(resumed / "final" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert records(resumed)[1]["loss"] == pytest.approx(recs[1]["loss"], rel=1e-6, abs=1e-9)

#### --rollout branch: groups at the policy's own states

def scripted_policy():
    """A GoldPolicy that writes from the whole request key (trajectory i, question id, turn): with mix, each route of a
    gold step names the gold KB or, by a coin seeded with the key, another one (branches whose continuations differ);
    the final answer is the gold's in trajectories of even i and wrong in odd ones, so with -n 2 the first branch of
    every group ends right and the second wrong, whatever step was branched."""
    import random
    import zlib


    class Scripted(rollout.GoldPolicy):
        mix = False

        def generate(self, prompts, max_tokens, temperature=1.0, top_p=1.0, stop=(), seed=None, top_k=0, images=None,
                     keys=None):
            out = []
            for k, key in enumerate(keys):
                self.key = key
                out += super().generate(prompts[k:k + 1], max_tokens, temperature, top_p, stop, seed, top_k, None, [key])
            return out

        def step_text(self, q, turn, phase):
            plan = self.plan(q)
            if phase == "route" and self.mix and turn // 2 < len(plan):
                coin = random.Random(zlib.crc32(repr(self.key).encode()))
                kb = lambda g: g["kb"] if coin.random() < 0.5 else ("table" if g["kb"] == "text" else "text")
                return reward.format_route(self.THINK, [(g["sub_question"], kb(g)) for g in plan[turn // 2]])
            if phase == "answer" and not (turn % 2 and turn // 2 < len(plan)) and self.key[0] % 2:
                return reward.format_answer("Combining the answers.", "Nobody knows")  # a wrong final answer
            return super().step_text(q, turn, phase)
    return Scripted

def branch_setup(tiny_index, structure="transcript", mix=False):
    """The teacher-prefix tests' tokenizer, questions and retriever, --rollout branch -n 2 --branch_steps 2 (r - mean,
    no KB balance) in `structure`, and the scripted policy; the base trajectories, the picks and the branches as
    groups.branch_batch makes them."""
    tok, qs, ret, args, _ = teacher_setup(tiny_index)
    args.rollout, args.structure, args.adv_std = "branch", structure, False
    policy = scripted_policy()(tok, qs)
    policy.mix = mix
    s = stepgrpo.rollout_config(args).steps
    memo = branches.Memo(ret)
    trajs = rollout.rollout(policy, memo, qs, 1, s, seed=0)
    picks = branches.branch_points(trajs, args.branch_steps, 0)
    return tok, qs, ret, args, policy, s, trajs, picks, branches.branch(policy, memo, qs, trajs, picks, 2, s, 1)

def test_branch_points_take_every_step_or_k_of_them_by_the_seed():
    trajs = [dict(spans=[None] * n) for n in (0, 1, 2, 5, 7)]
    picks = branches.branch_points(trajs, 2, seed=3)
    by = lambda p: {j: [b for i, b in p if i == j] for j in range(len(trajs))}
    got = by(picks)
    assert got[0] == [] and got[1] == [0] and got[2] == [0, 1]  # at most k steps: all of them
    assert all(len(got[j]) == 2 and len(set(got[j])) == 2 and got[j] == sorted(got[j]) for j in (3, 4))
    assert branches.branch_points(trajs, 2, seed=3) == picks  # the seed alone decides
    assert any(branches.branch_points(trajs, 2, seed=s) != picks for s in range(4, 10))
    assert branches.branch_points(trajs, 7, seed=3) == [(j, b) for j, x in enumerate(trajs) for b in range(len(x["spans"]))]

@pytest.mark.parametrize("structure", ["transcript", "released"])
def test_branch_groups_share_their_prefix_token_for_token(tiny_index, encoder, structure):
    # the scripted policy routes to random KBs: each branch replays its base trajectory up to the branched span (ids,
    # logprobs, evidence, spans equal), then goes its own way; the packed row of a group is that prefix once, then
    # per branch the prefix's last token and the branch's new step
    tok, qs, ret, args, policy, s, trajs, picks, ys = branch_setup(tiny_index, structure, mix=True)
    assert len(ys) == 2 * len(picks) and {len(x["spans"]) for x in trajs} - {1, 2}  # some trajectories have > 2 spans
    assert {trajs[j]["spans"][b]["kind"] for j, b in picks} == {"route", "answer", "final"}
    for y, (j, b) in zip(ys, (p for p in picks for _ in range(2))):
        x, start = trajs[j], trajs[j]["spans"][b]["start"]
        assert (y["base"], y["branch"]) == (j, b) and y["ids"][:start] == x["ids"][:start]
        assert y["logprobs"][:start] == x["logprobs"][:start] and y["spans"][:b] == x["spans"][:b]
        assert y["steps"][:len([e for e in x["steps"] if e["step"] < x["spans"][b]["step"]])] == \
            [e for e in x["steps"] if e["step"] < x["spans"][b]["step"]]
    assert any(y["ids"] != trajs[y["base"]]["ids"] for y in ys)  # the continuations went elsewhere
    rows, st, _ = groups.branch_batch(policy, ret, qs, stepgrpo.rollout_config(args), encoder.encode, steprewards.Weights(), seed=0)
    assert len(rows) == len(picks) and st["kb_mixed"] and 0 < np.mean(st["kb_mixed"]) < 1
    for row, (j, b) in zip(rows, picks):
        prefix, _ = rollout.span_prefix(trajs[j], trajs[j]["spans"][b])
        shared = [t for t, g in zip(row["ids"], row["seg"]) if g == -1]
        assert shared == prefix[:-1] and [row["ids"][row["seg"].index(k)] for k in (0, 1)] == [prefix[-1]] * 2
        if structure == "released":  # the prefix is the step's own chat
            assert tok.decode(shared).count("<|im_start|>system") == 1
    # a retriever that answers a query two ways breaks the replay, which says so
    class Fickle:
        calls = 0
        def search(self, queries, kb, k=3, images=None):
            Fickle.calls += 1
            return [d[::-1] if Fickle.calls % 2 else d for d in ret.search(queries, kb, k)]
    with pytest.raises(RuntimeError, match="the replay of its trajectory up to span"):
        branches.branch(policy, Fickle(), qs, trajs, picks, 2, s, 1)

def test_branch_advantage_follows_the_outcome_of_the_continuation(tiny_index, encoder):
    # every branch writes the gold step (equal step rewards); the first branch of each group ends with the gold answer,
    # the second with a wrong one, later: the branched step's advantage is the continuation's +-0.5 (r - mean), with
    # the step reward or the outcome alone (--reward outcome), on every branched kind
    tok, qs, ret, args, policy, *_ = branch_setup(tiny_index)
    for mode in ("step", "outcome"):
        args.reward = mode
        rows, st, _ = groups.branch_batch(policy, ret, qs, stepgrpo.rollout_config(args), encoder.encode, steprewards.Weights(), seed=0)
        assert st["outcome"] == [1.0, 0.0] * len(rows) and st["format_ok"] == [1.0] * 2 * len(rows)
        assert st["kb_acc"] == [1.0] * len(st["kb_acc"]) and st["kb_entropy"] == [0.0] * len(st["kb_entropy"])
        assert st["route_r"] == pytest.approx([1.2] * len(st["route_r"])) and st["route_r"]
        for row in rows:
            adv = [{a for a, m, s in zip(row["adv"], row["mask"], row["seg"]) if m and s == g} for g in (0, 1)]
            assert list(map(len, adv)) == [1, 1] and [*adv[0], *adv[1]] == pytest.approx([0.5, -0.5])
        kinds = [tok.decode([t for t, m, s in zip(r["ids"], r["mask"], r["seg"]) if m and s == 0]) for r in rows]
        assert sum("</ret>" in k for k in kinds) and sum("<answer>" in k for k in kinds)
    # the reward itself: the outcome plus the branched span's span_rewards entry
    tok, qs, ret, args, policy, s, trajs, picks, ys = branch_setup(tiny_index)
    w = steprewards.Weights()
    for y in ys:
        r, R = steprewards.span_rewards(y, encoder.encode, w)
        assert steprewards.branch_reward(y, encoder.encode, w) == pytest.approx((R + r[y["branch"]], r[y["branch"]], R))
        assert steprewards.branch_reward(y, encoder.encode, w, "outcome")[0] == R

def test_branch_rows_train_the_branched_step_alone(tiny_index, encoder):
    # mask 1 exactly on each branch's branched step (its ids, its sampler logprobs as old), 0 on the shared prefix and
    # on each branch's repeated last prompt token; the continuation is not in the row; a VL (mrope) policy's group is a
    # row per completion with the same masks
    tok, qs, ret, args, policy, s, trajs, picks, ys = branch_setup(tiny_index, mix=True)
    rows, st, _ = groups.branch_batch(policy, ret, qs, stepgrpo.rollout_config(args), encoder.encode, steprewards.Weights(), seed=0)
    assert sum(sum(r["mask"]) for r in rows) == sum(st["tokens"]) == sum(
        y["spans"][y["branch"]]["end"] - y["spans"][y["branch"]]["start"] for y in ys)
    for g, row in enumerate(rows):
        prefix, images, group = branches.branch_group(ys[2 * g:2 * g + 2])
        assert len(row["ids"]) == len(prefix) - 1 + sum(1 + len(ids) for ids, _ in group)
        for k, (ids, lps) in enumerate(group):
            mine = [p for p, sg in enumerate(row["seg"]) if sg == k]
            assert [row["mask"][p] for p in mine] == [0] + [1] * len(ids)
            assert [row["ids"][p] for p in mine[1:]] == ids and [row["old"][p] for p in mine[1:]] == lps
        assert not any(m for m, sg in zip(row["mask"], row["seg"]) if sg == -1)
        vl = grpo.group_rows(prefix, group, [1.0, -1.0], images, mrope=True)
        assert [r["ids"] for r in vl] == [prefix + ids for ids, _ in group]
        assert [r["mask"] for r in vl] == [[0] * len(prefix) + [1] * len(ids) for ids, _ in group]

def gold_lines(q, max_steps=3):
    """The table's step lines (rollout.step_line) of the gold policy's trajectory of question q, written out here: each
    gold step's sub-question and KB and its answer, the stop (within max_steps), the final answer."""
    plan = reward.by_step(reward.group_steps(q["steps"], 1))[:max_steps]
    lines = [line for t, g in enumerate(plan) for line in (f"route {t + 1}: {g[0]['sub_question']} -> {g[0]['kb']}",
                                                            f"answer {t + 1}: {reward.group_answer(g)}")]
    return lines + [f"route {len(plan) + 1}: stop"] * (len(plan) < max_steps) + [f"final: {q['answers'][0]}"]

def test_samples_are_the_scored_trajectories_a_line_a_step(tiny_index, encoder):
    # the wandb tables' rows (rollout.Sample) of every rollout mode's groups: a readable line a step the policy wrote,
    # beside it the reward its advantage is of (the one log.jsonl's means are of) and that advantage, the final answer
    # and its outcome; a teacher's prefix steps and a branch's other steps have none
    tok, qs, ret, args, _ = teacher_setup(tiny_index, "all")
    by_q = {q["question"]: q for q in qs}
    w = steprewards.Weights()
    args.rollout = "onpolicy"  # -n 2 gold trajectories a question: equal rewards, advantages 0
    _, st, samples = groups.onpolicy_batch(rollout.GoldPolicy(tok, qs), ret, qs, stepgrpo.rollout_config(args),
                                           encoder.encode, w, seed=0)
    assert [s.question for s in samples] == [q["question"] for q in qs for _ in range(2)]
    assert all(s.steps == gold_lines(by_q[s.question]) and s.final_answer == by_q[s.question]["answers"][0]
               for s in samples)
    of = lambda kind: [r for s in samples for line, r in zip(s.steps, s.rewards) if line.startswith(kind)]
    assert of("route") == pytest.approx(st["route_r"]) and of("answer") == pytest.approx(st["answer_r"])
    assert [s.score for s in samples] == pytest.approx(st["outcome"]) and st["outcome"] == [1.0] * len(samples)
    assert {a for s in samples for a in s.advantages} == {0.0}
    row = samples[0].row()
    assert row[2] == "\n".join(gold_lines(qs[0])) and len(row) == len(rollout.Sample.COLUMNS)
    args.rollout = "teacher_prefix"  # a sample a completion: the gold prefix, then the step the policy wrote at it
    _, st, samples = groups.teacher_prefix_batch(rollout.GoldPolicy(tok, qs), ret, qs, stepgrpo.rollout_config(args),
                                                 encoder.encode, w, seed=0)
    assert all(s.steps == gold_lines(by_q[s.question])[:len(s.steps)] for s in samples)
    assert all(s.rewards[:-1] == s.advantages[:-1] == [None] * (len(s.steps) - 1) for s in samples)
    last = lambda kind: [s.rewards[-1] for s in samples if s.steps[-1].startswith(kind)]  # noqa: E731
    assert last("route") == pytest.approx(st["route_r"]) and last("answer") == pytest.approx(st["answer_r"])
    finals = [s for s in samples if s.steps[-1].startswith("final")]
    assert [s.score for s in finals] == pytest.approx(st["outcome"]) and len(finals) == 2 * len(qs)
    assert all(s.final_answer == by_q[s.question]["answers"][0] for s in finals)
    assert {s.score for s in samples if s not in finals} == {None}
    # branch: the branched step's reward is its outcome's plus its own; the first branch of a group ends right, the
    # second wrong (+-0.5)
    *_, args, policy, s, trajs, picks, ys = branch_setup(tiny_index)
    _, st, samples = groups.branch_batch(policy, ret, qs, stepgrpo.rollout_config(args), encoder.encode, w, seed=0)
    assert [x.score for x in samples] == st["outcome"] == [1.0, 0.0] * len(picks)
    for x, y in zip(samples, ys):
        assert [r is not None for r in x.rewards] == [j == y["branch"] for j in range(len(y["spans"]))]
        assert x.advantages[y["branch"]] == pytest.approx(x.score - 0.5)
    branched = lambda kind: [x.rewards[y["branch"]] - x.score for x, y in zip(samples, ys)  # noqa: E731
                             if x.steps[y["branch"]].startswith(kind)]
    assert branched("route") == pytest.approx(st["route_r"]) and branched("answer") == pytest.approx(st["answer_r"])

#### the trainer's guards (found by reading verl's actor and GSPO)

def test_gspo_clip_range_is_reachable_from_the_command_line(tiny_model_dir):
    # GSPO clips its sequence ratio at about [1 - 3e-4, 1 + 4e-4]: --clip_low and --clip_high set both ends, and
    # a sequence whose ratio is 0.990 with a negative advantage is clipped there, never under the default [0.8, 1.2]
    import trainutil
    gspo = stepgrpo.update_config(stepgrpo.get_args(["--ratio", "sequence", "--clip_low", "3e-4",
                                                     "--clip_high", "4e-4"]))
    default = stepgrpo.update_config(stepgrpo.get_args(["--ratio", "sequence"]))
    assert (gspo.clip_low, gspo.clip_high, gspo.ratio) == (3e-4, 4e-4, "sequence") and default.clip_low == 0.2
    cpu, own = torch.device("cpu"), trainutil.init_group(1)
    try:
        model = trainutil.load_sharded(tiny_model_dir, cpu, 1, bf16=False)
        rows = [dict(ids=[5, 6, 7, 8], mask=[0, 1, 1, 1], old=[0.0] * 4, adv=[0.0, -1.0, -1.0, -1.0])]
        ids, attn, pos, sel, _, _ = grpo.collate(rows, 0, cpu)
        with torch.no_grad():
            logp = grpo.token_logprobs(model, ids, attn, sel, pos)[0]
        rows[0]["old"] = [0.0] + (logp + 0.01).tolist()  # the ratio exp(-0.01) = 0.990 on every token

        def clipped_below(cfg):
            micro, denom, _ = learner.micro_batches(rows, cfg, 0, cpu)
            sums, _ = learner.update(model, torch.optim.SGD(model.parameters(), lr=0.0), micro,
                                     [m.logp_sampler for m in micro], [None], denom, cfg)
            return sums["clip_low"].item()
        assert clipped_below(gspo) == 3 and clipped_below(default) == 0
    finally:
        if own:
            torch.distributed.destroy_process_group()
    with pytest.raises(SystemExit, match="0 <= clip_low < 1"):
        stepgrpo.check_args(stepgrpo.get_args(["--clip_low", "1.5"]), 1)

def test_a_non_finite_gradient_skips_the_step_and_a_run_of_them_stops(tiny_model_dir):
    # as verl's actor: an optimizer step whose gradient norm is not finite is skipped (the weights and AdamW's state
    # stay as they were) and counted (nonfinite); --max_nonfinite of them in a row stop the run with one line
    import trainutil
    rows = [dict(ids=[5, 6, 7, 8], mask=[0, 1, 1, 1], old=[0.0, -4.2, -4.3, -4.4], adv=[0.0, float("inf"), 0.5, 0.5]),
            dict(ids=[5, 9, 9], mask=[0, 1, 1], old=[0.0, -4.1, -4.3], adv=[0.0, -1.0, -1.0])]
    cpu, own = torch.device("cpu"), trainutil.init_group(1)
    try:
        model = trainutil.load_sharded(tiny_model_dir, cpu, 1, bf16=False)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        weights = lambda: {n: trainutil.full(p).clone() for n, p in model.named_parameters()}
        before, timing = weights(), {}
        cfg = stepgrpo.update_config(stepgrpo.get_args(["--dtype", "fp32"]))
        learner.learn(model, None, opt, None, rows, cfg, 0, cpu, None, 0, False, memory.PeakMemory(), timing)
        after = weights()
        fine = {}
        learner.learn(model, None, opt, None, rows[1:], cfg, 0, cpu, None, 0, False, memory.PeakMemory(), fine)
    finally:
        if own:
            torch.distributed.destroy_process_group()
    assert timing["nonfinite"] == 1 and all(torch.equal(before[n], after[n]) for n in before) and fine["nonfinite"] == 0
    assert learner.check_finite(0, 1, 5, 3) == 1 and learner.check_finite(2, 0, 6, 3) == 0
    with pytest.raises(SystemExit, match="^error: step 7: the gradient norm was not finite in 3 steps in a row"):
        learner.check_finite(2, 1, 7, 3)

def test_fewer_rows_than_minibatches_take_one_step_a_row(tiny_model_dir):
    # 3 rows and --minibatches 4: three optimizer steps of a row each; a fourth share would hold no row, and AdamW
    # would step on its momentum alone
    import trainutil
    rows = [dict(ids=[5, 6 + i, 7, 8], mask=[0, 1, 1, 1], old=[0.0, -4.2, -4.3, -4.4],
                 adv=[0.0, 0.5 - 0.5 * i, 0.5, 0.5]) for i in range(3)]
    steps = []

    class Counting(torch.optim.AdamW):
        def step(self, *a, **k):
            steps.append(1)
            return super().step(*a, **k)
    cpu, own = torch.device("cpu"), trainutil.init_group(1)
    try:
        model = trainutil.load_sharded(tiny_model_dir, cpu, 1, bf16=False)
        cfg = dataclasses.replace(stepgrpo.update_config(stepgrpo.get_args([])), minibatches=4)
        sums = learner.learn(model, None, Counting(model.parameters(), lr=1e-3), None, rows, cfg, 0, cpu, None, 0,
                             False, memory.PeakMemory(), {})[1]
    finally:
        if own:
            torch.distributed.destroy_process_group()
    assert len(steps) == 3 and sums["tokens"].item() == 9

def test_clip_higher_gspos_ratio_and_tis_each_change_the_update(tiny_model_dir):
    # each of the field's loss options is seen in the update's own sums (learner.update over the parsed flags):
    # clip-higher: ratio 1.25 with A > 0 is clipped under --clip_high 0.2, not under 0.28;
    # GSPO: token ratios exp(+-0.3) around a sequence mean of 1 are clipped per token, never as a sequence;
    # TIS: each token's loss is weighted by min(exp(trainer - sampler), cap), the sum of the weights logged
    import trainutil
    cpu, own = torch.device("cpu"), trainutil.init_group(1)
    try:
        model = trainutil.load_sharded(tiny_model_dir, cpu, 1, bf16=False)
        ids = [5, 6, 7, 8, 9]
        rows = [dict(ids=ids, mask=[0, 1, 1, 1, 1], old=[0.0] * 5, adv=[0.0, 1.0, 1.0, 1.0, 1.0])]
        c = grpo.collate(rows, 0, cpu)
        with torch.no_grad():
            logp = grpo.token_logprobs(model, c[0], c[1], c[3], c[2])[0]  # [4] the trainer's

        def sums(flags, shift):  # the update's sums with the sampler's logprobs = the trainer's - shift
            rows[0]["old"] = [0.0] + (logp - torch.tensor(shift)).tolist()
            args = stepgrpo.get_args(flags)
            stepgrpo.check_args(args, 1)  # --tis_cap: --old_logprobs trainer
            cfg = stepgrpo.update_config(args)
            micro, denom, _ = learner.micro_batches(rows, cfg, 0, cpu)
            olds, refs, _, _ = learner.score_old(model, None, micro, cfg)
            return learner.update(model, torch.optim.SGD(model.parameters(), lr=0.0), micro, olds, refs, denom,
                                  cfg)[0]
        up = [math.log(1.25)] * 4
        assert sums([], up)["clip_high"].item() == 4 and sums(["--clip_high", "0.28"], up)["clip_high"].item() == 0
        wave = [0.3, -0.3, 0.3, -0.3]
        assert sums([], wave)["clip_high"].item() == 2 and sums(["--ratio", "sequence"], wave)["clip_high"].item() == 0
        tis = sums(["--tis_cap", "2"], [0.5, -0.5, 1.0, 0.0])  # old: the trainer's (ratio 1), weights from the sampler
        w = [min(math.exp(d), 2.0) for d in (0.5, -0.5, 1.0, 0.0)]
        assert tis["tis"].item() == pytest.approx(sum(w)) and tis["tis_capped"].item() == 1
        assert tis["loss"].item() == pytest.approx(-sum(w) / 4)  # -ratio x A x w_t, token mean
    finally:
        if own:
            torch.distributed.destroy_process_group()
