"""The README's three fork recipes, each followed through: a new per-step reward (steprewards.step_reward), a new
policy model (make's MODEL), a new KB type (a row of dataio.KB_TABLE)."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import prepare
import reward
import rollout
import stepgrpo
import steprewards

ROOT = Path(__file__).resolve().parents[1]

class OddSamplesAskTheTable(rollout.GoldPolicy):
    """The gold steps, but every other sample (request) routes each sub-question to the table KB (the text KB where
    the gold is the table): groups whose KB choices differ."""
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
            return reward.format_route(self.THINK, [(s["sub_question"], flip(s["kb"])) for s in plan[turn // 2]])
        return super().step_text(q, turn, phase)

def table_reward(kind, step, target, w, encode, retrieved=None):
    """A fork's step reward: 1 for a search of the table KB, 0 for everything else."""
    return float(kind == "route" and step.ok and not step.stop and "table" in step.pairs[0][1])

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

@pytest.mark.parametrize("mode", ["teacher_prefix", "onpolicy"])
def test_a_new_step_reward_moves_the_advantages_as_it_says(tiny_index, encoder, monkeypatch, mode):
    # recipe 1: replace steprewards.step_reward; both rollout modes score every step with it. A table search earns 1,
    # anything else 0: in each group of 2 (one sample asks the table, the other the gold's or the text KB) the table
    # route gets +0.5 and the other -0.5 (r - mean, the default), and no other token gets any advantage
    from transformers import AutoTokenizer

    import dataio
    import retrievers
    monkeypatch.setattr(steprewards, "step_reward", table_reward)
    tok = AutoTokenizer.from_pretrained(prepare.DEFAULT_MODEL)
    qs = [q for q in dataio.load_questions(tiny_index, "train") if q["steps"]][:4]
    args = stepgrpo.get_args(["-n", "2", "--rollout", mode, "--route_credit", "whole", "--no-balance_kb"])
    engine, ret, w = OddSamplesAskTheTable(tok, qs), retrievers.Retriever(tiny_index, "bm25"), steprewards.Weights()
    batch = stepgrpo.teacher_prefix_batch if mode == "teacher_prefix" else stepgrpo.onpolicy_batch
    rows, _ = batch(engine, ret, qs, args, encoder.encode, w, seed=0)
    runs = [r for row in rows for r in runs_of(row) if r[0]]
    assert runs and all(a == pytest.approx(0.5 if "Table Retriever" in text else -0.5) for a, text in runs)
    assert all("</ret>" in text and "<answer>" not in text for _, text in runs)  # route tokens only
    assert {a > 0 for a, _ in runs} == {True, False}

def test_a_model_folder_given_to_make_is_used_as_given(tiny_model_dir, tmp_path):
    # recipe 2: make demo MODEL=<folder> takes the folder's tokenizer and weights (no conversion); a MODEL that is not
    # a model folder stops with one line, and make writes nothing into it
    plan = subprocess.run(["make", "-n", "demo", f"MODEL={tiny_model_dir}"], cwd=ROOT, capture_output=True, text=True)
    assert plan.returncode == 0, plan.stderr
    assert "prepare.py" not in plan.stdout
    for script in ("synth.py", "sft.py"):
        assert f"{script} --model {tiny_model_dir} " in plan.stdout
    missing = tmp_path / "not-a-model"
    r = subprocess.run(["make", "-s", f"{missing}/config.json", f"MODEL={missing}"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 2 and r.stdout.strip() == (f"error: MODEL={missing}: no config.json there; MODEL names an HF "
                                                      f"model folder (make converts only {prepare.DEFAULT_MODEL})")
    assert not missing.exists()

FOURTH_KB = '''    KB("speech", "Speech Retriever", "spr", "speech: what people said", {"id": str, "title": str, "text": str}, "text"),
'''

CHECK = '''
import json, sys
import numpy as np
import dataio, retrievers, reward, rollout, steprewards
from transformers import AutoTokenizer
data, tok = sys.argv[1], AutoTokenizer.from_pretrained(sys.argv[2])
assert dataio.KBS[-1] == "speech" and "Speech Retriever" in rollout.SYSTEM_PROMPT  # the prompt names it
assert "speech: what people said" in rollout.SYSTEM_PROMPT
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

def test_a_fourth_kb_added_to_the_table_reaches_the_prompt_parser_retrieval_and_reward(tiny_world, tmp_path):
    # recipe 3: one row added to dataio.KB_TABLE (in a copy of the code) and a file of its documents
    code = tmp_path / "code"
    code.mkdir()
    for f in ROOT.glob("*.py"):
        shutil.copy(f, code)
    src = (code / "dataio.py").read_text()
    end = src.index("\n)\nKBS = ")
    (code / "dataio.py").write_text(src[:end + 1] + FOURTH_KB + src[end + 1:])
    data = tmp_path / "data"
    shutil.copytree(tiny_world, data, ignore=shutil.ignore_patterns("index"))
    docs = [dict(id="speech-1", title="Opening of the Selstoa bridge", text="Ulla Brenmark said: the river is ours."),
            dict(id="speech-2", title="A toast", text="Ivo Lund said: to the harvest.")]
    (data / "kb" / "speech.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    step = dict(sub_question="What did Ulla say at the opening?", kb="speech", doc_id="speech-1",
                answer="the river is ours")
    q = dict(id="sp1", question="What did Ulla Brenmark say at the opening of the Selstoa bridge?",
             answers=["the river is ours"], type="1hop", steps=[step])
    (data / "questions" / "speech.jsonl").write_text(json.dumps(q) + "\n")
    r = subprocess.run([sys.executable, "-c", CHECK, str(data), str(ROOT / prepare.DEFAULT_MODEL)], cwd=code,
                       capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
