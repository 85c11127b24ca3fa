"""The pipeline end to end through its command lines, as `make demo` runs it, at the smallest size: golden
trajectories (synth.py) -> SFT (sft.py) -> that checkpoint as a teacher sampling through the loop with R1-Router's
filter (synth.py --teacher) -> Step-GRPO at stored trajectories' prefixes (stepgrpo.py --prefixes, vLLM engine
synced after the update, a dev evaluation with the router diagnostics) -> evaluation (evaluate.py) of both
checkpoints, greedy and sampled (--protocol released), and their paired comparison. Tiny random Llama, tiny world,
BM25 (a random teacher keeps next to nothing, so Step-GRPO's prefixes are the golden trajectories, synth.py's same
rows). The fast tier's smoke test (`make test-fast`)."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def cli(script, *args):
    r = subprocess.run([sys.executable, str(ROOT / script), *map(str, args)], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, f"{script}: {r.stderr[-3000:]}"
    return r.stdout


def test_synth_sft_stepgrpo_evaluate_end_to_end(tmp_path, tiny_model_dir, tiny_index):
    traj = tmp_path / "traj"
    cli("synth.py", "--data", tiny_index, "--model", tiny_model_dir, "--out", traj, "--retriever", "bm25",
        "--limit", "8", "--gold_think", "kb_last")
    assert len((traj / "train.jsonl").read_text().splitlines()) == 8
    cli("sft.py", "--model", tiny_model_dir, "--data", traj, "--out", tmp_path / "sft", "--train_steps", "2",
        "--grad_accum", "2", "--max_len", "512", "--eval_every", "0", "--save_every", "0", "--wandb_mode", "disabled",
        "--dtype", "fp32")
    cli("synth.py", "--data", tiny_index, "--out", tmp_path / "teacher", "--teacher", tmp_path / "sft" / "final", "-n", "1",
        "--splits", "train", "--offset", "8", "--limit", "4", "--retriever", "bm25", "--gold_think", "kb_last")
    report = json.loads((tmp_path / "teacher" / "train.errors.json").read_text())
    counts = report["filters"]
    assert counts["sampled"] == 4 and len(report["dropped"]) + counts["kept_questions"] == 4, report
    cli("stepgrpo.py", "--model", tmp_path / "sft" / "final", "--data", tiny_index, "--out", tmp_path / "grpo",
        "--prefixes", traj, "--teacher_spans", "all", "--lr", "2e-5", "--train_steps", "1", "--batch_questions", "2", "-n", "2", "--retriever", "bm25", "--eval_questions", "4",
        "--save_every", "1", "--wandb_mode", "disabled", "--dtype", "fp32", "--gold_think", "kb_last")
    rec = [json.loads(l) for l in open(tmp_path / "grpo" / "log.jsonl")]
    assert [r["step"] for r in rec] == [0, 1]  # the start's dev score, then the step's
    assert {"dev_routing_macro0", "dev_route_info0"} <= rec[1].keys() and "kb_entropy" in rec[1]
    assert (tmp_path / "grpo" / "curves.png").is_file()
    for name in ("sft", "grpo"):
        cli("evaluate.py", "--model", tmp_path / name / "final", "--name", name, "--data", tiny_index, "--split", "test",
            "--n_questions", "6", "--methods", "routed", "--retriever", "bm25", "--out", tmp_path / "eval" / name)
        res = json.loads((tmp_path / "eval" / name / "results.json").read_text())
        assert res[f"{name}/routed"]["n"] == 6 and len(res[f"{name}/routed"]["confusion_by_step"]) >= 1
    cli("evaluate.py", "--model", tmp_path / "grpo" / "final", "--name", "grpo", "--data", tiny_index, "--split", "test",
        "--n_questions", "6", "--methods", "routed", "--retriever", "bm25", "--protocol", "released",
        "--out", tmp_path / "sampled" / "grpo")
    assert json.loads((tmp_path / "sampled" / "grpo" / "results.json").read_text())["grpo/routed+released"]["n"] == 6
    # a rerun into the same folder with one more method reuses the finished one (an interrupted evaluation resumes)
    routed = tmp_path / "eval" / "sft" / "trajectories-routed.jsonl"
    before = routed.stat().st_mtime_ns
    out = cli("evaluate.py", "--model", tmp_path / "sft" / "final", "--name", "sft", "--data", tiny_index, "--split",
              "test", "--n_questions", "6", "--methods", "routed", "no_retrieval", "--retriever", "bm25",
              "--out", tmp_path / "eval" / "sft")
    res = json.loads((tmp_path / "eval" / "sft" / "results.json").read_text())
    assert "routed: its scores reused" in out and routed.stat().st_mtime_ns == before
    assert res["sft/no_retrieval"]["n"] == 6 and res["sft/routed"] == json.loads(
        (tmp_path / "eval" / "sft" / "method-routed.json").read_text())["results"]["sft/routed"]
    out = cli("evaluate.py", "--paired", tmp_path / "eval" / "sft" / "trajectories-routed.jsonl",
              tmp_path / "eval" / "grpo" / "trajectories-routed.jsonl")
    assert "F1-Recall" in out or "f1_recall" in out
    # each checkpoint records the transcript format it was trained on; another one is refused in one line
    for name in ("sft", "grpo"):
        assert json.loads((tmp_path / name / "final" / "transcript.json").read_text())["gold_think"] == "kb_last"
    r = subprocess.run([sys.executable, str(ROOT / "evaluate.py"), "--model", str(tmp_path / "sft" / "final"),
                        "--data", str(tiny_index), "--gold_think", "kb_first", "--structure", "released",
                        "--out", str(tmp_path / "eval" / "x")], capture_output=True, text=True, cwd=ROOT)
    last = r.stderr.strip().splitlines()[-1]  # one line, not a traceback
    assert r.returncode != 0 and last.startswith("error: ") and "Traceback" not in r.stderr, r.stderr
    assert "--gold_think kb_first (trained: kb_last), --structure released (trained: transcript)" in last
