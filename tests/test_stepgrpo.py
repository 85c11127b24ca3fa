"""stepgrpo.py: per-step advantages on hand-made rewards, the loss against a direct computation, masking, and (in
test_stepgrpo_dist.py) 2-rank torchrun runs with vLLM sync and exact resume."""
import math
import subprocess
import sys

import numpy as np
import pytest
import torch

import reward
import stepgrpo

def sp(kind, step):
    return dict(kind=kind, step=step, start=0, end=1)

def test_group_advantages_normalise_each_step_against_the_same_step():
    # three samples: two retrieve once then stop, one retrieves twice (so route step 1 is a stop for the first two)
    spans = [[sp("route", 0), sp("answer", 0), sp("route", 1), sp("final", 1)],
             [sp("route", 0), sp("answer", 0), sp("route", 1), sp("final", 1)],
             [sp("route", 0), sp("answer", 0), sp("route", 1), sp("answer", 1), sp("route", 2), sp("final", 2)]]
    rewards = [[1.0, 1.0, 1.0, 0.2], [0.5, 0.0, 1.0, 0.2], [0.0, 1.0, 0.3, 0.0, 0.6, 0.2]]
    outcomes = [1.0, 0.0, 0.5]
    adv = stepgrpo.group_advantages(spans, rewards, outcomes)
    n = lambda v: (np.array(v) - np.mean(v)) / (np.std(v, ddof=1) + 1e-4)
    R = n(outcomes)
    assert adv[0][0] == pytest.approx(n([1.0, 0.5, 0.0])[0] + R[0])          # route 0 across all three
    assert adv[1][1] == pytest.approx(n([1.0, 0.0, 1.0])[1] + R[1])          # answer 0 across all three
    assert adv[2][2] == pytest.approx(n([1.0, 1.0, 0.3])[2] + R[2])          # route 1: two stops and one retrieval
    assert adv[2][3] == pytest.approx(0.0 + R[2])                            # answer 1: only sample 2 has one -> 0
    assert adv[2][4] == pytest.approx(R[2]) and adv[0][3] == pytest.approx(R[0])  # finals all equal -> only R
    out = stepgrpo.group_advantages(spans, rewards, outcomes, mode="outcome")
    assert all(a == pytest.approx(R[i]) for i, s in enumerate(out) for a in s)  # plain GRPO: one value per sample

def test_balance_kb_weighs_each_gold_route_class_equally():
    # 3 questions, max 3 steps: [text, text] -> text, text, stop; [table] -> table, stop; [t, t, image] (3 steps: no stop)
    q = lambda *kbs: dict(steps=[dict(kb=k) for k in kbs])
    qs = [q("text", "text"), q("table"), q("text", "text", "image")]
    f = stepgrpo.kb_balance(qs, max_steps=3)
    n = dict(text=4, stop=2, table=1, image=1)  # 8 route steps, 4 classes
    assert f == pytest.approx({c: 8 / (4 * k) for c, k in n.items()})
    assert sum(f[c] * k for c, k in n.items()) == pytest.approx(8)  # the total weight is unchanged
    half = stepgrpo.kb_balance(qs, max_steps=3, power=0.5)
    assert half == pytest.approx({c: (8 / (4 * k)) ** 0.5 for c, k in n.items()})  # text 0.71, table/image 1.41
    # the flag: bare is power 1 (the commands of earlier runs), a number is the power, absent is off
    base = ["--model", "m", "--data", "d"]
    assert [stepgrpo.get_args(base + a).balance_kb for a in ([], ["--balance_kb"], ["--balance_kb", "0.5"],
                                                              ["--balance_kb", "--lr", "1e-5"])] == [0.0, 1.0, 0.5, 1.0]
    # group_advantages scales only the per-step part of the keys given, never the outcome part
    spans = [[sp("route", 0), sp("answer", 0), sp("final", 0)]] * 2
    rewards, outcomes = [[1.0, 1.0, 0.2], [0.0, 0.0, 0.2]], [1.0, 0.0]
    plain = stepgrpo.group_advantages(spans, rewards, outcomes)
    scaled = stepgrpo.group_advantages(spans, rewards, outcomes, scale={("route", 0): 3.0})
    R = stepgrpo.norm(outcomes)
    for i in range(2):
        assert scaled[i][0] - R[i] == pytest.approx(3.0 * (plain[i][0] - R[i]))
        assert scaled[i][1:] == plain[i][1:]

def test_identical_rewards_give_zero_advantage():
    spans = [[sp("route", 0), sp("final", 0)]] * 4
    adv = stepgrpo.group_advantages(spans, [[0.7, 0.2]] * 4, [1.0] * 4)
    assert np.allclose(adv, 0.0)
    # exactly 0 (so main() can skip the row): the mean of 7 copies of 0.1 is not 0.1 in floating point
    assert np.mean([0.1] * 7) != 0.1 and stepgrpo.norm([0.1] * 7).tolist() == [0.0] * 7

class BowEncoder:
    vocab = ["which", "country", "is", "x", "in", "none", "who", "founded", "y"]
    def __call__(self, texts):
        return np.array([[t.lower().replace("?", "").split().count(w) for w in self.vocab] for t in texts], dtype=float)

def traj(steps, spans, final, ok=True):
    gold = [dict(sub_question="Which country is X in?", kb="text", doc_id="d1", answer="Uldoria"),
            dict(sub_question="Who founded Y?", kb="table", doc_id="d2", answer="Ly Normi")]
    return dict(gold_steps=gold, steps=steps, spans=[sp(k, t) for k, t in spans], final_answer=final, answers=["Ly Normi"],
                format_ok=ok)

def test_span_rewards_follow_the_formulas():
    w = stepgrpo.Weights(format=0.2, route=1.0, hit=0.5, answer=1.0)
    enc = BowEncoder()
    x = traj([dict(sub_question="Which country is X in?", kb="text", retrieved=["d1"], answer="Uldoria"),
              dict(sub_question="Who founded Y?", kb="image", retrieved=["d9"], answer="someone")],
             [("route", 0), ("answer", 0), ("route", 1), ("answer", 1), ("route", 2), ("final", 2)], "Ly Normi")
    r, outcome = stepgrpo.span_rewards(x, enc, w)
    r0 = list(r)
    assert r[0] == pytest.approx(0.2 + 1.0 + 0.5)            # same sub-question, same KB, gold doc retrieved
    assert r[1] == pytest.approx(0.2 + 1.0)                  # intermediate answer right
    assert r[2] == pytest.approx(0.2 + 0.5)                  # right sub-question, wrong KB, gold doc missed
    assert r[3] == pytest.approx(0.2)                        # wrong intermediate answer
    assert r[4] == pytest.approx(0.2 + 1.0)                  # stopped exactly where the gold stops
    assert r[5] == pytest.approx(0.2) and outcome == 1.0
    early = traj([dict(sub_question="Which country is X in?", kb="text", retrieved=["d1"], answer="Uldoria")],
                 [("route", 0), ("answer", 0), ("route", 1), ("final", 1)], "Uldoria")
    r, outcome = stepgrpo.span_rewards(early, enc, w)
    cos = reward.route_reward(reward.Route(ok=True, sub_question="None", stop=True), "Who founded Y?", "table", enc)
    assert r[2] == pytest.approx(0.2 + cos) and outcome == 0.0   # a stop where the gold retrieves: no KB credit
    bad = traj([], [("route", 0)], None, ok=False)
    assert stepgrpo.span_rewards(bad, enc, w) == ([0.0], 0.0)
    # --w_repeat: a route step that re-asks an earlier sub-question (case and outer spaces aside) loses w_repeat
    reask = traj([dict(sub_question="Which country is X in?", kb="text", retrieved=["d1"], answer="Uldoria"),
                  dict(sub_question=" which country is X in? ", kb="table", retrieved=["d1"], answer="Uldoria")],
                 [("route", 0), ("answer", 0), ("route", 1), ("answer", 1), ("route", 2), ("final", 2)], "Ly Normi")
    plain = stepgrpo.span_rewards(reask, enc, w)[0]
    w.repeat = 0.3
    assert np.allclose(np.subtract(plain, stepgrpo.span_rewards(reask, enc, w)[0]), [0, 0, 0.3, 0, 0, 0])
    assert stepgrpo.span_rewards(x, enc, w)[0] == pytest.approx(r0)  # no re-ask: unchanged

def test_split_credit_separates_the_sub_question_from_the_kb_choice():
    from transformers import AutoTokenizer
    import rollout
    tok = AutoTokenizer.from_pretrained(rollout.DEFAULT_MODEL)
    w = stepgrpo.Weights(format=0.2, route=1.0, hit=0.0, answer=1.0)
    route = tok.encode(reward.format_route("A figure: the table retriever.", "Which country is X in?", "table") + "<|im_end|>")
    answer = tok.encode("<think>t</think>\n<answer>Uldoria</answer><|im_end|>")
    x = traj([dict(sub_question="Which country is X in?", kb="table", retrieved=["d9"], answer="Uldoria")], [], "Uldoria")
    x["ids"] = [7, 7] + route + [7] + answer
    x["spans"] = [dict(kind="route", step=0, start=2, end=2 + len(route)),
                  dict(kind="answer", step=0, start=3 + len(route), end=3 + len(route) + len(answer))]
    r, _ = stepgrpo.span_rewards(x, BowEncoder(), w)
    spans, rs = stepgrpo.split_route_spans(x, r, w, tok)
    assert [s["kind"] for s in spans] == ["route_q", "route_kb", "answer"]
    q, kb = spans[0], spans[1]
    assert kb["start"] == 2 and kb["end"] == q["start"] and q["end"] == kb["also"][0] and kb["also"][1] == 2 + len(route)
    dec = lambda lo, hi: tok.decode(x["ids"][lo:hi])
    assert dec(q["start"], q["end"]).strip() == "<sub-question>Which country is X in?</sub-question>"
    assert "table retriever" in dec(kb["start"], kb["end"]) and "<ret>Table Retriever</ret>" in dec(*kb["also"])
    assert rs[1] == pytest.approx(0.2) and rs[0] == pytest.approx(r[0] - 0.2) == pytest.approx(0.5)  # wrong KB
    x["steps"][0]["kb"] = "text"
    right = stepgrpo.split_route_spans(x, stepgrpo.span_rewards(x, BowEncoder(), w)[0], w, tok)[1]
    assert right[:2] == pytest.approx([0.5, 0.2 + 0.5]) and right[2] == pytest.approx(0.2 + 1.0)
    # two samples differing only in the KB: the advantage lands on both ranges of route_kb, none on the sub-question
    adv = stepgrpo.group_advantages([spans, spans], [right, rs], [0.0, 0.0])[0]
    tok_adv = stepgrpo.token_advantages(len(x["ids"]), spans, adv)
    assert all(v > 0 for v in tok_adv[kb["start"]:kb["end"]] + tok_adv[kb["also"][0]:kb["also"][1]])
    assert all(v == 0 for v in tok_adv[q["start"]:q["end"]] + tok_adv[:2] + tok_adv[kb["also"][1]:])

def test_loss_matches_a_direct_computation():
    torch.manual_seed(0)
    lens = [4, 1, 3]  # policy tokens of three sequences, flattened as collate() does
    seq = torch.tensor([b for b, n in enumerate(lens) for _ in range(n)])
    N = len(seq)
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
    loss, kl, clipped = stepgrpo.grpo_loss(logp, old, ref, adv, seq, eps, beta, "token", N, 3)
    assert loss.item() == pytest.approx(sum(per_tok) / N, rel=1e-5)
    loss, _, _ = stepgrpo.grpo_loss(logp, old, ref, adv, seq, eps, beta, "sequence", 3, 3)
    means = [sum(per_tok[i] for i in range(N) if seq[i] == b) / n for b, n in enumerate(lens)]
    assert loss.item() == pytest.approx(sum(means) / 3, rel=1e-5)
    assert torch.all(kl >= 0) and clipped.tolist() == [float(abs(math.exp(logp[i] - old[i]) - 1) > eps) for i in range(N)]

def test_only_policy_tokens_reach_the_loss(tiny_model_dir):
    # token_logprobs gives exactly the logprobs of the selected (policy) tokens, as a full forward would
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    seqs = [dict(ids=[5, 6, 7, 8, 9], mask=[0, 0, 1, 1, 0], old=[0.0] * 5, adv=[0.0, 0.0, 2.0, 2.0, 0.0]),
            dict(ids=[5, 9, 11], mask=[0, 1, 1], old=[0.0, -0.1, -0.2], adv=[0.0, -1.0, -1.0])]
    ids, attn, pos, sel, old, adv, seq = stepgrpo.collate(seqs, pad_id=0, device="cpu")
    assert pos is None and sel.tolist() == [[False, True, True, False], [True, True, False, False]]
    assert old.tolist() == pytest.approx([0.0, 0.0, -0.1, -0.2]) and adv.tolist() == [2.0, 2.0, -1.0, -1.0]
    assert seq.tolist() == [0, 0, 1, 1]
    logp, ent = stepgrpo.token_logprobs(model, ids, attn, sel)
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=attn).logits[:, :-1].log_softmax(-1)  # [B, T-1, V]
    want = [full[0, 1, 7], full[0, 2, 8], full[1, 0, 9], full[1, 1, 11]]
    assert torch.allclose(logp, torch.stack(want), atol=1e-5) and ent.shape == (4,)

def test_packed_group_scores_like_separate_rows(tiny_model_dir):
    # --share_prefix: a group's completions packed behind one copy of their prompt give the same logprobs, advantages,
    # sequence indices and loss (both normalisations) as one row per completion, with padding in the batch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa")
    g = torch.Generator().manual_seed(0)
    rand = lambda n: torch.randint(3, 100, (n,), generator=g).tolist()
    groups = [(rand(9), [(rand(3), [-0.5, -1.0, -1.5]), (rand(1), [-0.2]), (rand(4), [-0.1, -0.3, -0.2, -0.4])], [1.0, -0.5, 0.25]),
              (rand(4), [(rand(2), [-0.7, -0.8]), (rand(5), [-1.0] * 5)], [-2.0, 2.0])]
    rows = [dict(ids=p + c, mask=[0] * len(p) + [1] * len(c), old=[0.0] * len(p) + lps, adv=[a] * (len(p) + len(c)))
            for p, group, adv in groups for (c, lps), a in zip(group, adv)]
    packed = [stepgrpo.pack_group(p, group, adv) for p, group, adv in groups]
    assert len(packed[0]["ids"]) == 8 + 3 * 1 + 3 + 1 + 4 and packed[0]["n_seq"] == 3
    A, B = stepgrpo.collate(rows, 0, "cpu"), stepgrpo.collate(packed, 0, "cpu")
    assert A[2] is None and B[1].shape == (2, 1, 19, 19)
    assert B[2][0].tolist() == list(range(12)) + [8, 9] + list(range(8, 13))  # each branch continues the prompt
    assert B[2][1].tolist()[:12] == [0, 1, 2, 3, 4, 5, 3, 4, 5, 6, 7, 8]
    for k in (4, 5, 6):  # old, adv, seq
        assert torch.equal(A[k], B[k])
    with torch.no_grad():
        la, ea = stepgrpo.token_logprobs(model, A[0], A[1], A[3], A[2])
        lb, eb = stepgrpo.token_logprobs(model, B[0], B[1], B[3], B[2])
    assert torch.allclose(la, lb, atol=1e-5) and torch.allclose(ea, eb, atol=1e-4)
    wrong = stepgrpo.token_logprobs(model, B[0], torch.ones_like(B[0]), B[3])[0]  # the packed row with a plain causal mask
    assert not torch.allclose(la, wrong, atol=1e-3)
    for norm_mode, denom in (("token", len(la)), ("sequence", 5)):
        loss = lambda L, seq: stepgrpo.grpo_loss(L, A[4] - 0.1, L, A[5], seq, 0.2, 0.0, norm_mode, denom, int(seq.max()) + 1)[0]
        assert loss(la, A[6]).item() == pytest.approx(loss(lb, B[6]).item(), abs=1e-6)

def test_zero_advantage_rows_add_no_gradient(tiny_model_dir):
    # main() skips rows whose advantages are all 0 when --kl_coef is 0, keeping the full batch's denominator: the
    # gradient must equal the one over every row. With a KL term such a row does move the policy, so it is kept
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    live = [dict(ids=[5, 6, 7, 8], mask=[0, 1, 1, 1], old=[0.0, -4.0, -4.5, -4.0], adv=[0.0, 1.0, 1.0, 1.0]),
            dict(ids=[5, 9, 11], mask=[0, 1, 1], old=[0.0, -4.2, -4.4], adv=[0.0, -1.0, -1.0])]
    dead = dict(ids=[5, 12, 13, 14, 15], mask=[0, 0, 1, 1, 1], old=[0.0, 0.0, -4.1, -4.3, -4.6], adv=[0.0] * 5)
    def grads(rows, kl_coef, norm_mode, denom):
        model.zero_grad()
        ids, attn, pos, sel, old, adv, seq = stepgrpo.collate(rows, 0, "cpu")
        logp, _ = stepgrpo.token_logprobs(model, ids, attn, sel, pos)
        stepgrpo.grpo_loss(logp, old, old - 0.3, adv, seq, 0.2, kl_coef, norm_mode, denom, int(seq.max()) + 1)[0].backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])
    for norm_mode, denom in (("token", 8), ("sequence", 3)):
        full = grads(live + [dead], 0.0, norm_mode, denom)
        assert full.abs().max() > 1e-4 and torch.allclose(grads(live, 0.0, norm_mode, denom), full, atol=1e-7)
    assert not torch.allclose(grads(live, 0.1, "token", 8), grads(live + [dead], 0.1, "token", 8), atol=1e-5)

#### end to end: 2-rank torchrun with vLLM sync, and exact resume (subprocesses, the real command line)

import json
import subprocess
import sys
from pathlib import Path

from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]

def run(args, nproc=1):
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)] if nproc > 1 else [sys.executable]
    r = subprocess.run(launcher + [str(ROOT / "stepgrpo.py")] + args, capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    return r

def common(model, data, out):
    # the tiny random policy cannot write the step format, so every reward and advantage is 0: weight decay and the
    # KL term (once the policy has moved away from the reference) are what change the weights here
    return ["--model", str(model), "--data", str(data), "--out", str(out), "--batch_questions", "2", "-n", "2",
            "--route_tokens", "8", "--answer_tokens", "8", "--retriever", "bm25", "--lr", "1e-2", "--weight_decay", "0.1",
            "--kl_coef", "0.1", "--wandb_mode", "disabled", "--save_every", "1"]

def records(out):
    return [json.loads(l) for l in open(Path(out) / "log.jsonl")]

def test_two_ranks_sync_vllm_after_every_update(tmp_path, tiny_model_dir, tiny_index):
    out = tmp_path / "run"
    run(common(tiny_model_dir, tiny_index, out) + ["--train_steps", "2", "--check_sync", "--dtype", "fp32"], nproc=2)
    recs = records(out)
    assert [r["step"] for r in recs] == [1, 2]
    assert all(r["sync_max_diff"] < 1e-4 for r in recs)  # the engine scores exactly like the trainer after each sync
    assert recs[1]["kl"] > 0  # the policy moved away from the frozen reference
    before, after = load_file(tiny_model_dir / "model.safetensors"), load_file(out / "final" / "model.safetensors")
    assert max((before[k] - after[k]).abs().max().item() for k in before) > 1e-4
    assert (out / "curves.png").stat().st_size > 10_000

def test_two_ranks_skip_zero_advantage_rows_without_a_kl_term(tmp_path, tiny_model_dir, tiny_index):
    # the tiny random policy earns 0 advantage everywhere: with --kl_coef 0 every row is skipped, yet both ranks still
    # run one (zero-weight) micro-batch so FSDP's collectives match, and without weight decay nothing moves
    out = tmp_path / "run"
    args = common(tiny_model_dir, tiny_index, out) + ["--train_steps", "2", "--dtype", "fp32"]
    args[args.index("--kl_coef") + 1], args[args.index("--weight_decay") + 1] = "0", "0"
    run(args, nproc=2)
    assert [r["skipped"] for r in records(out)] == [1.0, 1.0]
    before, after = load_file(tiny_model_dir / "model.safetensors"), load_file(out / "final" / "model.safetensors")
    assert all(torch.equal(before[k], after[k]) for k in before)

def test_sft_anchor_is_the_gold_trajectories_nll(tmp_path, tiny_model_dir, tiny_index):
    # every advantage of the tiny random policy is 0, so with no KL term and no weight decay --sft_coef's anchor is the
    # whole update: its logged NLL (2 ranks, one question each) must be the mean policy-token NLL of the step's gold
    # trajectories under the starting model, computed here directly, and the step must lower it
    import corpus, retrievers, rollout
    from transformers import AutoModelForCausalLM, AutoTokenizer
    out = tmp_path / "run"
    args = common(tiny_model_dir, tiny_index, out) + ["--train_steps", "1", "--dtype", "fp32", "--sft_coef", "1"]
    args[args.index("--kl_coef") + 1], args[args.index("--weight_decay") + 1], args[args.index("--lr") + 1] = "0", "0", "1e-3"
    run(args, nproc=2)
    questions = corpus.load_questions(tiny_index, "train")
    perm = torch.randperm(len(questions), generator=torch.Generator().manual_seed(0)).tolist()  # step 0's batch
    golds, _ = rollout.golden_prefixes(AutoTokenizer.from_pretrained(tiny_model_dir), retrievers.Retriever(tiny_index, "bm25"),
                                       [questions[i] for i in perm[:2]], rollout.Settings(max_steps=3, topk=3))

    def nll(path):
        model, total, count = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), 0.0, 0
        with torch.no_grad():
            for x in golds:
                ids, mask = torch.tensor(x["ids"]), torch.tensor(x["mask"][1:]).bool()  # [T], [T-1]
                logp = model(ids[None]).logits[0, :-1].log_softmax(-1).gather(-1, ids[1:, None])[:, 0]  # [T-1]
                total, count = total - logp[mask].sum().item(), count + int(mask.sum())
        return total / count

    start = nll(tiny_model_dir)
    assert records(out)[0]["sft_nll"] == pytest.approx(start, rel=1e-5)
    assert nll(out / "final") < start - 0.01

def test_resume_continues_exactly(tmp_path, tiny_model_dir, tiny_index):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run(common(tiny_model_dir, tiny_index, straight) + ["--train_steps", "2"])
    run(common(tiny_model_dir, tiny_index, resumed) + ["--train_steps", "1"])
    run(common(tiny_model_dir, tiny_index, resumed) + ["--train_steps", "2", "--resume"])
    a, b = load_file(straight / "final" / "model.safetensors"), load_file(resumed / "final" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    ra, rb = records(straight), records(resumed)
    assert [r["step"] for r in rb] == [1, 2]
    for key in ("loss", "kl", "entropy", "tokens", "grad_norm"):
        assert ra[1][key] == pytest.approx(rb[1][key], rel=1e-6, abs=1e-9), key

def test_teacher_prefix_packed_update_equals_unpacked(tmp_path, tiny_model_dir, tiny_index):
    # the paper's per-step groups, through FSDP, the real rollouts and the KL term: sharing each group's prompt in one
    # packed row (--share_prefix, the default) must train exactly like one row per completion
    outs = {}
    for flag in ("--share_prefix", "--no-share_prefix"):
        outs[flag] = tmp_path / flag
        run(common(tiny_model_dir, tiny_index, outs[flag]) + ["--rollout", "teacher_prefix", "--train_steps", "2",
                                                              "--dtype", "fp32", "--micro_batch", "64", flag])
    ra, rb = records(outs["--share_prefix"]), records(outs["--no-share_prefix"])
    assert ra[1]["kl"] > 0 and ra[1]["tokens"] == rb[1]["tokens"]
    for key in ("loss", "kl", "entropy", "grad_norm"):
        assert ra[1][key] == pytest.approx(rb[1][key], rel=1e-4), key
    # step 1 moves the weights by weight decay alone; step 2's update (KL gradients through the packed rows) must match.
    # Not element-wise: Adam turns float noise in near-zero gradients into steps of up to lr
    w1 = load_file(outs["--share_prefix"] / "step_1" / "model.safetensors")
    da, db = (torch.cat([(load_file(outs[f] / "final" / "model.safetensors")[k] - w1[k]).flatten() for k in w1])
              for f in ("--share_prefix", "--no-share_prefix"))
    assert (da - db).norm() < 0.01 * da.norm() and da.norm() > 0.1

def test_teacher_prefix_groups_with_the_gold_policy(tiny_index, encoder):
    # GoldPolicy as the engine writes the gold step at every golden prefix: one group per span kept, each completion
    # parses and routes to the gold KB with the full route reward, so every advantage is 0
    from argparse import Namespace

    from transformers import AutoTokenizer

    import corpus
    import retrievers
    import rollout
    tok = AutoTokenizer.from_pretrained(rollout.DEFAULT_MODEL)
    qs = corpus.load_questions(tiny_index, "train")[:6]
    ret, gold = retrievers.Retriever(tiny_index, "bm25"), rollout.GoldPolicy(tok, qs)
    _, prefixes = rollout.golden_prefixes(tok, ret, qs)
    n_route = sum(sp["kind"] == "route" for _, sp, _ in prefixes)
    for spans, share in (("all", True), ("route", True), ("route", False)):
        args = Namespace(max_steps=3, topk=3, route_tokens=64, answer_tokens=48, temperature=1.0, group_size=2,
                         teacher_spans=spans, share_prefix=share, w_outcome=1.0, prefixes="gold")
        seqs, st = stepgrpo.teacher_prefix_batch(gold, ret, qs, args, encoder.encode, stepgrpo.Weights(), seed=0)
        groups = len(prefixes) if spans == "all" else n_route
        assert len(seqs) == groups * (1 if share else 2) and sum(s.get("n_seq", 1) for s in seqs) == 2 * groups
        assert st["kb_acc"] == [1.0] * 2 * n_route and st["route_r"] == pytest.approx([1.2] * 2 * n_route)
        # one per sampled retrieval (every route prefix but each question's stop): the gold never re-asks
        assert st["reask"] == [0.0] * (2 * n_route - 2 * len(qs))
        assert (st["answer_r"] == []) == (spans == "route")
        assert all(a == 0.0 for s in seqs for a in s["adv"])
        completions = [tok.decode([t for t, m in zip(s["ids"], s["mask"]) if m]) for s in seqs]
        assert (spans == "route") == all("</ret>" in c and "<answer>" not in c for c in completions)

def test_teacher_prefix_penalises_re_asking_a_gold_prefix_sub_question(tiny_index, encoder):
    # an engine that, past the first step, re-asks the previous gold sub-question: with --w_repeat 0.5 exactly those
    # route completions lose 0.5, the first step's do not
    from argparse import Namespace

    from transformers import AutoTokenizer

    import corpus
    import retrievers
    import rollout

    class Reasker(rollout.GoldPolicy):
        def step_text(self, q, n_routes, n_answers, phase, stopped):
            if phase == "route" and n_routes > 0:
                g = q["steps"][n_routes - 1]
                return reward.format_route(self.WHY[g["kb"]], g["sub_question"], g["kb"])
            return super().step_text(q, n_routes, n_answers, phase, stopped)
    tok = AutoTokenizer.from_pretrained(rollout.DEFAULT_MODEL)
    qs = corpus.load_questions(tiny_index, "train")[:6]
    ret = retrievers.Retriever(tiny_index, "bm25")
    _, prefixes = rollout.golden_prefixes(tok, ret, qs)
    later = [sp["step"] > 0 for _, sp, _ in prefixes if sp["kind"] == "route" for _ in range(2)]
    args = Namespace(max_steps=3, topk=3, route_tokens=64, answer_tokens=48, temperature=1.0, group_size=2,
                     teacher_spans="route", share_prefix=True, w_outcome=1.0, prefixes="gold")
    st = [stepgrpo.teacher_prefix_batch(Reasker(tok, qs), ret, qs, args, encoder.encode, stepgrpo.Weights(repeat=c), seed=0)[1]
          for c in (0.0, 0.5)]
    r = [s["route_r"] for s in st]
    assert any(later) and not all(later)
    assert np.allclose(np.subtract(r[0], r[1]), [0.5 * f for f in later])
    # logged whether penalised or not, one per sampled retrieval (a question with no gold step stops at step 0)
    asked = [float(sp["step"] > 0) for x, sp, _ in prefixes if sp["kind"] == "route" and (sp["step"] or x["gold_steps"])
             for _ in range(2)]
    assert st[0]["reask"] == st[1]["reask"] == asked and 0 < sum(asked) < len(asked)

def test_next_gold_step_is_the_first_gold_document_not_yet_retrieved():
    gold = [dict(doc_id="a"), dict(doc_id="b")]
    step = lambda *ids: dict(retrieved=list(ids))
    assert stepgrpo.next_gold_step(gold, []) == 0
    assert stepgrpo.next_gold_step(gold, [step("x", "a")]) == 1
    assert stepgrpo.next_gold_step(gold, [step("x")]) == 0  # a miss (wrong KB, bad sub-question): ask it again
    assert stepgrpo.next_gold_step(gold, [step("b")]) == 0  # a skipped step is still the target
    assert stepgrpo.next_gold_step(gold, [step("a"), step("b", "c")]) is None  # all in the context: stop
    assert stepgrpo.next_gold_step(gold, [step("a", "b")]) is None
    assert stepgrpo.next_gold_step([], []) is None

def policy_prefix_setup(tiny_index):
    from argparse import Namespace

    from transformers import AutoTokenizer

    import corpus
    import retrievers
    import rollout
    tok = AutoTokenizer.from_pretrained(rollout.DEFAULT_MODEL)
    qs = corpus.load_questions(tiny_index, "train")[:8]
    args = Namespace(max_steps=3, topk=3, route_tokens=64, answer_tokens=48, temperature=1.0, group_size=2,
                     teacher_spans="route", share_prefix=True, w_outcome=1.0, prefixes="policy")
    return tok, qs, retrievers.Retriever(tiny_index, "dense"), args

def test_policy_prefixes_of_the_gold_policy_are_its_golden_prefixes(tiny_index, encoder):
    # the gold policy's own greedy trajectory is the golden one: the same route prompts, and since every gold step
    # retrieves its document the targets are the gold steps, so every sample scores the full route reward
    import rollout
    tok, qs, ret, args = policy_prefix_setup(tiny_index)
    gold = rollout.GoldPolicy(tok, qs)
    _, own = stepgrpo.policy_prefixes(gold, ret, qs, args)
    golds, prefixes = rollout.golden_prefixes(tok, ret, qs)
    assert all(g["doc_id"] in st["retrieved"] for x in golds for g, st in zip(x["gold_steps"], x["steps"]))
    assert [p for _, sp, p in prefixes if sp["kind"] == "route"] == [p for _, _, p in own]
    seqs, st = stepgrpo.teacher_prefix_batch(gold, ret, qs, args, encoder.encode, stepgrpo.Weights(), seed=0)
    assert len(seqs) == len(own) and st["route_r"] == pytest.approx([1.2] * 2 * len(own))
    assert st["retrievals"] == [len(x["gold_steps"]) for x in golds]

def test_policy_prefixes_target_stop_after_a_re_ask_of_a_one_hop_question(tiny_index, encoder):
    # a policy that re-asks its first sub-question at step 1 and then asks gold step 1 (a 1-hop question: gold step 0
    # a third time): on its own prefixes the target at steps 1 and 2 is gold step 1, or stop for a 1-hop question
    import reward
    import rollout

    class Reasker(rollout.GoldPolicy):
        def step_text(self, q, n_routes, n_answers, phase, stopped):
            g = q["steps"][min(n_routes, len(q["steps"])) - 1] if q["steps"] else None  # the step last asked
            if phase == "route" and n_routes in (1, 2) and g:
                return reward.format_route(self.WHY[g["kb"]], g["sub_question"], g["kb"])
            if phase == "answer" and n_answers < n_routes and not stopped:
                return reward.format_answer("From the evidence.", g["answer"])
            return super().step_text(q, n_routes, n_answers, phase, stopped)
    tok, qs, ret, args = policy_prefix_setup(tiny_index)
    engine = Reasker(tok, qs)
    _, own = stepgrpo.policy_prefixes(engine, ret, qs, args)
    expected = []  # [KB written == target KB] per sample, by hand
    for q in qs:
        g = q["steps"]
        if not g:  # stops at once: the target is stop
            expected += [1.0] * 2
            continue
        target1 = g[1]["kb"] if len(g) > 1 else None
        expected += [1.0] * 2 + [float(g[0]["kb"] == target1)] * 2 + [float(g[1]["kb"] == target1 if len(g) > 1 else 0)] * 2
    assert len(own) == sum(3 if q["steps"] else 1 for q in qs)
    assert any(len(q["steps"]) == 1 for q in qs) and any(len(q["steps"]) > 1 for q in qs)
    st = stepgrpo.teacher_prefix_batch(engine, ret, qs, args, encoder.encode, stepgrpo.Weights(), seed=0)[1]
    assert st["kb_acc"] == expected
    # the re-ask at step 1 is logged against the policy's own earlier steps
    assert st["reask"] == [f for q in qs if q["steps"] for f in [0.0] * 2 + [1.0] * 2 + [float(len(q["steps"]) == 1)] * 2]

def test_bad_flags_exit_with_an_error_naming_the_flag(tmp_path):
    for extra, flag in ((["--prefixes", "policy"], "--prefixes"),
                        (["--rollout", "teacher_prefix", "--prefixes", "policy"], "--prefixes"),
                        (["--balance_kb", "-1"], "--balance_kb")):
        r = subprocess.run([sys.executable, "stepgrpo.py", "--data", str(tmp_path), *extra], capture_output=True, text=True)
        last = r.stderr.strip().splitlines()[-1]  # one line, not a traceback
        assert r.returncode != 0 and last.startswith("error: ") and flag in last, r.stderr

def test_dev_eval_keeps_the_best_checkpoint_and_leaves_training_unchanged(tmp_path, tiny_model_dir, tiny_index):
    plain, evald = tmp_path / "plain", tmp_path / "eval"
    run(common(tiny_model_dir, tiny_index, plain) + ["--train_steps", "3"])
    r = run(common(tiny_model_dir, tiny_index, evald) + ["--train_steps", "3", "--keep", "1", "--eval_questions", "3",
                                                         "--eval_split", "test"])
    a, b = load_file(plain / "final" / "model.safetensors"), load_file(evald / "final" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)  # the greedy dev rollouts do not disturb training
    recs = records(evald)
    assert [x["step"] for x in recs] == [0, 1, 2, 3] and all("dev_score" in x for x in recs)
    assert "loss" not in recs[0]  # step 0: the starting policy's dev score only
    scores = {x["step"]: x["dev_score"] for x in recs[1:]}
    best = max(scores, key=scores.get)  # the earliest of equal scores
    assert (evald / "best").resolve().name == f"step_{best}" and (evald / "best" / "model.safetensors").exists()
    # --keep 1 keeps the newest checkpoint and the best one only
    assert sorted(p.name for p in evald.glob("step_*")) == sorted({f"step_{best}", "step_3"})
    assert f"best on test (f1_routing): step {best}" in r.stdout
