"""steprewards.py: the rewards of an on-policy trajectory's spans against their formulas, on hand-made trajectories
and on gold ones cut by the context."""
import numpy as np
import pytest

import prepare
import reward
import steprewards

class BowEncoder:
    vocab = ["which", "country", "is", "x", "in", "none", "who", "founded", "y"]
    def __call__(self, texts):
        return np.array([[t.lower().replace("?", "").split().count(w) for w in self.vocab] for t in texts], dtype=float)

def traj(steps, spans, final, ok=True, gold_step=(0, 1)):
    """Two gold lookups, at routing steps gold_step; predicted lookup i at routing step i unless it says otherwise."""
    gold = [dict(sub_question="Which country is X in?", kb="text", doc_id="d1", answer="Uldoria", step=gold_step[0]),
            dict(sub_question="Who founded Y?", kb="table", doc_id="d2", answer="Ly Normi", step=gold_step[1])]
    return dict(gold_steps=gold, steps=[dict(s, step=s.get("step", i)) for i, s in enumerate(steps)],
                spans=[dict(kind=k, step=t, start=0, end=1) for k, t in spans], final_answer=final, answers=["Ly Normi"], format_ok=ok)

def test_a_trajectory_cut_by_the_context_keeps_the_rewards_of_its_spans(tiny_index, encoder):
    # gold trajectories through the real loop, then again with a context too short for about half of them: each cut
    # one's spans score exactly as in the whole one (its last, well-written span too), and its outcome is 0
    from transformers import AutoTokenizer

    import dataio
    import retrievers
    import rollout
    tok, ret = AutoTokenizer.from_pretrained(prepare.DEFAULT_MODEL), retrievers.Retriever(tiny_index, "bm25")
    qs = dataio.load_questions(tiny_index, "train")[:8]
    full = rollout.rollout(rollout.GoldPolicy(tok, qs), ret, qs)
    eng = rollout.GoldPolicy(tok, qs)
    eng.max_len = 96 + sorted(len(x["ids"]) for x in full)[4] - 40
    cut = [y for y in rollout.rollout(eng, ret, qs) if y["overflow"]]
    assert cut
    w = steprewards.Weights(format=0.2)
    for y in cut:
        x = next(x for x in full if x["qid"] == y["qid"])
        r, outcome = steprewards.span_rewards(y, encoder.encode, w)
        assert r == pytest.approx(steprewards.span_rewards(x, encoder.encode, w)[0][:len(r)]) and outcome == 0.0
        assert r and min(r) >= 0.2  # every span the gold policy wrote earns its format reward at least

def test_span_rewards_follow_the_formulas():
    w = steprewards.Weights(format=0.2, hit=0.5)
    enc = BowEncoder()
    x = traj([dict(sub_question="Which country is X in?", kb="text", retrieved=["d1"], answer="Uldoria"),
              dict(sub_question="Who founded Y?", kb="image", retrieved=["d9"], answer="someone")],
             [("route", 0), ("answer", 0), ("route", 1), ("answer", 1), ("route", 2), ("final", 2)], "Ly Normi")
    r, outcome = steprewards.span_rewards(x, enc, w)
    assert r[0] == pytest.approx(0.2 + 1.0 + 0.5)            # same sub-question, same KB, gold doc retrieved
    assert r[1] == pytest.approx(0.2 + 1.0)                  # intermediate answer right
    assert r[2] == pytest.approx(0.2 + 0.5)                  # right sub-question, wrong KB, gold doc missed
    assert r[3] == pytest.approx(0.2)                        # wrong intermediate answer
    assert r[4] == pytest.approx(0.2 + 1.0)                  # stopped exactly where the gold stops
    assert r[5] == pytest.approx(0.2) and outcome == 1.0
    early = traj([dict(sub_question="Which country is X in?", kb="text", retrieved=["d1"], answer="Uldoria")],
                 [("route", 0), ("answer", 0), ("route", 1), ("final", 1)], "Uldoria")
    r, outcome = steprewards.span_rewards(early, enc, w)
    cos = reward.route_reward(reward.Route(ok=True, sub_question="None", stop=True),
                              [dict(sub_question="Who founded Y?", kb="table")], enc)
    assert r[2] == pytest.approx(0.2 + cos) and outcome == 0.0   # a stop where the gold retrieves: no KB credit
    bad = traj([], [("route", 0)], None, ok=False)
    assert steprewards.span_rewards(bad, enc, w) == ([0.0], 0.0)
    # the table its right Table Retriever step fetched made the answer step overflow: the route keeps its full reward
    cut = traj([dict(sub_question="Which country is X in?", kb="text", retrieved=["d1"], answer="Uldoria"),
                dict(sub_question="Who founded Y?", kb="table", retrieved=["d2"], answer=None)],
               [("route", 0), ("answer", 0), ("route", 1)], None)
    cut["overflow"] = True
    r, outcome = steprewards.span_rewards(cut, enc, w)
    assert r[2] == pytest.approx(0.2 + 1.0 + 0.5) and outcome == 0.0

def test_span_rewards_of_multi_query_steps():
    # both gold lookups belong to routing step 0 (independent): asked together, in either order, the step earns the
    # full route reward, the hit reward and, answered together, the answer reward of "Uldoria; Ly Normi"
    w, enc = steprewards.Weights(format=0.2, hit=0.5), BowEncoder()
    a = dict(sub_question="Who founded Y?", kb="table", retrieved=["d2"], answer="Ly Normi and Uldoria", step=0)
    b = dict(sub_question="Which country is X in?", kb="text", retrieved=["d7"], answer="Ly Normi and Uldoria", step=0)
    spans = [("route", 0), ("answer", 0), ("route", 1), ("final", 1)]
    r, outcome = steprewards.span_rewards(traj([a, b], spans, "Ly Normi", gold_step=(0, 0)), enc, w)
    assert r == pytest.approx([0.2 + 1.0 + 0.5 * 1 / 2, 0.2 + 1.0, 0.2 + 1.0, 0.2]) and outcome == 1.0  # d1 missed
    # one of the two asked: half the route reward; an answer covering one of two short golds: 0 (all or nothing)
    r, _ = steprewards.span_rewards(traj([dict(a, answer="Ly Normi")], spans, "Ly Normi", gold_step=(0, 0)), enc, w)
    assert r[:2] == pytest.approx([0.2 + 1.0 / 2 + 0.5 * 1 / 2, 0.2])
    # route classes and accuracy: a step is right when its KBs are the gold step's, in any order
    gold = traj([], [], None, gold_step=(0, 0))["gold_steps"]
    assert steprewards.route_kbs(gold, 0) == ("table", "text") == steprewards.route_kbs([a, b], 0)
    assert steprewards.route_kbs(gold, 1) == ("stop",) and steprewards.gold_route(gold, 0) == "text"

def test_kb_credit_is_the_kb_term_of_whatever_step_reward_is(monkeypatch):
    # R1-Router's route reward: the blanked step loses exactly 0.5 [KB = target's] (a pair's share with several),
    # the wording and format terms stay; a stop is judged as a KB choice too; a malformed step earned nothing
    enc, w = BowEncoder(), steprewards.Weights(format=0.2)
    x_text = [dict(sub_question="Which country is X in?", kb="text")]
    route = lambda text: reward.parse_route(text, max_pairs=2)
    right = route(reward.format_route("t", [("Which country is X in?", "text")]))
    wrong = route(reward.format_route("t", [("Who founded Y?", "table")]))
    stop = route(reward.format_route("t", []))
    two = route(reward.format_route("t", [("Which country is X in?", "text"), ("Who founded Y?", "image")]))
    both = x_text + [dict(sub_question="Who founded Y?", kb="table")]
    for step, target, kb in ((right, x_text, 0.5), (wrong, x_text, 0.0), (stop, [], 0.5), (stop, x_text, 0.0),
                             (right, [], 0.0), (two, both, 0.25)):
        r = steprewards.step_reward("route", step, target, w, enc)
        assert steprewards.kb_credit(step, target, w, enc, r) == pytest.approx(kb), (step, target)
    bad = reward.parse_route("no tags")
    assert steprewards.kb_credit(bad, x_text, w, enc, 0.0) == 0.0
    # a fork's reward of the KB alone: all of it; of the wording alone: none of it
    monkeypatch.setattr(steprewards, "step_reward", lambda kind, step, *a, **k: float("table" in step.pairs[0][1])
                        if step.pairs else 0.0)
    assert steprewards.kb_credit(wrong, x_text, w, enc, 1.0) == 1.0
    monkeypatch.setattr(steprewards, "step_reward", lambda kind, step, *a, **k: float("X" in step.sub_question))
    assert steprewards.kb_credit(right, x_text, w, enc, 1.0) == 0.0
