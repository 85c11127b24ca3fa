"""metrics.py and evaluate.py: every metric, routing accuracy, route_exact, the confusion matrix and the per-type breakdown on
hand-made trajectories with hand-computed values; report.py's files, atomic writing and trajectory view."""
import json

import pytest

import dataio
import evaluate
import metrics
import prepare
from metrics import confusion, decisions, first_samples, gold_hits, routing_accuracy, score
from report import curve_panels, curves_chart, markdown, write_report

approx = pytest.approx


def traj(qid, type_, answers, gold, pred, final, format_ok=True, hit=None, sample=0, tokens=100, step=None):
    """gold / pred: KB sequences (one lookup each). Gold step i uses document f"{qid}-d{i}"; pred lookup i retrieves it
    when hit[i] and was asked at routing step step[i] (default i: one lookup a step)."""
    hit = [True] * len(pred) if hit is None else hit
    step = list(range(len(pred))) if step is None else step
    gold_steps = [dict(sub_question=f"g{i}?", kb=kb, doc_id=f"{qid}-d{i}", answer="x", step=i) for i, kb in enumerate(gold)]
    steps = [dict(sub_question=f"p{i}?", kb=kb, retrieved=([f"{qid}-d{i}"] if hit[i] else []) + ["other"], answer="x",
                  step=step[i]) for i, kb in enumerate(pred)]
    return dict(qid=qid, sample=sample, question=f"{qid}?", answers=answers, type=type_, gold_steps=gold_steps,
                steps=steps, final_answer=final, format_ok=format_ok, error="" if format_ok else "bad step",
                ids=[], mask=[], logprobs=[], spans=[], n_policy_tokens=tokens,
                timings={"generate": 1.0, "retrieve": 0.5})


# ---- the hand-made set (expected values per trajectory in the comments)
#                                                EM   F1   Acc  F1R  routing                  exact  gold hits
PERFECT = traj("a", "2hop", ["Suldor"], ["text", "table"], ["text", "table"], "Suldor", tokens=70)  # 1 1 1 1 3/3 y 2/2
WRONG_ROUTE = traj("b", "2hop", ["Suldor"], ["text", "table"], ["text", "text"], "Mireth",
                   hit=[True, False], tokens=140)                                    # 0 0 0 0  2/3  n  1/2
PREMATURE = traj("c", "3hop", ["blue"], ["text", "text", "image"], ["text"], "blue shirt",
                 tokens=35)                                                          # 0 2/3 1 1  1/4  n  1/3
NO_RET = traj("d", "none", ["7", "seven"], [], [], "seven", tokens=14)                  # 1 1 1 1  1/1  y  -
NEEDLESS = traj("e", "none", ["April"], [], ["text"], "March", tokens=42)              # 0 0 0 0  0/2  n  -
FORMAT_FAIL = traj("f", "1hop", ["Suldor"], ["table"], ["table"], None, format_ok=False,
                   tokens=28)                                                        # 0 0 0 0  1/2  n  1/1
COMPARISON = traj("g", "comparison", ["Zan Jumar"], ["text", "text"], ["text", "text"], "Jumar",
                  tokens=91)                                                         # 0 2/3 0 1/2 3/3 y 2/2
SET = [PERFECT, WRONG_ROUTE, PREMATURE, NO_RET, NEEDLESS, FORMAT_FAIL, COMPARISON]
ROUTING = [1, 2 / 3, 1 / 4, 1, 0, 1 / 2, 1]


def test_routing_accuracy_per_trajectory():
    assert [routing_accuracy(t) for t in SET] == approx(ROUTING)
    assert decisions(NEEDLESS) == [("stop", "text"), (None, "stop")]  # its stop comes one step late
    assert decisions(PREMATURE) == [("text", "text"), ("text", "stop"), ("image", "missing"), ("stop", "missing")]
    assert decisions(FORMAT_FAIL) == [("table", "table"), ("stop", "missing")]
    # stops early with the right prefix, and stops too late: the extra retrieval and the stop both count as wrong
    late = traj("h", "1hop", ["x"], ["image"], ["image", "table"], "x")
    assert routing_accuracy(late) == approx(1 / 3)
    # ran out of turns without a final answer (format_ok but final_answer None): no stop, like a format failure
    out_of_turns = traj("l", "1hop", ["x"], ["text"], ["text"], None, format_ok=True)
    assert decisions(out_of_turns) == [("text", "text"), ("stop", "missing")]
    assert score([out_of_turns])["em"] == 0 and score([out_of_turns])["format_fail"] == 0
    # a format failure after exactly the gold retrievals: every step right, but no stop
    assert routing_accuracy(traj("i", "2hop", ["x"], ["text", "table"], ["text", "table"], "x", format_ok=False)) \
        == approx(2 / 3)


def test_failure_is_the_first_wrong_thing_and_lost_points_sum_to_100():
    assert [metrics.failure(t) for t in SET] == [None, "route", None, None, "route", "format", "final"]
    # a right KB without the gold document; the gold document but another intermediate answer; both after a right step
    miss = traj("m", "2hop", ["y"], ["text", "table"], ["text", "table"], "z", hit=[True, False])
    misread = traj("n", "2hop", ["y"], ["text", "table"], ["text", "table"], "z")
    misread["steps"][1]["answer"] = "w"
    assert metrics.failure(miss) == "retrieval" and metrics.failure(misread) == "step_answer"
    misread["steps"][0]["answer"] = "x y"  # recall of the gold "x" is 1: still right
    assert metrics.failure(misread) == "step_answer"
    no_decomposition = traj("o", "unknown", ["y"], [], ["text"], "z")
    assert metrics.failure(no_decomposition) == "unattributed"
    lost = score(SET)["lost"]  # points: route 2 x 100 / 7, format 100 / 7, final 50 / 7 (COMPARISON's half)
    assert lost == approx({"format": 100 / 7, "route": 200 / 7, "final": 50 / 7})
    assert score(SET)["f1_recall"] + sum(lost.values()) == approx(100)


def test_gold_hits_are_aligned_by_position():
    assert gold_hits(PERFECT) == [True, True]
    assert gold_hits(WRONG_ROUTE) == [True, False]
    assert gold_hits(PREMATURE) == [True, False, False]
    assert gold_hits(NO_RET) == []
    swapped = traj("j", "comparison", ["y"], ["text", "text"], ["text", "text"], "y")
    swapped["steps"][0]["retrieved"], swapped["steps"][1]["retrieved"] = ["j-d1"], ["j-d0"]
    assert gold_hits(swapped) == [False, False]


def test_gold_steps_without_sub_question_hit_at_any_position():
    # HotpotQA-style gold (data/real): supporting paragraphs, no sub-question, so no order; found in swapped order
    t = traj("k", "hotpotqa", ["y"], ["text", "text"], ["text", "text"], "y")
    for g in t["gold_steps"]:
        g["sub_question"], g["answer"] = "", ""
    t["steps"][0]["retrieved"], t["steps"][1]["retrieved"] = ["k-d1"], ["k-d0"]
    assert gold_hits(t) == [True, True]
    t["steps"] = t["steps"][:1]  # only one retrieval: the paragraph it found counts, the other misses
    assert gold_hits(t) == [False, True]
    assert routing_accuracy(t) == approx(1 / 3)  # text, then a stop where a second text step was due


def test_score_overall():
    s = score(SET)
    assert s["n"] == 7
    assert s["em"] == approx(100 * 2 / 7)
    assert s["f1"] == approx(100 * (1 + 2 / 3 + 1 + 2 / 3) / 7)
    assert s["acc"] == approx(100 * 3 / 7)
    assert s["f1_recall"] == approx(100 * 3.5 / 7)
    assert s["format_fail"] == approx(100 / 7)
    assert s["routing_acc"] == approx(100 * (1 + 2 / 3 + 1 / 4 + 1 + 0 + 1 / 2 + 1) / 7)  # = 100 * 53/84
    assert s["route_exact"] == approx(100 * 3 / 7)
    assert s["gold_hit"] == approx(100 * 7 / 10)  # gold steps 2+2+3+1+2 = 10, hits 2+1+1+1+2 = 7
    assert s["retrievals"] == approx(9 / 7)
    assert s["retrievals_by_kb"] == approx({"text": 7 / 7, "table": 2 / 7, "image": 0.0})
    assert s["policy_tokens"] == approx((70 + 140 + 35 + 14 + 42 + 28 + 91) / 7)
    assert s["time_generate"] == approx(1.0) and s["time_retrieve"] == approx(0.5)


def test_confusion_matrix_counts():
    conf = score(SET)["confusion"]
    assert conf["rows"] == ["text", "table", "image", "stop"]
    assert conf["cols"] == ["text", "table", "image", "stop", "missing"]
    assert conf["counts"] == [
        [5, 0, 0, 1, 0],  # text:  a, b, c, g, g right; c stopped instead
        [1, 2, 0, 0, 0],  # table: b went to text; a, f right
        [0, 0, 0, 0, 1],  # image: c had already stopped
        [1, 0, 0, 4, 2],  # stop:  e retrieved; a, b, d, g stopped; c ended early, f failed
    ]
    assert sum(map(sum, conf["counts"])) == sum(len(t["gold_steps"]) + 1 for t in SET)  # one entry per gold decision
    # balanced routing accuracy: the diagonal over each row's total, averaged over the four gold classes
    assert score(SET)["routing_macro"] == approx(100 * (5 / 6 + 2 / 3 + 0 / 1 + 4 / 7) / 4)
    # a class no question has (here: image) is left out, not counted as 0
    assert score([PERFECT, NO_RET])["routing_macro"] == approx(100 * (1 + 1 + 1) / 3)


def test_first_decision_confusion_balanced_accuracy_and_information():
    # step 0 of the set: gold text a b c g (all chose text), table f (table); stop d e (d stopped, e chose text)
    first = score(SET)["confusion_by_step"][0]
    assert first["counts"] == [[4, 0, 0, 0, 0], [0, 1, 0, 0, 0], [0, 0, 0, 0, 0], [1, 0, 0, 1, 0]]
    assert sum(map(sum, first["counts"])) == len(SET)  # one first decision a question
    assert score(SET)["routing_macro0"] == approx(100 * (1 + 1 + 1 / 2) / 3)
    # I(gold; chosen) / H(gold) by hand, natural logs (the ratio does not depend on the base)
    import math
    n, pg, pc = 7, {"text": 4, "table": 1, "stop": 2}, {"text": 5, "table": 1, "stop": 1}
    joint = {("text", "text"): 4, ("table", "table"): 1, ("stop", "text"): 1, ("stop", "stop"): 1}
    mi = sum(c / n * math.log(c * n / (pg[g] * pc[p])) for (g, p), c in joint.items())
    h = -sum(v / n * math.log(v / n) for v in pg.values())
    assert score(SET)["route_info0"] == approx(100 * mi / h)
    # a router that always says text, whatever the question: no information, however accurate on the majority
    blind = [traj(f"q{i}", "1hop", ["x"], [kb], ["text"], "x") for i, kb in enumerate(["text"] * 8 + ["table"] * 2)]
    assert score(blind)["route_info0"] == approx(0.0) and score(blind)["routing_macro0"] == approx(50.0)
    # one that reads the question: all of it
    sighted = [traj(f"q{i}", "1hop", ["x"], [kb], [kb], "x") for i, kb in enumerate(["text", "table", "image"] * 3)]
    assert score(sighted)["route_info0"] == approx(100.0)
    # a gold label that never varies carries no entropy to explain
    assert metrics.route_information(confusion([PERFECT], step=0)) is None


def test_answer_words_overall_and_per_type():
    # final answers of SET: 1, 1, 2 ("blue shirt"), 1, 1, a format failure (0), 1 words
    s = score(SET)
    assert s["answer_words"] == approx(1) and s["by_type"]["3hop"]["answer_words"] == 2
    assert s["by_type"]["1hop"]["answer_words"] == 0
    assert metrics.answer_words(dict(FORMAT_FAIL, final_answer="the blue shirt")) == 0  # as F1-Recall sees it: ""
    assert metrics.answer_words(dict(FORMAT_FAIL, final_answer=" the  blue shirt ", format_ok=True)) == 3


def test_per_type_breakdown():
    by = score(SET)["by_type"]
    assert list(by) == ["none", "1hop", "2hop", "3hop", "comparison"]
    assert {ty: m["n"] for ty, m in by.items()} == {"none": 2, "1hop": 1, "2hop": 2, "3hop": 1, "comparison": 1}
    assert by["2hop"]["em"] == approx(50) and by["2hop"]["routing_acc"] == approx(100 * 5 / 6)
    assert by["2hop"]["route_exact"] == approx(50) and by["2hop"]["gold_hit"] == approx(75)
    assert by["none"]["em"] == approx(50) and by["none"]["routing_acc"] == approx(50)
    assert by["none"]["gold_hit"] is None and by["none"]["retrievals"] == approx(0.5)
    assert by["1hop"]["format_fail"] == approx(100) and by["1hop"]["f1_recall"] == 0
    assert by["3hop"]["f1"] == approx(100 * 2 / 3) and by["3hop"]["acc"] == approx(100)
    assert by["3hop"]["routing_acc"] == approx(25) and by["3hop"]["gold_hit"] == approx(100 / 3)
    assert by["comparison"]["f1_recall"] == approx(50) and by["comparison"]["em"] == 0
    assert "confusion" not in by["2hop"] and "by_type" not in by["2hop"]


def test_reask_rate():
    assert score(SET)["reask"] == 0  # every hand-made sub-question is distinct ("p0?", "p1?", ...)
    twice = traj("r", "1hop", ["x"], ["table"], ["table", "table"], "x")
    twice["steps"][1]["sub_question"] = "  P0? "  # the same question as step 0, case and outer spaces aside
    late = traj("s", "2hop", ["x"], ["text", "text"], ["text", "text", "text"], "x")
    late["steps"][2]["sub_question"] = "p0?"  # re-asks step 0, not the step just before
    assert score([twice])["reask"] == 100 and score([twice, late, PERFECT, NO_RET])["reask"] == 50
    other = traj("u", "2hop", ["x"], ["text", "text"], ["text", "text"], "x")
    other["steps"][1]["sub_question"] = "p0 again?"
    assert score([other])["reask"] == 0


def test_format_failure_scores_zero_even_with_a_right_answer():
    t = traj("k", "1hop", ["Suldor"], ["text"], ["text"], "Suldor", format_ok=False)
    s = score([t])
    assert (s["em"], s["f1"], s["acc"], s["f1_recall"], s["format_fail"]) == (0, 0, 0, 0, 100)
    assert score([dict(t, format_ok=True)])["em"] == 100


def test_only_the_first_sample_counts():
    bad_second = dict(PERFECT, sample=1, final_answer="wrong", steps=[])
    assert score([bad_second, *SET]) == score(SET)
    assert first_samples([bad_second]) == [bad_second]  # a question with only sample 1 keeps it
    assert [t["qid"] for t in first_samples([bad_second, *SET])] == list("abcdefg")
    with pytest.raises(ValueError, match="no trajectories"):
        score([])


# ---- report


def results():
    direct = [traj(t["qid"], t["type"], t["answers"], [s["kb"] for s in t["gold_steps"]], [],
                   t["final_answer"] or "unknown")
              for t in SET]
    return {"r1-router": dict(score(SET), seconds=3.5), "direct answer": score(direct)}


def test_markdown_tables():
    md = markdown(results(), "mini dev")
    assert md.startswith("# mini dev\n")
    assert "| method | n | F1-Recall | EM | F1 | Acc | answer words | routing acc | steps/q | retrievals/q | s/q | " \
           "format fail % |" in md
    assert "| r1-router | 7 | 50.0 | 28.6 | 47.6 | 42.9 | 1.00 | 63.1 | 1.29 | 1.29 | 0.500 | 14.3 |" in md  # 3.5 s / 7
    # routing macro, its first decision's and that decision's information (both checked by hand above), route exact,
    # gold hit, text/table/image, re-ask %, tokens
    assert "| r1-router | 51.8 | 83.3 | 62.6 | 42.9 | 70.0 | 1.00 | 0.29 | 0.00 | 0.0 | 60 |" in md
    assert "| method | format | route | retrieval | step_answer | final | unattributed |" in md
    assert "| r1-router | 14.3 | 28.6 | 0.0 | 0.0 | 7.1 | 0.0 |" in md
    assert "| method | none | 1hop | 2hop | 3hop | comparison |" in md
    assert "| r1-router | 50.0 | 0.0 | 50.0 | 100.0 | 50.0 |" in md
    assert md.split("## Answer words by question type")[1].count("| r1-router | 1.00 | 0.00 | 1.00 | 2.00 | 1.00 |") == 1
    assert "| direct answer | 7 |" in md


def test_write_report_files(tmp_path):
    res = results()
    md = write_report(res, tmp_path / "out", title="mini dev")
    out = tmp_path / "out"
    # only the direct-answer method never retrieves, so it gets no confusion chart; no temp files are left
    assert sorted(p.name for p in out.iterdir()) == [
        "metrics.png", "results.json", "routing_confusion_r1-router.png", "table.md"]
    assert json.loads((out / "results.json").read_text()) == res
    assert (out / "table.md").read_text() == md and "| r1-router | 7 |" in md and "| direct answer | 7 |" in md
    for name in ("metrics.png", "routing_confusion_r1-router.png"):
        data = (out / name).read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 20_000


def test_method_names_become_safe_file_names(tmp_path):
    write_report({"Qwen 3B/sft": score(SET)}, tmp_path, title="t")
    assert (tmp_path / "routing_confusion_Qwen_3B_sft.png").is_file()


def test_rows_are_named_after_the_run_not_the_checkpoint():
    # two runs' final checkpoints must not share a row name or a report folder
    assert evaluate.run_name("out/sft/final") == "sft" and evaluate.run_name("out/stepgrpo/final") == "stepgrpo"
    assert evaluate.run_name("out/stepgrpo/best") == "stepgrpo-best" and evaluate.run_name("out/sft/step_12") == "sft-step_12"
    assert evaluate.run_name("models/SmolLM2-135M-Instruct") == "SmolLM2-135M-Instruct"

def test_write_is_atomic(tmp_path, monkeypatch):
    res = results()
    write_report(res, tmp_path, title="first")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    def broken_replace(src, dst):
        raise OSError("disk full")
    monkeypatch.setattr(dataio.os, "replace", broken_replace)  # the one atomic writer
    with pytest.raises(OSError, match="disk full"):
        write_report({"other": score(SET[:2])}, tmp_path, title="second")
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # old files intact, no temp file left
    assert json.loads((tmp_path / "results.json").read_text()) == res


def test_a_finished_method_is_reused_only_under_the_same_weights_questions_and_flags(tmp_path):
    import argparse
    import os
    model = tmp_path / "m"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"w")
    args = argparse.Namespace(model=[str(model)], name=None, topk=3, seed=0, out=[str(tmp_path / "ev")], methods=["routed"])
    qs = [{"id": "q1"}, {"id": "q2"}]
    sig = evaluate.run_signature(vars(args), qs, model, "m")
    row = {"m/routed": score(SET)}
    assert evaluate.method_done(tmp_path / "ev", "routed", sig) is None  # nothing finished yet
    dataio.write_atomic(tmp_path / "ev" / "method-routed.json", json.dumps({"signature": sig, "results": row}))
    assert evaluate.method_done(tmp_path / "ev", "routed", evaluate.run_signature(vars(args), qs, model, "m")) == json.loads(json.dumps(row))
    args.methods, args.out = ["routed", "oracle"], [str(tmp_path / "ev2")]  # which methods run is not in the signature
    assert evaluate.run_signature(vars(args), qs, model, "m") == sig
    # nor the other checkpoints scored in the same process
    assert evaluate.run_signature({**vars(args), "model": [str(model), "x"]}, qs, model, "m") == sig
    assert evaluate.run_signature({**vars(args), "topk": 5}, qs, model, "m") != sig  # another flag
    assert evaluate.run_signature(vars(args), qs[:1], model, "m") != sig  # other questions
    assert evaluate.run_signature(vars(args), qs, model, "m2") != sig  # another row name
    os.utime(model / "model.safetensors", ns=(1, 1))  # the checkpoint rewritten
    assert evaluate.run_signature(vars(args), qs, model, "m") != sig
    (tmp_path / "ev" / "method-routed.json").write_text('{"signature": ')  # half a file: run the method again
    assert evaluate.method_done(tmp_path / "ev", "routed", sig) is None


def test_models_one_engine_cannot_share_are_refused_in_one_line(tmp_path, tiny_model_dir):
    # several --model folders share one engine (weights swapped in): their config and tokenizer must be the same
    import shutil
    other = tmp_path / "other"
    shutil.copytree(tiny_model_dir, other)
    conf = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**conf, "dtype": "bfloat16", "transformers_version": "0"}))
    assert evaluate.same_policy(tiny_model_dir, other) is None  # the weights' dtype is not the policy
    (other / "config.json").write_text(json.dumps({**conf, "num_hidden_layers": 3}))
    (other / "tokenizer.json").write_text("{}")
    base = ["--model", str(tiny_model_dir), str(other), "--out", str(tmp_path / "a"), str(tmp_path / "b")]
    for argv, words in ((base, f"--model {other}: its config.json, tokenizer.json differ from {tiny_model_dir}'s"),
                        (base[:-1], "--name and --out take one value a model: 2 models, 2 names, 1 report folders"),
                        (base[:-1] + [str(tmp_path / "a")], "two models would share a report folder")):
        with pytest.raises(SystemExit) as e:
            evaluate.main(evaluate.get_args(argv))
        assert str(e.value).startswith("error: ") and words in str(e.value), e.value


def test_confusion_is_empty_for_no_trajectories():
    assert confusion([])["counts"] == [[0] * 5 for _ in range(4)]


def test_seed_table_mean_and_sample_std_over_training_seeds(tmp_path):
    a, b, base = score(SET), score(SET), score(SET)
    a["f1_recall"], b["f1_recall"] = 10.0, 20.0  # mean 15, sample std 7.07
    a["routing_acc"], b["routing_acc"] = 50.0, 50.0
    a["seconds"], b["seconds"] = 7.0, 14.0  # 1 and 2 s a question
    md = write_report({"sft@s1/routed": a, "sft@s2/routed": b, "prompt-only/routed": base}, tmp_path, title="t")
    assert md.startswith("# t: mean ± std over training seeds")
    assert "| sft/routed | 2 | 15.0 ± 7.1 | 28.6 ± 0.0 | 47.6 ± 0.0 | 1.00 ± 0.00 | 50.0 ± 0.0 | 1.29 ± 0.00 | " \
           "1.29 ± 0.00 | 1.500 ± 0.707 |" in md
    assert "| prompt-only/routed | 1 | 50.0 | 28.6 | 47.6 | 1.00 | 63.1 | 1.29 | 1.29 | - |" in md
    assert "| sft@s1/routed | 7 |" in md  # the per-seed rows stay in the main table


def test_route_probe_samples_at_golden_prefixes(tiny_index):
    """With the gold policy as the engine every sampled route is on the diagonal, n per gold decision; a policy whose
    first step takes a wrong KB moves exactly those first-step counts off it."""
    from collections import Counter

    from transformers import AutoTokenizer

    import dataio
    import retrievers
    import rollout
    tok = AutoTokenizer.from_pretrained(prepare.DEFAULT_MODEL)
    qs = [q for q in dataio.load_questions(tiny_index, "dev") if q["steps"]][:10]
    ret = retrievers.Retriever(tiny_index, "bm25")
    # the stop is asked for only below max_steps (3): after the third retrieval the final answer is forced
    gold = Counter(s["kb"] for q in qs for s in q["steps"]) + Counter({"stop": sum(len(q["steps"]) < 3 for q in qs)})
    p = evaluate.route_probe(rollout.GoldPolicy(tok, qs), ret, qs, rollout.Settings(), n=3)
    rows, cols, counts = p["confusion"]["rows"], p["confusion"]["cols"], p["confusion"]["counts"]
    assert p["probe_acc"] == 100 and all(v in (None, 100) for v in p["by_gold"].values())
    for i, g in enumerate(rows):
        assert counts[i][cols.index(g)] == 3 * gold[g] and sum(counts[i]) == 3 * gold[g]
    swap = {"text": "image", "table": "image", "image": "text"}
    wrong = [dict(q, steps=[dict(q["steps"][0], kb=swap[q["steps"][0]["kb"]]), *q["steps"][1:]]) for q in qs]
    p = evaluate.route_probe(rollout.GoldPolicy(tok, wrong), ret, qs, rollout.Settings(), n=2)
    counts = p["confusion"]["counts"]
    moved = Counter((q["steps"][0]["kb"], swap[q["steps"][0]["kb"]]) for q in qs)
    for (g, w), k in moved.items():
        assert counts[rows.index(g)][cols.index(w)] == 2 * k
    n_dec = sum(gold.values())
    assert p["probe_acc"] == pytest.approx(100 * (n_dec - len(qs)) / n_dec)  # all but the first steps still right

def test_paired_bootstrap_by_hand():
    # NEW fixes one question of seven (WRONG_ROUTE: F1-Recall 0 -> 1, routing 2/3 -> 1) and equals BASE elsewhere
    fixed = traj("b", "2hop", ["Suldor"], ["text", "table"], ["text", "table"], "Suldor")
    new = [fixed if t["qid"] == "b" else t for t in reversed(SET)]  # matched by qid, not by order
    p = metrics.paired([(SET, new)])
    assert p["n"] == 7
    assert p["f1_recall"]["diff"] == approx(100 / 7) and p["routing_acc"]["diff"] == approx(100 / 3 / 7)
    # a resample is not above BASE exactly when it leaves out question b: (6/7)^7 of the time
    for k in ("f1_recall", "routing_acc"):
        assert p[k]["lo"] == 0 and p[k]["hi"] > p[k]["diff"]
        assert p[k]["p_not_above"] == approx((6 / 7) ** 7, abs=0.02)
    back = metrics.paired([(new, SET)])
    assert back["f1_recall"]["diff"] == approx(-100 / 7) and back["f1_recall"]["p_not_above"] == 1
    assert p["by_type"]["2hop"]["n"] == 2 and p["by_type"]["2hop"]["f1_recall"]["diff"] == approx(100 / 2)
    nothing = {"diff": 0, "lo": 0, "hi": 0, "p_not_above": 1, "per_pair": [0],
               "two_level": {"lo": 0, "hi": 0, "p_not_above": 1}}
    assert p["by_type"]["comparison"]["f1_recall"] == nothing
    # the same lookups in one routing step instead of two: one step fewer, as many retrieval calls, same routing
    multi = traj("g", "comparison", ["Zan Jumar"], ["text", "text"], ["text", "text"], "Jumar", step=[0, 0])
    p = metrics.paired([(SET, [multi if t["qid"] == "g" else t for t in SET])])
    assert p["steps"]["diff"] == approx(-1 / 7) and p["retrievals"]["diff"] == 0 and p["routing_acc"]["diff"] == 0
    assert p["by_type"]["comparison"]["steps"]["diff"] == -1 and score([multi])["steps"] == 1
    assert score(SET)["steps"] == score(SET)["retrievals"] == approx(9 / 7)
    same = metrics.paired([(SET, SET)])
    assert same["routing_acc"] == nothing
    with pytest.raises(ValueError, match="other questions"):
        metrics.paired([(SET, SET[1:])])
    # two seeds, the fix in one of them: each question's difference is the mean over the seeds, resampled together
    two = metrics.paired([(SET, new), (SET, SET)])
    assert two["f1_recall"]["per_pair"] == [approx(100 / 7), 0] and two["f1_recall"]["diff"] == approx(100 / 14)
    assert two["f1_recall"]["lo"] == 0 and two["f1_recall"]["p_not_above"] == approx((6 / 7) ** 7, abs=0.02)
    with pytest.raises(ValueError, match="pair 2"):
        metrics.paired([(SET, new), (SET[1:], SET[1:])])

def test_paired_em_f1_and_answer_words():
    # NEW fixes WRONG_ROUTE (Mireth -> Suldor) and pads PREMATURE's answer (blue shirt -> a blue shirt today): F1-Recall
    # keeps its 1 there, F1 falls from 2/3 to 1/2 (precision 1/3), and the answer is 2 words longer
    new = [dict(t, final_answer={"b": "Suldor", "c": "a blue shirt today"}.get(t["qid"], t["final_answer"])) for t in SET]
    p = metrics.paired([(SET, new)])
    assert p["f1_recall"]["diff"] == approx(100 / 7) and p["em"]["diff"] == approx(100 / 7)
    assert p["f1"]["diff"] == approx(100 * (1 + 1 / 2 - 2 / 3) / 7)
    assert p["answer_words"]["diff"] == approx(2 / 7) and p["by_type"]["3hop"]["answer_words"]["diff"] == 2


def words(qid, n):
    """A 1-hop trajectory whose final answer is n words long."""
    return traj(qid, "1hop", ["Suldor"], ["text"], ["text"], " ".join(["Suldor"] * n))


def test_two_level_interval_counts_the_spread_between_seeds():
    base = [words(f"q{i}", 4) for i in range(20)]
    shorter, longer = [words(f"q{i}", 1) for i in range(20)], [words(f"q{i}", 7) for i in range(20)]
    # seed 1's NEW is 3 words shorter on every question, seed 2's 3 words longer: each question's difference averaged
    # over the seeds is 0, so the question-level interval is 0 .. 0; the two-level one draws both seeds' worth of
    # seed 1 (-3) or of seed 2 (+3) a quarter of the time each
    p = metrics.paired([(base, shorter), (base, longer)])["answer_words"]
    assert p["diff"] == 0 and p["per_pair"] == [-3, 3] and (p["lo"], p["hi"], p["p_not_above"]) == (0, 0, 1)
    assert (p["two_level"]["lo"], p["two_level"]["hi"]) == (-3, 3)
    assert p["two_level"]["p_not_above"] == approx(3 / 4, abs=0.02)  # only seed 2 drawn twice is above
    # every question's difference the same constant in every seed: both intervals are that constant
    q = metrics.paired([(base, [words(f"q{i}", 6) for i in range(20)])] * 3)["answer_words"]
    assert q["diff"] == q["lo"] == q["hi"] == 2 and q["two_level"] == {"lo": 2, "hi": 2, "p_not_above": 0}


def test_two_level_interval_of_one_pair_is_the_question_level_one():
    # one pair: the seed level draws that pair every time, so the two intervals differ only by their random draws
    base = [words(f"q{i}", 2) for i in range(60)]
    new = [words(f"q{i}", 2 + i % 5) for i in range(60)]  # 0..4 words longer, 2 on average
    p = metrics.paired([(base, new)])["answer_words"]
    assert p["diff"] == 2 and p["lo"] < 2 < p["hi"]
    assert p["two_level"]["lo"] == approx(p["lo"], abs=0.05) and p["two_level"]["hi"] == approx(p["hi"], abs=0.05)


def test_paired_cli_prints_both_intervals_labelled(tmp_path, capsys):
    base, new = [words(f"q{i}", 4) for i in range(5)], [words(f"q{i}", 5) for i in range(5)]
    files = []
    for name, rows in (("b1", base), ("n1", new), ("b2", base), ("n2", new)):
        dataio.write_jsonl(tmp_path / f"{name}.jsonl", rows)
        files.append(str(tmp_path / f"{name}.jsonl"))
    evaluate.print_paired(files)
    out = capsys.readouterr().out
    assert "  answer_words: +1.00 (question-level 95% interval +1.00 .. +1.00; not above base in 0.0% of resamples; " \
           "per pair +1.00, +1.00)\n      two-level 95% interval +1.00 .. +1.00; not above base in 0.0% of resamples" in out
    assert "two-level: resamples the pairs (seeds), then the questions within each drawn pair\n" in out
    assert "  1hop (5): f1_recall +0.00 (+0.00 .. +0.00 | +0.00 .. +0.00), em +0.00" in out


def test_gold_steps_ceiling_takes_only_the_final_answer_from_the_model(tiny_index):
    """gold_steps: the gold trajectory (its KBs, evidence and intermediate answers) up to the final answer, which
    the engine writes. The gold policy as the engine scores 100; an engine whose final answers are wrong keeps every
    gold step (routing 100) and scores 0, so nothing but the final answer came from it."""
    from transformers import AutoTokenizer

    import dataio
    import retrievers
    import rollout
    tok = AutoTokenizer.from_pretrained(prepare.DEFAULT_MODEL)
    qs = dataio.load_questions(tiny_index, "dev")[:8]
    ret = retrievers.Retriever(tiny_index, "bm25")
    right = metrics.score(evaluate.run_method("gold_steps", rollout.GoldPolicy(tok, qs), ret, qs, rollout.Settings()))
    assert right["f1_recall"] == 100 and right["routing_acc"] == 100 and right["format_fail"] == 0
    swap = {"text": "image", "table": "image", "image": "text"}  # its own steps would route wrong too
    wrong = [dict(q, answers=["nobody at all"], steps=[dict(st, kb=swap[st["kb"]]) for st in q["steps"]]) for q in qs]
    trajs = evaluate.run_method("gold_steps", rollout.GoldPolicy(tok, wrong), ret, qs, rollout.Settings())
    assert [x["final_answer"] for x in trajs] == ["nobody at all"] * len(qs)
    assert [x["steps"] for x in trajs] == [x["steps"] for x in rollout.rollout(rollout.GoldPolicy(tok, qs), ret, qs)]
    s = metrics.score(trajs)
    assert s["f1_recall"] == 0 and s["routing_acc"] == 100


def test_trajectory_view_shows_gold_and_each_models_steps_with_titles(tiny_world, tmp_path):
    """report.show: the first question whose gold steps use the most KBs (--answered: of those the last file answered
    right through the gold KBs, or wrong), its gold steps with their documents' titles, each file's routed steps marked against the gold KB,
    the final answer's F1-Recall and the line that asks it; bad input: one line."""
    import report
    qs = dataio.load_questions(tiny_world, "test")
    titles = {d["id"]: d["title"] for kb in dataio.KBS for d in dataio.load_kb(tiny_world, kb)}
    first = max(qs[:12], key=lambda q: len({s["kb"] for s in q["steps"]}))
    assert len({s["kb"] for s in first["steps"]}) > 1
    g = first["steps"]

    def row(q, kbs, final):
        steps = [dict(sub_question=s["sub_question"], kb=kb, retrieved=[s["doc_id"]], answer=s["answer"], step=i)
                 for i, (s, kb) in enumerate(zip(q["steps"], kbs))]
        return dict(qid=q["id"], type=q["type"], question=q["question"], answers=q["answers"], gold_steps=q["steps"],
                    steps=steps, final_answer=final, format_ok=True, error="")
    one_kb = [q for q in qs[:12] if len({s["kb"] for s in q["steps"]}) == 1]
    right = [row(q, [s["kb"] for s in q["steps"]], q["answers"][0]) for q in one_kb[:2] + [first]]
    wrong = [row(q, ["table" if s["kb"] != "table" else "text" for s in q["steps"]], "nobody") for q in one_kb[:2] + [first]]
    dataio.write_jsonl(tmp_path / "a.jsonl", right)
    dataio.write_jsonl(tmp_path / "b.jsonl", wrong)
    text = report.show([tmp_path / "a.jsonl", tmp_path / "b.jsonl"], tiny_world)
    assert text.splitlines()[0].startswith(f"question {first['id']} ({first['type']}): {first['question']}")
    for s in g:
        assert f"evidence: {titles[s['doc_id']]}" in text and s["sub_question"] in text
    a, b = text.split(f"{tmp_path / 'b.jsonl'}:")
    assert a.count(" ok] ") == len(g) and " x] " not in a and "(F1-Recall 100)" in a
    assert b.count(" x] ") == len(g) and " ok] " not in b and "final answer: nobody   (F1-Recall 0)" in b
    assert report.pick_question(right, one_kb[1]["id"]) == one_kb[1]["id"]
    assert text.splitlines()[-1] == f"ask it yourself: python serve.py ask {json.dumps(first['question'])}"
    # --answered: judged on the last file, which answered one_kb[0] right, `first` right through the wrong KBs (not
    # "right") and one_kb[1] wrong
    lucky = row(first, ["table" if s["kb"] != "table" else "text" for s in first["steps"]], first["answers"][0])
    dataio.write_jsonl(tmp_path / "m.jsonl", [right[0], lucky, wrong[1]])
    assert [report.answered_as(x) for x in (right[0], lucky, wrong[1])] == ["right", "lucky", "wrong"]
    for answered, q in (("right", one_kb[0]), ("wrong", one_kb[1])):
        text = report.show([tmp_path / "a.jsonl", tmp_path / "m.jsonl"], tiny_world, answered=answered)
        assert text.startswith(f"question {q['id']} ")
    with pytest.raises(SystemExit, match="error: --show: no question is answered right"):
        report.show([tmp_path / "b.jsonl"], tiny_world, answered="right")
    with pytest.raises(SystemExit, match="error: --show: question 'q-none' is not in the trajectories"):
        report.show([tmp_path / "a.jsonl"], tiny_world, "q-none")
    (tmp_path / "c.jsonl").write_text("{broken\n")
    with pytest.raises(SystemExit, match=r"error: --show: .*c\.jsonl"):
        report.show([tmp_path / "a.jsonl", tmp_path / "c.jsonl"], tiny_world)

def test_curves_plot_the_fixed_panels_of_the_keys_logged(tmp_path):
    # a Step-GRPO log's shape: dev scores at step 0 and at the last step only, kl None (no --kl_coef), answer_r None,
    # constant and unplotted numbers (world, grad_norm, skipped), a dict and a string
    step = lambda s, **kw: dict(step=s, epoch=0, world=1, loss=0.5, grad_norm=1.2, skipped=0, kl=None, answer_r=None,
                                route_r=0.9, clip_frac=0.01, rollout_s=5.0, update_s=3.0, memory_gib={"update": [1.0]},
                                note="text", **kw)
    dev = lambda v: dict(dev_score=v, dev_f1_recall=v, dev_routing_acc=v, dev_s=2.0)
    recs = [dict(step=0, **dev(10.0)), step(1), step(2, **dev(20.0))]
    panels = {title: dict(lines) for title, _, lines in curve_panels(recs)}
    dev_title = "dev (greedy; dev_score picks best)"
    assert list(panels) == ["rewards", "clip fraction", dev_title, "seconds a step"]  # no kl, critic, world, grad_norm
    assert list(panels["rewards"]) == ["route_r"]  # answer_r all None, outcome absent: no line
    assert panels[dev_title]["dev_score"] == [(0, 10.0), (2, 20.0)]  # only the steps scored
    assert list(panels["seconds a step"]) == ["rollout_s", "update_s", "dev_s"]
    # a critic's keys (a PPO trainer's log) get their panel
    critic = [title for title, _, _ in curve_panels(recs + [step(3, value_loss=0.2, explained_var=0.1)])]
    assert critic == ["rewards", "clip fraction", dev_title, "seconds a step", "critic"]
    # the PNG has a row of 3 panels for each 3 (4 panels: 2 rows, 14 x (3.3 x 2 + 0.6) inches at 90 dpi)
    (tmp_path / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    png = curves_chart(tmp_path / "log.jsonl", "curves")
    assert png[:4] == b"\x89PNG"
    assert (int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")) == (1260, 648)


@pytest.mark.slow
def test_the_evaluations_kv_cache_is_sized_to_its_trajectories_and_holds_them(tiny_model_dir, tiny_index, tmp_path):
    # evaluate.py's engine holds max_active trajectories in flight (rollout.kv_tokens): TRAJECTORY_TOKENS each with one
    # document a search, EVIDENCE_TOKENS a step for each further one (the baselines search every KB), at most
    # CPU_KV_TOKENS; worked examples, the route probe and a VL policy's pictures keep CPU_KV_TOKENS
    from dataclasses import replace
    import engines
    import rollout
    s, T, E = rollout.Settings(topk=1, max_active=8), rollout.TRAJECTORY_TOKENS, rollout.EVIDENCE_TOKENS
    kv = lambda methods, questions=16, settings=s, probe=0, shots=0: evaluate.engine_kv_tokens(  # noqa: E731
        tiny_model_dir, methods, probe, shots, settings, questions)
    assert kv(["routed", "oracle", "gold_steps"]) == 8 * T and kv(["routed"], questions=3) == 3 * T
    assert kv(["routed"], settings=replace(s, topk=3)) == 8 * (T + 2 * 3 * E)
    assert kv(["routed", "single_rag"]) == 8 * (T + 2 * 3 * E)  # one document from each of the three KBs
    assert kv(["routed"], 200, replace(s, max_active=64)) == 64 * T
    assert kv(["routed"], 200, replace(s, max_active=64, topk=3)) == engines.CPU_KV_TOKENS
    assert kv(["routed"], probe=4) == kv(["routed"], shots=2) == engines.CPU_KV_TOKENS
    # the gold steps (golden-length trajectories, the tiny model's answer written to its limit), 8 at a time, never
    # fill the cache: no trajectory waited
    out = tmp_path / "ev"
    evaluate.main(evaluate.get_args(["--model", str(tiny_model_dir), "--data", str(tiny_index), "--split", "test",
                                     "--n_questions", "16", "--methods", "gold_steps", "--topk", "1", "--max_active",
                                     "8", "--retriever", "bm25", "--out", str(out)]))
    row = next(iter(json.loads((out / "results.json").read_text()).values()))
    assert row["n"] == 16 and 0 < row["kv_used"] < 1.0, row
