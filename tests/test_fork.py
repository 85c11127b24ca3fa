"""The README's four fork recipes, each followed through on the default flags: a new per-step reward
(steprewards.step_reward), a new policy model (make's MODEL), a new KB type (a row of dataio.KB_TABLE, through the
whole main job), a new advantage estimator (grpo.ESTIMATORS). Each of these mutations makes one of them fail
(tests/fork_mutations.py applies each to a copy of the checkout and runs the test that should catch it):
   1. split credit's KB part hard-wired to R1-Router's 0.5 [KB right]
   2. split credit's wording half zeroed
   3. on-policy default credit the outcome alone
   4. on-policy steps rebuilt without their sub-question
   5. make converts any MODEL folder
   6. the data stage without its model (stale reuse)
   7. synth.py ignores --model
   8. no chat template: a traceback, not one line
   9. world generation picks a KB without relations
  10. the prompt names the first three KBs
  11. the released prompts name the three
  12. the parser reads the three retriever names
  13. the indexes skip a fourth KB
  14. the checkpoint's format does not record the KBs
  15. importers drop a KB's own fields
  16. metrics count the three KBs
  17. the report's table has the three KBs' columns
  18. evaluate.py's every-KB baselines search the three
  19. --adv_estimator read but not used
  20. split credit's KB part normalised by GRPO's estimator whatever the flag
  21. on-policy outcomes normalised by GRPO's estimator whatever the flag
  22. branch groups normalised by GRPO's estimator whatever the flag
"""
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import make_demo

import prepare
import reward
import rollout
import groups
import stepgrpo
import steprewards

ROOT = Path(__file__).resolve().parents[1]

class OddSamplesAskTheTable(rollout.GoldPolicy):
    """The gold steps, but every other sample (request) routes each sub-question to the table KB (the text KB where
    the gold is the table) and ends it with " Please.": groups whose KB choices and wordings differ."""
    def generate(self, prompts, max_tokens, temperature=1.0, top_p=1.0, stop=(), seed=None, top_k=0, images=None,
                 keys=None):
        out = []
        for k, key in enumerate(keys):  # a teacher-prefix group's n requests come in a row; on-policy: its trajectory
            self.odd = (k if key[0] is None else key[0]) % 2 == 1
            out += super().generate(prompts[k:k + 1], max_tokens, temperature, top_p, stop, seed, top_k, None, [key])
        return out

    def step_text(self, q, turn, phase):
        plan = self.plan(q)
        if phase == "route" and self.odd and turn // 2 < len(plan):
            flip = lambda kb: "text" if kb == "table" else "table"
            return reward.format_route(self.THINK, [(s["sub_question"] + " Please.", flip(s["kb"]))
                                                    for s in plan[turn // 2]])
        return super().step_text(q, turn, phase)

def table_reward(kind, step, target, w, encode, retrieved=None):
    """A fork's step reward: 1 for a search of the table KB plus 0.5 for a polite sub-question, 0 for anything else."""
    if kind != "route" or not step.ok or step.stop:
        return 0.0
    return float("table" in step.pairs[0][1]) + 0.5 * step.sub_question.endswith("Please.")

def runs_of(row):
    """(advantage, text) of each run of equal advantages over a row's policy tokens (a packed row: per branch)."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(prepare.DEFAULT_MODEL)
    out, cur = [], None
    for i, (t, m, a) in enumerate(zip(row["ids"], row["mask"], row["adv"])):
        key = (row["seg"][i] if "seg" in row else 0, a)
        if not m:
            cur = None
            continue
        if cur is None or cur[0] != key:
            cur = [key, []]
            out.append(cur)
        cur[1].append(t)
    return [(a, tok.decode(ids)) for (_, a), ids in out]

def test_every_listed_mutation_still_applies_to_this_checkout():
    # fork_mutations.py edits one exact string each: code that moved on would leave a mutation that breaks nothing
    import fork_mutations
    assert fork_mutations.stale() == []

@pytest.mark.parametrize("mode", ["teacher_prefix", "onpolicy"])
def test_a_new_step_reward_moves_the_advantages_as_it_says(tiny_index, encoder, monkeypatch, mode):
    # recipe 1 under the default flags: replace steprewards.step_reward; both rollout modes score every routing step
    # with it. In each group of 2 (one sample asks the gold KB, the other the table or the text KB and says "Please")
    # the rewards differ by 1 for the table and 0.5 for "Please". Teacher-prefix's default split credit puts the KB
    # term's advantage (+-0.5) on the KB tokens and the wording's (+-0.25) on the sub-question's; on-policy a step's
    # whole reward on its tokens; each times the gold route's --balance_kb factor; no other token gets any advantage
    from transformers import AutoTokenizer

    import dataio
    import retrievers
    monkeypatch.setattr(steprewards, "step_reward", table_reward)
    tok = AutoTokenizer.from_pretrained(prepare.DEFAULT_MODEL)
    qs = [q for q in dataio.load_questions(tiny_index, "train") if q["steps"]][:4]
    args = stepgrpo.get_args(["-n", "2", "--rollout", mode])
    engine, ret = OddSamplesAskTheTable(tok, qs), retrievers.Retriever(tiny_index, "bm25")
    w = stepgrpo.reward_weights(args, qs)
    batch = groups.teacher_prefix_batch if mode == "teacher_prefix" else groups.onpolicy_batch
    rows, _, _ = batch(engine, ret, qs, stepgrpo.rollout_config(args), encoder.encode, w, seed=0)
    runs = [r for row in rows for r in runs_of(row) if r[0]]
    assert runs and all("<answer>" not in text for _, text in runs)  # route tokens only
    scales = set(w.route_scale.values())
    for a, text in runs:
        table, please = "Table Retriever" in text, "Please." in text
        if mode == "onpolicy":  # a whole step: table + please against the other sample's
            assert "</ret>" in text
            # the odd sample says "Please" and asks the table unless the gold does, the even one asks the gold's
            gold_table = table != please
            odd, even = float(not gold_table) + 0.5, float(gold_table)
            expect = (odd - even) / 2 * (1 if please else -1)
        elif "</ret>" in text:  # split: the KB tokens, from <ret> on
            assert "<sub-question>" not in text
            expect = 0.5 if table else -0.5
        else:  # split: the wording
            assert "<ret>" not in text and "</sub-question>" in text
            expect = 0.25 if please else -0.25
        assert any(a == pytest.approx(expect * s) for s in scales), (a, expect, text)
    assert {a > 0 for a, _ in runs} == {True, False}
    if mode == "teacher_prefix":
        assert {"</ret>" in text for _, text in runs} == {True, False}  # both halves moved

class OddSamplesAlsoAnswerWrong(OddSamplesAskTheTable):
    """OddSamplesAskTheTable, whose odd samples also give a wrong final answer: on-policy outcomes that differ."""
    def step_text(self, q, turn, phase):
        text = super().step_text(q, turn, phase)
        return reward.format_answer("Combining the answers.", "nobody") if self.odd and text == self.script(q)[-1][1] \
            else text

def rloo(r, std):
    """A fork's estimator, RLOO (arXiv 2402.14740): each sample's reward minus the mean of the others'."""
    return r - (r.sum() - r) / (len(r) - 1) if len(r) > 1 else np.zeros_like(r)

@pytest.mark.parametrize("mode", ["teacher_prefix", "onpolicy", "branch"])
def test_a_new_advantage_estimator_reaches_every_rollout_mode(tiny_index, encoder, monkeypatch, mode):
    # recipe 4: a function added to grpo.ESTIMATORS is a choice of --adv_estimator and gives every rollout mode's
    # groups their advantages (split credit's two parts, on-policy steps and outcomes, branches). In groups of 2,
    # RLOO's r_i - r_j is twice Dr. GRPO's r_i - mean, on every trained token
    from transformers import AutoTokenizer

    import dataio
    import grpo
    import retrievers
    monkeypatch.setitem(grpo.ESTIMATORS, "rloo", rloo)
    tok = AutoTokenizer.from_pretrained(prepare.DEFAULT_MODEL)
    qs = [q for q in dataio.load_questions(tiny_index, "train") if q["steps"]][:4]
    ret = retrievers.Retriever(tiny_index, "bm25")
    adv = {}
    for est in ("grpo", "rloo"):
        args = stepgrpo.get_args(["-n", "2", "--rollout", mode, "--adv_estimator", est])
        batch = getattr(groups, f"{mode}_batch")
        rows, _, _ = batch(OddSamplesAlsoAnswerWrong(tok, qs), ret, qs, stepgrpo.rollout_config(args), encoder.encode,
                        stepgrpo.reward_weights(args, qs), seed=0)
        adv[est] = [a for r in rows for a, m in zip(r["adv"], r["mask"]) if m]
    assert any(adv["grpo"]) and adv["rloo"] == pytest.approx([2 * a for a in adv["grpo"]])

def test_a_model_folder_given_to_make_is_used_as_given(tiny_model_dir, tmp_path):
    # recipe 2: make demo MODEL=<folder> takes the folder's tokenizer and weights (no conversion); a MODEL that is not
    # a model folder stops with one line, and make writes nothing into it
    plan = subprocess.run(["make", "-n", "demo", f"MODEL={tiny_model_dir}", f"DATA={tmp_path}/d", f"OUT={tmp_path}/o"],
                          cwd=ROOT, capture_output=True, text=True)
    assert plan.returncode == 0, plan.stderr
    assert "prepare.py" not in plan.stdout
    for script in ("synth.py", "sft.py"):
        assert f"{script} --model {tiny_model_dir} " in plan.stdout
    missing = tmp_path / "not-a-model"
    r = subprocess.run(["make", "-s", "-o", ".venv/.stamp", f"{missing}/config.json", f"MODEL={missing}"], cwd=ROOT,
                       capture_output=True, text=True)  # -o: the venv taken as built, never remade from a test
    assert r.returncode == 2 and r.stdout.strip() == (f"error: MODEL={missing}: no config.json there; MODEL names an HF "
                                                      f"model folder (make converts only {prepare.DEFAULT_MODEL})")
    assert not missing.exists()

def test_make_demo_with_another_model_after_one_remakes_the_data_and_retrains(tiny_model_dir, tmp_path):
    # recipe 2: after the main job ran with model A, `make demo MODEL=B` plans B's golden data and SFT (and not A's
    # reused as B's), and A again after B plans A's; a built job with its own model plans no data or training
    a, b = tiny_model_dir, tmp_path / "b"
    shutil.copytree(a, b)
    data, out = tmp_path / "d", tmp_path / "o"
    make = lambda model, *flags: subprocess.run(["make", *flags, "demo", f"MODEL={model}", f"DATA={data}", f"OUT={out}"],
                                                cwd=ROOT, capture_output=True, text=True)
    stamp = lambda model: data / "made-with" / os.path.abspath(model).replace("/", "+")
    def built_with(model):  # the main job's files, each newer than what it is made from, as a finished run leaves them
        shutil.rmtree(data / "made-with", ignore_errors=True)
        files = [stamp(model), data / "world.json", data / "index/meta.json", data / "traj-top1/train.jsonl"] + \
            [out / f"{arm}/final/config.json" for arm in ("sft", "sft-cont", "stepgrpo")] + [out / "eval/stepgrpo/results.json"]
        for i, f in enumerate(files):
            f.parent.mkdir(parents=True, exist_ok=True)
            f.touch()
            os.utime(f, (time.time() + i, time.time() + i))
    trains = lambda plan: [s for s in ("synth.py", "sft.py", "stepgrpo.py", "evaluate.py") if f"{s} " in plan.stdout]
    built_with(a)
    assert trains(make(a, "-n")) == []  # the report alone (runs/demo_report.sh)
    plan = make(b, "-n")
    assert plan.returncode == 0 and trains(plan) == ["synth.py", "sft.py", "stepgrpo.py", "evaluate.py"], plan.stdout
    assert f"synth.py --model {b} " in plan.stdout and f"sft.py --model {b} " in plan.stdout
    built_with(b)
    assert trains(make(a, "-n"))[:2] == ["synth.py", "sft.py"]

def test_synth_writes_the_given_models_tokens_and_refuses_one_without_a_chat_template(tiny_model_dir, tiny_index,
                                                                                        tmp_path):
    # recipe 2's data stage: synth.py --model writes the trajectories in that model's tokenizer (the tests' 4,096-id
    # cut of SmolLM2's, not the default's 49,152); every step is a chat turn, so a folder whose tokenizer has no
    # chat template is refused by name, nothing written (synth.main in this process: its command after the parsing)
    from transformers import AutoTokenizer

    import synth
    import transcript
    run = lambda model, out: synth.main(synth.get_args(["--model", str(model), "--data", str(tiny_index), "--out", str(out),
                                                        "--limit", "2", "--splits", "dev", "--retriever", "bm25"]))
    run(tiny_model_dir, tmp_path / "traj")
    meta = json.loads((tmp_path / "traj" / transcript.META).read_text())
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert meta["vocab_sha256"] == transcript.tokenizer_meta(tok)["vocab_sha256"]
    rows = [json.loads(line) for line in open(tmp_path / "traj" / "dev.jsonl")]
    assert len(rows) == 2 and all(max(x["ids"]) < len(tok) for x in rows)
    bare = tmp_path / "bare"
    shutil.copytree(tiny_model_dir, bare)
    cfg = json.loads((bare / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(cfg))
    (bare / "chat_template.jinja").unlink(missing_ok=True)
    with pytest.raises(SystemExit) as e:
        run(bare, tmp_path / "bare-traj")
    assert e.value.code == (f"error: {bare}: the tokenizer has no chat template (tokenizer_config.json's chat_template "
                            "or chat_template.jinja); every step is a chat turn rendered through it")
    assert not (tmp_path / "bare-traj").exists()

FOURTH_KB = '''    KB("speech", "Speech Retriever", "spr", "speech: what people said",
       {"id": str, "title": str, "speaker": str, "text": str}, "text"),
'''

CHECK = '''
import json, sys
import numpy as np
import dataio, prompts, retrievers, reward, rollout, steprewards
from transformers import AutoTokenizer
data, tok = sys.argv[1], AutoTokenizer.from_pretrained(sys.argv[2])
assert dataio.KBS[-1] == "speech" and "Speech Retriever" in prompts.SYSTEM_PROMPT  # the prompt names it
assert "speech: what people said" in prompts.SYSTEM_PROMPT
assert "Table Retriever, Speech Retriever." in prompts.RELEASED_ROUTE_PROMPT  # the released prompts name it too
assert "`Speech Retriever`:" in prompts.RELEASED_ROUTE_PROMPT and "Speech Retriever." in prompts.RELEASED_REMINDER
import pathlib, tempfile, transcript
three = pathlib.Path(tempfile.mkdtemp())  # a checkpoint trained with the three KBs is refused under four
fmt = transcript.format_meta(rollout.Settings())
(three / transcript.FORMAT).write_text(json.dumps({**fmt, "kbs": ["text", "table", "image"]}))
assert "the KBs text table image speech of dataio.KB_TABLE (trained: text table image)" in \
    transcript.check_format(three, rollout.Settings())
text = "<think>t</think><sub-question>What did Ulla say at the opening?</sub-question><ret>Speech Retriever</ret>"
p = reward.parse_route(text)
assert p.ok and p.kb == "speech", p  # the parser reads it
retrievers.build(data, methods=("bm25",), progress=False)
ret = retrievers.Retriever(data, "bm25")
q = dataio.load_questions(data, "speech")[0]  # the loader takes its steps
x = rollout.rollout(rollout.GoldPolicy(tok, [q]), ret, [q])[0]  # the step loop searches it
assert x["format_ok"] and x["steps"][0]["kb"] == "speech" and x["steps"][0]["retrieved"][0] == "speech-1", x["steps"]
assert "Retrieved by Speech Retriever:" in tok.decode(x["ids"])
bow = lambda texts: np.array([[t.lower().count(w) for w in ("ulla", "say", "opening")] for t in texts], dtype=float)
r = steprewards.step_reward("route", p, [q["steps"][0]], steprewards.Weights(), bow)
assert abs(r - (0.2 + 1.0)) < 1e-9, r  # the route reward: format + same sub-question + the right KB
wrong = reward.parse_route(text.replace("Speech Retriever", "Text Retriever"))
assert abs(steprewards.step_reward("route", wrong, [q["steps"][0]], steprewards.Weights(), bow) - 0.7) < 1e-9
print("ok")
'''

def fork_code(tmp_path):
    """A copy of the code (scripts, Makefile, runs/) with the fourth KB's row added to dataio.KB_TABLE."""
    code = tmp_path / "code"
    code.mkdir()
    for f in [*ROOT.glob("*.py"), ROOT / "Makefile"]:
        shutil.copy(f, code)
    shutil.copytree(ROOT / "runs", code / "runs")
    src = (code / "dataio.py").read_text()
    end = src.index("\n)\nKBS = ")
    (code / "dataio.py").write_text(src[:end + 1] + FOURTH_KB + src[end + 1:])
    return code

def test_a_fourth_kb_added_to_the_table_reaches_the_prompt_parser_retrieval_and_reward(tiny_world, tmp_path):
    # recipe 3: one row added to dataio.KB_TABLE (in a copy of the code) and a file of its documents
    code = fork_code(tmp_path)
    data = tmp_path / "data"
    shutil.copytree(tiny_world, data, ignore=shutil.ignore_patterns("index"))
    docs = [dict(id="speech-1", title="Opening of the Selstoa bridge", speaker="Ulla Brenmark",
                 text="Ulla Brenmark said: the river is ours."),
            dict(id="speech-2", title="A toast", speaker="Ivo Lund", text="Ivo Lund said: to the harvest.")]
    (data / "kb" / "speech.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    step = dict(sub_question="What did Ulla say at the opening?", kb="speech", doc_id="speech-1",
                answer="the river is ours")
    q = dict(id="sp1", question="What did Ulla Brenmark say at the opening of the Selstoa bridge?",
             answers=["the river is ours"], type="1hop", steps=[step])
    (data / "questions" / "speech.jsonl").write_text(json.dumps(q) + "\n")
    r = subprocess.run([sys.executable, "-c", CHECK, str(data), str(ROOT / prepare.DEFAULT_MODEL)], cwd=code,
                       capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
    # an importer's corpus for it keeps the KB's own fields (the speaker), and a row without one is refused by line
    r = subprocess.run([sys.executable, "importers.py", "--out", str(tmp_path / "imported"), "--corpus",
                        f"speech={data / 'kb' / 'speech.jsonl'}"], cwd=code, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert [json.loads(line) for line in open(tmp_path / "imported" / "kb" / "speech.jsonl")] == docs
    (tmp_path / "bad.jsonl").write_text(json.dumps(dict(docs[0], speaker=None)) + "\n")
    r = subprocess.run([sys.executable, "importers.py", "--out", str(tmp_path / "bad"), "--corpus",
                        f"speech={tmp_path / 'bad.jsonl'}"], cwd=code, capture_output=True, text=True)
    assert r.returncode == 1 and f"{tmp_path / 'bad.jsonl'}:1: field 'speaker' should be str" in r.stderr, r.stderr

def speech_questions(world, n=24):
    """Documents of the fourth KB (what the world's people said) and one 1-hop question about each."""
    people = [json.loads(line)["title"] for line in open(world / "kb" / "text.jsonl")][:n]
    docs, qs = [], []
    for i, name in enumerate(people):
        said = f"the {['river', 'harvest', 'bridge', 'mountain'][i % 4]} is {['ours', 'late', 'wide', 'old'][i // 4 % 4]}"
        docs.append(dict(id=f"speech-{i}", title=f"Speech by {name}", speaker=name, text=f"{name} said: {said}."))
        sub = f"What did {name} say in the speech?"
        qs.append(dict(id=f"sp{i}", question=sub, answers=[said], type="1hop",
                       steps=[dict(sub_question=sub, kb="speech", doc_id=f"speech-{i}", answer=said)]))
    return docs, qs

@pytest.mark.slow
def test_a_fourth_kb_runs_through_the_whole_main_job(tiny_model_dir, tmp_path):
    # recipe 3 end to end: the row added, corpus.py makes a world (its new KB empty), the KB's documents and questions
    # added, then `make demo` in the fork: indexes, golden data, SFT, SFT-continued, Step-GRPO, evaluation, report
    code, world = fork_code(tmp_path), tmp_path / "world"
    r = subprocess.run([sys.executable, "corpus.py", "--out", str(world), "--n_people", "60", "--n_cities", "12",
                        "--n_countries", "4", "--n_orgs", "15", "--n_works", "40", "--n_train", "40", "--n_dev", "8",
                        "--n_test", "8", "--n_visual_train", "4", "--n_visual_dev", "2", "--n_visual_test", "2",
                        "--quiet"], cwd=code, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert (world / "kb" / "speech.jsonl").read_text() == ""
    docs, qs = speech_questions(world)
    (world / "kb" / "speech.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    for split, part in (("train", qs[:16]), ("dev", qs[16:20]), ("test", qs[20:])):  # scored first: EVAL_N
        path = world / "questions" / f"{split}.jsonl"
        path.write_text("".join(json.dumps(q) + "\n" for q in part) + path.read_text())
    out, text = make_demo(tmp_path, tiny_model_dir, world, code)
    assert "speech" in json.loads((world / "index" / "meta.json").read_text())["kbs"]
    golden = [json.loads(line) for line in open(world / "traj-top1" / "train.jsonl")]
    spoken = [x for x in golden if x["qid"].startswith("sp")]
    assert len(spoken) == 16 and all(x["format_ok"] and x["steps"][0]["kb"] == "speech" and
                                     x["steps"][0]["retrieved"][0].startswith("speech-") for x in spoken)
    res = json.loads((out / "results" / "results.json").read_text())
    for arm in ("sft", "sft-cont", "stepgrpo"):
        m = res[f"{arm}/routed"]
        assert "speech" in m["retrievals_by_kb"] and "speech" in m["confusion"]["rows"], (arm, m)
        assert json.loads((out / arm / "final" / "transcript.json").read_text())["kbs"][-1] == "speech"
    assert "speech/q" in text  # the report's table has the KB's column
    # the baselines that search every KB search it too (evaluate.py's single_rag: each KB once a question; the HF
    # engine, which starts in half the time: the engine is not what is tested here)
    r = subprocess.run([sys.executable, "evaluate.py", "--model", str(out / "sft" / "final"), "--data", str(world),
                        "--split", "test", "--n_questions", "2", "--methods", "single_rag", "--name", "sft", "--backend",
                        "hf", "--out", str(tmp_path / "rag")],
                       cwd=code, capture_output=True, text=True, env=dict(os.environ, WANDB_MODE="disabled"))
    assert r.returncode == 0, r.stderr[-2000:]
    rag = json.loads((tmp_path / "rag" / "results.json").read_text())
    assert {kb: v > 0 for kb, v in rag["sft/single_rag"]["retrievals_by_kb"].items()} == dict.fromkeys(
        ["text", "table", "image", "speech"], True), rag
