"""synth.py: golden trajectories, teacher-mode filters on hand-made trajectories, R1-Router format import/export."""
import json

import pytest

import dataio
import retrievers
import rollout
import synth

def traj(steps, final, answers=("Suldor",), stop=True, ok=True):
    spans = [dict(kind=k, step=i, start=0, end=1) for i in range(len(steps)) for k in ("route", "answer")]
    spans += ([dict(kind="route", step=len(steps), start=0, end=1)] if stop else []) + [dict(kind="final", step=len(steps), start=0, end=1)]
    return dict(format_ok=ok, steps=[dict(sub_question=q, kb="text", retrieved=[], answer=a, step=i) for i, (q, a) in enumerate(steps)],
                final_answer=final, answers=list(answers), spans=spans)

@pytest.mark.parametrize("x, strict, paper", [
    (traj([("Which country is X in?", "Uldoria"), ("On which continent is Uldoria?", "Suldor")], "Suldor"), None, None),
    (traj([("q1", "a")], "the continent of Suldor"), None, None),          # recall 1: extra words are allowed
    (traj([("q1", "a")], "Suldor", ok=False), "format", "format"),
    (traj([("q1", None)], "Suldor"), "steps", None),
    (traj([("Who?", "a"), ("who?", "a")], "Suldor"), "steps", None),       # the same sub-question twice: the paper keeps it
    (traj([("q1", "a")], "Suldor", stop=False), "stopping", None),         # final forced before max_steps, no <ret>None</ret>
    (traj([("q1", "a"), ("q2", "b"), ("q3", "c")], "Suldor", stop=False), None, None),  # forced after max_steps: fine
    (traj([("q1", "a")], "Mireth"), "answer", "answer"),
])
def test_teacher_filters_keep_and_drop_the_right_trajectories(x, strict, paper):
    assert synth.rejection(x, max_steps=3, filt="strict") == strict
    assert synth.rejection(x, max_steps=3, filt="paper") == paper

def hop(doc, kb, answer):
    return dict(sub_question=f"q {doc}", kb=kb, doc_id=doc, answer=answer)

def step(t, q, kb, retrieved, answer):
    return dict(sub_question=q, kb=kb, retrieved=retrieved, answer=answer, step=t)

GOLD = [hop("t1", "text", "Uldoria"), hop("b2", "table", "Suldor")]

@pytest.mark.parametrize("steps, want", [
    # the gold path: two searches, each finds its hop's document and answers it right
    ([step(0, "a", "text", ["t1", "t9"], "Uldoria"), step(1, "b", "table", ["b2"], "Suldor")],
     dict(steps=2, checkable=2)),
    # a wrong KB (nothing found), a re-ask in the right KB that finds hop 1 with a wrong answer, then it stops: hop 2 missed
    ([step(0, "a", "image", ["i3"], "x"), step(1, "a", "text", ["t1"], "Mireth")],
     dict(steps=2, wrong_kb=1, no_progress=1, reask=1, checkable=1, wrong_answer=1, missed_hop=1)),
    # both hops found, then one extra search
    ([step(0, "a", "text", ["t1"], "Uldoria"), step(1, "b", "table", ["b2"], "Suldor"), step(2, "c", "text", ["t1"], "u")],
     dict(steps=3, checkable=2, extra=1, no_progress=1)),
])
def test_step_errors_judge_each_step_against_the_gold_hops(steps, want):
    e = synth.step_errors(dict(gold_steps=GOLD, steps=steps))
    assert {k: v for k, v in e.items() if v} == want

def test_error_report_rates():
    clean = dict(gold_steps=GOLD, steps=[step(0, "a", "text", ["t1"], "Uldoria"), step(1, "b", "table", ["b2"], "Suldor")])
    skip = dict(gold_steps=GOLD, steps=[step(0, "a", "text", ["t1"], "Uldoria")])
    r = synth.error_report([clean, skip])
    assert r["trajectories"] == 2 and r["steps"] == 3 and r["missed_hop"] == 0.5 and r["any_error"] == 0.5
    assert r["wrong_kb"] == 0 and r["wrong_answer"] == 0

def test_teacher_mode_counts_survivors(tiny_index, tok):
    qs = [q for q in dataio.load_questions(tiny_index, "train") if q["steps"]][:6]
    ret = retrievers.Retriever(tiny_index, "bm25")
    # a teacher that gets the final answer of every other question wrong
    wrong = [dict(q, answers=["Nowhere"]) if i % 2 else q for i, q in enumerate(qs)]
    kept, sampled, counts = synth.teacher_trajectories(rollout.GoldPolicy(tok, wrong), ret, qs, n=2, settings=rollout.Settings())
    assert len(sampled) == 12 and counts["sampled"] == 12 and counts["answer"] == 6 and counts["kept_trajectories"] == 6
    assert [x["qid"] for x in kept] == [q["id"] for q in qs[0::2]] and counts["kept_questions"] == 3

def test_a_teachers_few_shot_examples_are_cut_from_what_is_written(tiny_index, tok):
    # the gold policy as a teacher that needs worked examples: its kept trajectories, shots cut, are the ones it
    # writes without them, token for token (the head is the system prompt and the question, positions moved)
    import evaluate
    qs = [q for q in dataio.load_questions(tiny_index, "train") if q["steps"]][:6]
    ret, s = retrievers.Retriever(tiny_index, "bm25"), rollout.Settings()
    shots = rollout.few_shot_prefix(tok, ret, evaluate.few_shot_examples(qs, 2), s)
    kept, _, _ = synth.teacher_trajectories(rollout.GoldPolicy(tok, qs), ret, qs, n=1, settings=s, shots=shots)
    plain, _, _ = synth.teacher_trajectories(rollout.GoldPolicy(tok, qs), ret, qs, n=1, settings=s)
    assert len(kept) == len(plain) == 6
    for x, y in zip(kept, plain):
        for key in ("ids", "mask", "logprobs", "spans", "segments", "images", "steps", "n_policy_tokens"):
            assert x[key] == y[key], key

R1R_ROW = {"images": [], "steps": [
    {"step_type": "ret", "problem": "Origin question: Who founded the firm that built the Tova bridge?\n", "system": "s",
     "answer": {"query": "which firm built the tova bridge?", "retriever": ["text retriever"]}},
    {"step_type": "ans", "system": "s", "answer": "marlo works built it.",
     "problem": "According to the related information searched, `ter` means text: ter-0: Tova bridge was built by Marlo Works.\n"
                "ter-1: Other bridge\n Give me the answer(with the format <answer></answer>) to the Question: which firm built the tova bridge?"},
    {"step_type": "ret", "problem": "Origin question: Who founded the firm that built the Tova bridge?\nSub-question1: ...", "system": "s",
     "answer": {"query": "what does the marlo works logo look like?", "retriever": ["text image retriever"]}},
    {"step_type": "ans", "system": "s", "answer": "a red star.",
     "problem": "According to the related information searched: tir-0: Logo of Marlo Works: a red star.\n Give me the answer(with the format <answer></answer>) to the Question: what does the marlo works logo look like?"},
    {"step_type": "ret", "problem": "...", "system": "s", "answer": {"query": "none", "retriever": ["none"]}},
    {"step_type": "ans", "problem": "... Now, give me the final answer", "system": "s", "answer": ["a red star"]}]}

def test_r1router_rows_import_replay_and_export(tmp_path, tok):
    path = tmp_path / "released.jsonl"
    path.write_text(json.dumps(R1R_ROW) + "\n")
    qs, ret = synth.read_r1router(path)
    assert qs[0]["question"] == "Who founded the firm that built the Tova bridge?" and qs[0]["answers"] == ["a red star"]
    assert [(s["sub_question"], s["kb"], s["answer"]) for s in qs[0]["steps"]] == [
        ("which firm built the tova bridge?", "text", "marlo works built it."),
        ("what does the marlo works logo look like?", "image", "a red star.")]
    assert [d["contents"] for d in ret.search(["which firm built the tova bridge?"], "text", 3)[0]] == [
        "Tova bridge was built by Marlo Works.", "Other bridge"]
    x = rollout.rollout(rollout.GoldPolicy(tok, qs), ret, qs)[0]
    assert x["format_ok"] and x["final_answer"] == "a red star"
    assert "Logo of Marlo Works: a red star." in tok.decode(x["ids"])  # the released passages are the evidence
    out = synth.to_r1router(x)
    assert [s["step_type"] for s in out["steps"]] == ["ret", "ans", "ret", "ans", "ret", "ans"]
    assert out["steps"][2]["answer"] == {"query": "what does the marlo works logo look like?", "retriever": ["text image retriever"]}
    assert out["steps"][4]["answer"] == {"query": "none", "retriever": ["none"]} and out["steps"][5]["answer"] == ["a red star"]
    path2 = tmp_path / "again.jsonl"
    path2.write_text(json.dumps(out) + "\n")
    again, _ = synth.read_r1router(path2)
    assert [(s["sub_question"], s["kb"], s["answer"]) for s in again[0]["steps"]] == [
        (s["sub_question"], s["kb"], s["answer"]) for s in qs[0]["steps"]]

def test_r1router_rows_with_retriever_lists_replay_as_one_step_of_several_lookups(tmp_path, tok):
    # R1-Router's multi-retriever mode: one sub-question sent to two KBs; each lookup gets that KB's passages
    row = json.loads(json.dumps(R1R_ROW))
    row["steps"][0]["answer"]["retriever"] = ["text retriever", "table retriever"]
    row["steps"][1]["problem"] = row["steps"][1]["problem"].replace("ter-1: Other bridge", "tar-0: bridges ; tova | 1901")
    path = tmp_path / "multi.jsonl"
    path.write_text(json.dumps(row) + "\n")
    qs, ret = synth.read_r1router(path)
    assert [(s["sub_question"], s["kb"]) for s in qs[0]["steps"][:2]] == [("which firm built the tova bridge?", "text"),
                                                                        ("which firm built the tova bridge?", "table")]
    assert [d["contents"] for d in ret.search(["which firm built the tova bridge?"], "table", 3)[0]] == ["bridges ; tova | 1901"]
    x = rollout.rollout(rollout.GoldPolicy(tok, qs), ret, qs, s=rollout.Settings(max_rets=3))[0]
    assert x["format_ok"] and [(s["kb"], s["step"]) for s in x["steps"]] == [("text", 0), ("table", 0), ("image", 1)]
    text = tok.decode(x["ids"])
    assert "<ret>Text Retriever, Table Retriever</ret>" in text and "Marlo Works.\n\nRetrieved by Table Retriever:\n[1] bridges" in text
    assert synth.to_r1router(x)["steps"][0]["answer"]["retriever"] == ["text retriever", "table retriever"]
    assert not rollout.rollout(rollout.GoldPolicy(tok, qs), ret, qs)[0]["format_ok"]  # one retriever a pair: a list fails

def test_broken_r1router_rows_name_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(R1R_ROW) + "\n" + json.dumps({"images": [], "steps": [{"step_type": "ret"}]}) + "\n")
    with pytest.raises(dataio.DataError, match=r"bad\.jsonl:2: not an R1-Router step-unrolled row"):
        synth.read_r1router(path)
