"""The main job end to end through its real command, `make demo`, at the smallest size (tiny random Llama, tiny world,
a few steps): golden trajectories -> SFT -> SFT-continued and Step-GRPO (vLLM engine synced after each update) ->
the three evaluated -> the report (table, paired intervals, one question's trajectories, the closing lines), each stage
timed by runs/stage.sh; a rerun skips every built stage. Then the pieces the main job leaves to the claim runs, from
its checkpoints: the SFT checkpoint as a teacher sampling through the loop with R1-Router's filter (synth.py
--teacher), sampled evaluation (--protocol released), an evaluation's resume, and a format mismatch refused in one
line. In `make test` only (slow: the main job's command, ~1 min here); `make test-fast` leaves it out."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import make_demo

import evaluate
import synth

ROOT = Path(__file__).resolve().parents[1]
argv = lambda *args: list(map(str, args))


def cli(script, *args):
    r = subprocess.run([sys.executable, str(ROOT / script), *map(str, args)], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, f"{script}: {r.stderr[-3000:]}"
    return r.stdout


@pytest.mark.slow
def test_make_demo_end_to_end_then_the_claim_runs_pieces(tmp_path, tiny_model_dir, tiny_index, capsys):
    world = shutil.copytree(tiny_index, tmp_path / "world")  # the demo writes its trajectories into the world's folder
    out, text = make_demo(tmp_path, tiny_model_dir, world)
    for stage in ("data", "sft", "sft-cont", "stepgrpo", "eval", "report"):
        assert f"== {stage}: " in text and "min left at this machine's pace" in text, stage
    res = json.loads((out / "results" / "results.json").read_text())
    assert sorted(res) == ["sft-cont/routed", "sft/routed", "stepgrpo/routed"] and all(r["n"] == 6 for r in res.values())
    assert text.count("f1_recall: ") == 2 and "gold steps:" in text and f"{out}/eval/stepgrpo/trajectories-routed.jsonl:" in text
    assert "What this table can show" in text and "F1-Recall points wide" in text
    assert [r["step"] for r in map(json.loads, open(out / "stepgrpo" / "log.jsonl"))] == [1]
    assert (out / "stepgrpo" / "curves.png").is_file()
    for name in ("sft", "sft-cont", "stepgrpo"):  # the main job's evidence budget, recorded with each evaluation
        assert json.loads((out / "eval" / name / "method-routed.json").read_text())["signature"]["topk"] == 1
    again = make_demo(tmp_path, tiny_model_dir, world, plan=True)[1]  # every stage built: a rerun plans the report alone
    assert "runs/demo_report.sh" in again and not any(s in again for s in ("synth.py", "sft.py", "stepgrpo.py", "evaluate.py"))

    sft, grpo = out / "sft" / "final", out / "stepgrpo" / "final"
    # the pieces in this process (their commands' own parsing, main and files; only the start-up is not paid again)
    synth.main(synth.get_args(argv("--model", tiny_model_dir, "--data", world, "--out", tmp_path / "teacher", "--teacher",
                                   sft, "-n", "1", "--splits", "train", "--offset", "8", "--limit", "4", "--retriever",
                                   "bm25", "--topk", "1")))
    report = json.loads((tmp_path / "teacher" / "train.errors.json").read_text())
    counts = report["filters"]
    assert counts["sampled"] == 4 and len(report["dropped"]) + counts["kept_questions"] == 4, report
    evaluate.main(evaluate.get_args(argv("--model", grpo, "--name", "grpo", "--data", world, "--split", "test",
                                         "--n_questions", "6", "--methods", "routed", "--retriever", "bm25", "--protocol",
                                         "released", "--backend", "hf", "--out", tmp_path / "sampled")))
    assert json.loads((tmp_path / "sampled" / "results.json").read_text())["grpo/routed+released"]["n"] == 6
    # Step-GRPO's checkpoint in an engine of its own scores as it did swapped into the demo's engine after two others;
    # SFT's, swapped in after it, with one more method into its demo folder, reuses the finished method (an
    # interrupted evaluation resumes)
    routed = out / "eval" / "sft" / "trajectories-routed.jsonl"
    before = routed.stat().st_mtime_ns
    capsys.readouterr()
    evaluate.main(evaluate.get_args(argv("--model", grpo, sft, "--name", "stepgrpo", "sft", "--data", world, "--split",
                                         "test", "--n_questions", "6", "--topk", "1", "--methods", "routed",
                                         "no_retrieval", "ircot", "--out", tmp_path / "alone", out / "eval" / "sft")))
    text = capsys.readouterr().out
    strip = lambda f: [{k: v for k, v in x.items() if k != "timings"} for x in map(json.loads, open(f))]
    assert strip(tmp_path / "alone" / "trajectories-routed.jsonl") == strip(out / "eval" / "stepgrpo" / "trajectories-routed.jsonl")
    res = json.loads((out / "eval" / "sft" / "results.json").read_text())
    assert "routed: its scores reused" in text and routed.stat().st_mtime_ns == before
    assert res["sft/no_retrieval"]["n"] == 6 and res["sft/ircot"]["n"] == 6
    assert res["sft/ircot"]["retrievals"] >= 3  # IRCoT: the question searches every KB, then each sentence does
    paired = cli("evaluate.py", "--paired", *(out / "eval" / "sft" / f"trajectories-{m}.jsonl" for m in ("no_retrieval", "ircot")))
    assert "f1_recall: " in paired and "two-level" in paired
    # each checkpoint records the transcript format it was trained on; another one is refused in one line
    for ck in (sft, grpo):
        assert json.loads((ck / "transcript.json").read_text()) == dict(structure="transcript", max_pairs=1, max_rets=1,
                                                                                   actions=False, kbs=["text", "table", "image"])
    r = subprocess.run([sys.executable, str(ROOT / "evaluate.py"), "--model", str(sft), "--data", str(world),
                        "--max_pairs", "2", "--structure", "released", "--out", str(tmp_path / "x")],
                       capture_output=True, text=True, cwd=ROOT)
    last = r.stderr.strip().splitlines()[-1]  # one line, not a traceback
    assert r.returncode != 0 and last.startswith("error: ") and "Traceback" not in r.stderr, r.stderr
    assert "--structure released (trained: transcript), --max_pairs 2 (trained: 1)" in last
