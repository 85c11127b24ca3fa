"""Agentic RAG-R1's actions in the step loop (rollout.Settings actions): the parser under fuzzing, the stack's
semantics on scripted policies (rollout.GoldPolicy's script, and policies that misuse the actions), what SFT trains
on, the rewards of the actions on hand-made cases, and the events the server streams."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import dataio
import reward
import retrievers
import rollout
import serve
import steprewards
import synth
from reward import format_action, parse_route

FAST = settings(max_examples=300, deadline=None)
FRAGMENTS = ["<think>", "</think>", "<backtrack>", "</backtrack>", "<summary>", "</summary>", "<sub-question>",
             "</sub-question>", "<ret>", "</ret>", "<answer>", "Text Retriever", "None", "why", " ", "\n", "<", ">"]
NO_BRACKETS = st.text(alphabet=st.characters(blacklist_characters="<>", blacklist_categories=("Cs",)))

#### the parser

@FAST
@given(st.lists(st.sampled_from(FRAGMENTS), max_size=16))
def test_the_parser_never_raises_and_an_action_is_think_then_its_tag_alone(parts):
    text = "".join(parts)
    for actions in (False, True):
        r = parse_route(text, actions=actions)
        assert isinstance(r.ok, bool) and r.ok == (r.error == "")
        assert not r.action or (actions and r.ok and r.note and not r.pairs and not r.stop)
        if r.action:  # re-rendered, it parses to the same action
            again = parse_route(format_action(r.think, r.action, r.note), actions=True)
            assert (again.action, again.think, again.note) == (r.action, r.think, r.note)

@FAST
@given(NO_BRACKETS, NO_BRACKETS.filter(lambda s: s.strip()), st.sampled_from(reward.ACTIONS))
def test_an_action_round_trips(think, note, kind):
    r = parse_route(format_action(think, kind, note), actions=True)
    assert (r.ok, r.action, r.think, r.note) == (True, kind, think.strip(), note.strip())

def test_actions_off_their_tags_are_text_and_on_they_are_the_whole_step():
    back = "<think>t</think>\n<backtrack>the table had nothing</backtrack>"
    assert parse_route(back).error == "missing <sub-question>...</sub-question>"  # R1-Router's format: no such step
    route = "<think>t</think><sub-question>q</sub-question><ret>Text Retriever</ret><summary>x</summary>"
    assert parse_route(route).ok  # after the last tag: ignored, as before
    assert parse_route(route, actions=True).error == "unexpected <sub-question> tag"
    assert parse_route("<think>t</think><backtrack> </backtrack>", actions=True).error == "empty <backtrack>"
    assert parse_route("<think>t</think><summary>a</summary><summary>b</summary>", actions=True).error == \
        "two <summary> tags, expected one"
    assert parse_route("<think>t</think><backtrack>a</backtrack><summary>b</summary>", actions=True).error == \
        "unexpected <summary> tag"

#### the stack on scripted policies

@pytest.fixture(scope="module")
def world(tiny_index, tok):
    qs = dataio.load_questions(tiny_index, "train")[:40]
    return tok, qs, retrievers.Retriever(tiny_index, "bm25")

def run(policy, qs, ret, **kw):
    return rollout.rollout(policy, ret, qs, s=rollout.Settings(topk=2, actions=True, **kw))

def test_a_backtrack_pops_the_last_step_and_its_evidence_and_the_step_is_asked_again(world):
    tok, qs, ret = world
    trajs = run(rollout.GoldPolicy(tok, qs, actions=True), qs, ret)
    detours = [(q, x) for q, x in zip(qs, trajs) if x["actions"] and x["actions"][0]["kind"] == "backtrack"]
    assert len(detours) >= 4 and all(x["format_ok"] for x in trajs)
    for q, x in detours:
        a = x["actions"][0]
        wrong = a["popped"][0]
        assert [(s["sub_question"], s["kb"]) for s in x["steps"]] == [(s["sub_question"], s["kb"]) for s in q["steps"]]
        assert wrong["kb"] != q["steps"][0]["kb"] and wrong["sub_question"] == q["steps"][0]["sub_question"]
        assert x["final_answer"] == q["answers"][0]
        # the popped route and its answer stay in the first chat, marked; the backtrack closes that chat
        kinds = [(sp["kind"], sp.get("popped", False)) for sp in x["spans"]]
        assert kinds[:3] == [("route", True), ("answer", True), ("backtrack", False)] and a["span"] == 2
        (a0, b0), (a1, b1) = x["segments"][:2]
        first, second = x["ids"][a0:b0], x["ids"][a1:b1]
        route = x["spans"][0]
        # the new chat: the old one up to the popped route, then the backtrack's own turn as context
        assert second[:route["start"] - a0] == first[:route["start"] - a0]
        back = x["spans"][2]
        turn = x["ids"][back["start"]:back["end"]]
        assert second[route["start"] - a0:route["start"] - a0 + len(turn)] == turn
        assert sum(x["mask"][a1:a1 + route["start"] - a0 + len(turn)]) == 0  # copied: context, trained once
        wrong_doc = ret.search([wrong["sub_question"]], wrong["kb"], 2)[0][0]["contents"]
        assert wrong_doc in tok.decode(first) and wrong_doc not in tok.decode(x["ids"][a1:])
        assert "<backtrack>" in tok.decode(second)

def test_a_summary_replaces_every_step_so_far(world):
    tok, qs, ret = world
    qs3 = [q for q in qs if len(q["steps"]) == 3]
    assert qs3
    trajs = run(rollout.GoldPolicy(tok, qs3, actions=True), qs3, ret, max_steps=3)
    for q, x in zip(qs3, trajs):
        a = x["actions"][-1]
        assert x["format_ok"] and a["kind"] == "summary" and [s["step"] for s in a["facts"]] == [0, 1]
        last, head = x["ids"][x["segments"][-1][0]:], x["spans"][0]["start"]
        assert last[:head] == x["ids"][:head]  # the system prompt and the question, then the summary
        text = tok.decode(last[head:])
        assert "<summary>" in text and text.index("<summary>") < text.index("<sub-question>")
        assert q["steps"][2]["sub_question"] in text and q["steps"][0]["sub_question"] not in text.split("</summary>")[1]
        assert [s["answer"] for s in x["steps"]] == [s["answer"] for s in q["steps"]]

def test_the_gold_policy_writes_at_each_stored_prefix_what_the_loop_wrote_there(world):
    # the chats an action starts are what the engine saw: asked at every prefix (span_prefixes: what Step-GRPO's
    # groups and the route probe start from, no popped steps or actions), the gold policy writes the same span
    tok, qs, ret = world
    eng = rollout.GoldPolicy(tok, qs, actions=True)
    s = rollout.Settings(topk=2, actions=True)
    trajs = rollout.rollout(eng, ret, qs, s=s)
    prefixes = rollout.span_prefixes(trajs)
    assert not any(sp.get("popped") or sp["kind"] in reward.ACTIONS for _, sp, *_ in prefixes)
    for x, sp, ids, _ in prefixes:
        stop = ["</answer>"] if sp["kind"] != "route" else rollout.route_stop(tok, s)[0]
        (out, _), = eng.generate([ids], 1024, stop=stop, keys=[rollout.turn_key(x, sp)])
        assert out == x["ids"][sp["start"]:sp["end"]]

class Scripted(rollout.GoldPolicy):
    """The gold policy with other turns spliced in before turn `at`."""
    def __init__(self, tok, qs, at, turns):
        super().__init__(tok, qs)  # the gold script without actions, then these turns
        self.at, self.turns = at, turns

    def script(self, q):
        gold = super().script(q)
        return gold[:self.at] + self.turns + gold[self.at:]

def test_actions_with_nothing_to_act_on_or_too_many_are_format_failures(world):
    tok, qs, ret = world
    plain = [q for q in qs if q["steps"]][:2]
    back = ("route", format_action("t", "backtrack", "nothing yet"))
    x = run(Scripted(tok, plain, 0, [back]), plain, ret)[0]
    assert not x["format_ok"] and x["error"] == "step 1 backtrack: no step in the context to act on"
    summ = ("route", format_action("t", "summary", "a"))
    x = run(Scripted(tok, plain, 2, [summ, summ]), plain, ret)[0]  # the second has no step left to summarise
    assert not x["format_ok"] and x["error"] == "step 2 summary: no step in the context to act on"
    step = rollout.GoldPolicy(tok, plain).script(plain[0])[:2]  # the first route and its answer, again
    x = run(Scripted(tok, plain, 2, [back] + step + [back] + step + [back]), plain, ret, max_actions=2)[0]
    assert not x["format_ok"] and x["error"] == "step 2 backtrack: more than 2 actions"
    assert [a["kind"] for a in x["actions"]] == ["backtrack", "backtrack"]
    # actions off (R1-Router's format): a backtrack written anyway is a step that does not parse
    off = rollout.rollout(Scripted(tok, plain, 2, [back]), ret, plain, s=rollout.Settings(topk=2))[0]
    assert not off["format_ok"] and "missing <sub-question>" in off["error"] and not off["actions"]

#### what SFT trains on, and the rewards

def test_sft_data_keeps_what_a_backtrack_popped_as_context_only(world):
    tok, qs, ret = world
    trajs = run(rollout.GoldPolicy(tok, qs, actions=True), qs, ret)
    x = next(x for x in trajs if x["actions"] and x["actions"][0]["kind"] == "backtrack")
    before = list(x["mask"])
    synth.unlearn_popped(x)
    for sp in x["spans"]:
        assert set(x["mask"][sp["start"]:sp["end"]]) == {0 if sp.get("popped") else 1}
    assert sum(before) - sum(x["mask"]) == sum(sp["end"] - sp["start"] for sp in x["spans"] if sp.get("popped"))

def test_the_actions_rewards_on_hand_made_cases(encoder):
    w = steprewards.Weights(format=0.2)
    gold = [dict(sub_question="Where was Ulla born?", kb="text", answer="Selstoa", doc_id="d1")]
    popped = lambda kb: steprewards.as_route([dict(sub_question="Where was Ulla born?", kb=kb, retrieved=[], answer="x", step=0)])
    assert steprewards.step_reward("backtrack", popped("table"), gold, w, encoder.encode) == pytest.approx(1.2)
    assert steprewards.step_reward("backtrack", popped("text"), gold, w, encoder.encode) == pytest.approx(0.2)
    assert steprewards.step_reward("backtrack", popped("text"), [], w, encoder.encode) == pytest.approx(1.2)  # gold stopped
    facts = [dict(gold[0], step=0), dict(sub_question="What is Selstoa's river?", kb="table", answer="the Orn", step=1)]
    summary = lambda s: reward.Answer(ok=True, answer=s)
    assert steprewards.step_reward("summary", summary("Ulla: Selstoa. River: the Orn."), facts, w, None) == pytest.approx(1.2)
    assert steprewards.step_reward("summary", summary("Ulla was born in Selstoa."), facts, w, None) == pytest.approx(0.2 + 1 / 2)
    # (the facts "Selstoa; the Orn" are the tokens selstoa, orn: F1-Recall drops articles and punctuation)
    assert steprewards.step_reward("summary", reward.Answer(ok=False), facts, w, None) == 0.0

def test_an_on_policy_trajectory_scores_its_actions_and_what_they_popped(world, encoder):
    tok, qs, ret = world
    trajs = run(rollout.GoldPolicy(tok, qs, actions=True), qs, ret)
    w = steprewards.Weights(format=0.2)
    x = next(x for x in trajs if x["actions"] and x["actions"][0]["kind"] == "backtrack")
    r, outcome = steprewards.span_rewards(x, encoder.encode, w)
    # the popped route (the gold's sub-question at a wrong KB): 0.2 + 0.5 cos 1 + 0; its answer "not found": 0.2;
    # the backtrack from a wrong KB: 0.2 + 1; the gold route after it: 0.2 + 1
    assert r[:4] == pytest.approx([0.7, 0.2, 1.2, 1.2], abs=1e-5) and outcome == 1.0
    stats = {k: [] for k in ("route_r", "answer_r", "outcome", "kb_acc", "format_ok", "overflow", "retrievals", "reask",
                             "tokens", "actions")}
    steprewards.log_trajectory(stats, x, r, outcome)
    routes = [sp for sp in x["spans"] if sp["kind"] == "route"]  # the popped one is not a routing decision scored
    assert stats["kb_acc"] == [1.0] * (len(routes) - 1) and stats["actions"] == [1.0]
    y = next(y for y in trajs if y["actions"] and y["actions"][-1]["kind"] == "summary")
    r, _ = steprewards.span_rewards(y, encoder.encode, w)
    j = y["actions"][-1]["span"]
    assert r[j] == pytest.approx(1.2)  # the gold summary holds every answer so far

def test_the_metrics_count_the_actions_and_score_routing_on_the_steps_that_stayed(world):
    import metrics
    import report
    tok, qs, ret = world
    trajs = run(rollout.GoldPolicy(tok, qs, actions=True), qs, ret)
    m = metrics.metrics(trajs)
    n_back = sum(a["kind"] == "backtrack" for x in trajs for a in x["actions"])
    assert m["backtracks"] == pytest.approx(n_back / len(qs)) and m["routing_acc"] == 100.0 and m["f1_recall"] == 100.0
    assert m["retrievals"] == pytest.approx((sum(len(q["steps"]) for q in qs) + n_back) / len(qs))  # the popped searched too
    assert "## Actions" in report.markdown({"gold": metrics.score(trajs)}, "t")
    assert "backtracks" not in metrics.metrics(run(rollout.GoldPolicy(tok, qs), qs, ret))

#### the server's events

def test_the_server_streams_a_backtrack_and_a_summary(world):
    tok, qs, ret = world
    s = rollout.Settings(topk=2, actions=True)
    trajs = run(rollout.GoldPolicy(tok, qs, actions=True), qs, ret)
    summarised = next(q for q in qs if len(q["steps"]) == 3)
    detour = next(q for q, x in zip(qs, trajs) if x["actions"] and x["actions"][0]["kind"] == "backtrack")
    for q in (summarised, detour):
        events = []
        policy = rollout.GoldPolicy(tok, [q], actions=True)
        chat = rollout.step_chat(policy, s)
        loop = rollout.StepLoop(policy, ret, s, chat, events=lambda x, kind, hits=None: events.extend(serve.step_events(x, kind, hits)))
        x = loop.run([serve.asked(q, chat, s)])[0]
        kinds = [e["type"] for e in events]
        assert kinds[-1] == "final" and events[-1]["answer"] == q["answers"][0]
        for a in x["actions"]:
            e = next(e for e in events if e["type"] == a["kind"])
            assert e["note"] == a["note"] and serve.line(e).startswith(a["kind"])
        if x["actions"][0]["kind"] == "backtrack":
            assert kinds[:4] == ["route", "evidence", "answer", "backtrack"] and events[3]["step"] == 0
            assert kinds[4] == "route" and events[4]["step"] == 0  # the popped step, asked again
        assert [st["step"] for st in events[-1]["steps"]] == list(range(len(q["steps"])))

#### SFT on them: 2 ranks == 1 process

def test_sft_on_trajectories_with_actions_on_two_ranks_equals_one_process(world, tiny_model_dir, tmp_path):
    # every chat of a trajectory is a row (a backtrack's and a summary's restart their chat); 2 gloo ranks x 2
    # micro-batches against 1 process x 4, plain SGD: the same weights after each step; the checkpoint records actions
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from safetensors.torch import load_file
    tok, qs, ret = world
    data = tmp_path / "traj-act"
    trajs = run(rollout.GoldPolicy(tok, qs[:32], actions=True), qs[:32], ret)
    assert sum(len(x["segments"]) > 1 for x in trajs) >= 8
    synth.write_trajectories(data, "train", trajs, tok, dict(structure="transcript", max_pairs=1, max_rets=1,
                                                               actions=True, kbs=list(dataio.KBS)))
    flags = ["--model", str(tiny_model_dir), "--data", str(data), "--max_len", "768", "--batch_size", "2",
             "--warmup_steps", "0", "--dtype", "fp32", "--optim", "sgd", "--lr", "0.5", "--train_steps", "2",
             "--save_every", "1", "--eval_every", "0"]
    import sft
    sft.main([*flags, "--grad_accum", "4", "--out", str(tmp_path / "one")])  # in this process: no start-up to pay
    root, env = Path(__file__).resolve().parents[1], {**os.environ, "OMP_NUM_THREADS": "1"}
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "sft.py",
                          *flags, "--grad_accum", "2", "--out", str(tmp_path / "two")], cwd=root, capture_output=True,
                         text=True, timeout=300, env=env)
    assert two.returncode == 0, two.stderr[-3000:]
    for step in (1, 2):
        a, b = (load_file(tmp_path / run_ / f"step_{step}" / "model.safetensors") for run_ in ("one", "two"))
        assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-6
    assert json.loads((tmp_path / "one" / "final" / "transcript.json").read_text())["actions"] is True

#### Step-GRPO's rows from trajectories with actions

def test_step_grpo_builds_a_row_per_chat_and_scores_every_span_of_a_trajectory_with_actions(world, encoder, tmp_path):
    # the gold policy as the engine (every sample the same): on-policy and branch batches of trajectories with actions
    # give one row per chat that holds policy tokens, every span scored. On-policy, a popped route is normalised with
    # the routes of its step (grpo.group_advantages' (kind, step)), its redo among them: below it, as it earned less
    import groups
    import stepgrpo
    tok, qs, ret = world
    picked = [q for q, x in zip(qs, run(rollout.GoldPolicy(tok, qs, actions=True), qs, ret)) if x["actions"]][:4]
    w = steprewards.Weights()
    for mode in ("onpolicy", "branch"):
        args = stepgrpo.get_args(["--model", str(tmp_path), "--data", str(tmp_path), "--rollout", mode, "-n", "2",
                                  "--topk", "2", "--branch_steps", "3"])
        args.actions = True  # (read from the checkpoint: none here)
        rows, stats, _ = getattr(groups, f"{mode}_batch")(rollout.GoldPolicy(tok, picked, actions=True), ret, picked,
                                                         stepgrpo.rollout_config(args), encoder.encode, w, 0)
        assert all(len(r["ids"]) == len(r["mask"]) == len(r["adv"]) for r in rows) and rows
        if mode == "onpolicy":
            trajs = run(rollout.GoldPolicy(tok, picked, actions=True), picked, ret)
            assert len(rows) == 2 * sum(len(x["segments"]) for x in trajs)  # every chat holds a policy turn
            assert stats["actions"] and min(stats["actions"]) >= 1.0
            assert all(a == 0 for r in rows for a, m in zip(r["adv"], r["mask"]) if not m)
            for x in trajs:  # a backtracked route's advantage (on its tokens) is below its redo's
                a = x["actions"][0]
                if a["kind"] == "backtrack":
                    r, _ = steprewards.span_rewards(x, encoder.encode, w)
                    assert r[a["popped_spans"][0]] < r[a["span"] + 1]
        else:
            assert len(rows) == 3 * len(picked)  # 3 branch points a trajectory: a group each, packed in one row
