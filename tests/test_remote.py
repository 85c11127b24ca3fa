"""remote.OpenAIEngine (`--backend openai`): the step loop against a real vLLM OpenAI server on loopback gives the
in-process engine's trajectories, token for token, at temperature 0; what a served model cannot do is refused in one
line."""
import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

def evaluate(*args):
    """evaluate.py's command, in this process (an OpenAI engine needs no start-up: a process would be most of it)."""
    import evaluate
    evaluate.main(evaluate.get_args([*map(str, args)]))

@pytest.mark.slow
def test_evaluate_through_a_vllm_server_gives_the_in_process_trajectories(tiny_model_dir, tiny_index, tmp_path, monkeypatch):
    import engines
    port, log = free_port(), open(tmp_path / "server.log", "w")
    kv = engines.CPU_KV_TOKENS * engines.kv_bytes_per_token(tiny_model_dir, "float32")  # the in-process engine's cache
    server = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_model_dir),
                               "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "4096", "--enforce-eager",
                               "--seed", "0", "--kv-cache-memory-bytes", str(kv)],
                              stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        # one request in flight on both sides (max_active 1), so batching cannot change the arithmetic: the same
        # trajectories, token for token, from the in-process engine (run while the server starts) and from the server
        # (on 12 questions: the tiny random policy writes to every length limit, one request at a time)
        import dataio
        import retrievers
        import rollout
        qs, ret = dataio.load_questions(tiny_index, "test")[:12], retrievers.Retriever(tiny_index, "bm25")
        s = rollout.Settings(temperature=0.0, max_active=1)
        local = engines.VLLMEngine(tiny_model_dir, max_model_len=4096)
        try:
            a = rollout.rollout(local, ret, qs, s=s)
        finally:
            local.close()
        for _ in range(600):  # ~20 s on 2 cores
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            try:
                urllib.request.urlopen(url + "/models", timeout=2)
                break
            except OSError:
                time.sleep(0.5)
        b = rollout.rollout(engines.make_engine("openai", tiny_model_dir, base_url=url), ret, qs, s=s)
        assert len(a) == len(b) == len(qs) and sum(sum(x["mask"]) for x in b) > 0
        for x, y in zip(a, b):
            for key in ("ids", "mask", "spans", "steps", "final_answer", "format_ok", "error"):
                assert x[key] == y[key], (x["qid"], key)
            # the sampled tokens' logprobs, computed by another process's kernels: close, not bitwise (measured 5e-3)
            assert max(abs(p - q) for p, q in zip(x["logprobs"], y["logprobs"])) < 2e-2
        # evaluate.py through the server writes those trajectories
        common = ["--model", tiny_model_dir, "--data", tiny_index, "--split", "test", "--n_questions", "12", "--methods", "routed",
                  "--retriever", "bm25", "--max_active", "1"]
        # (judged by the same server: evaluate.py --judge writes the judge metric and its agreement with EM)
        evaluate(*common, "--backend", "openai", "--base_url", url, "--judge", tiny_model_dir, "--judge_url", url,
                 "--out", tmp_path / "remote")
        row = next(iter(json.loads((tmp_path / "remote" / "results.json").read_text()).values()))
        assert 0 < row["judge_n"] <= row["n"] and 0 <= row["judge_em_agree"] <= 100, row  # a format failure: 0, rated
        assert "## LLM judge" in (tmp_path / "remote" / "table.md").read_text()
        saved = [json.loads(line) for line in open(tmp_path / "remote" / "trajectories-routed.jsonl")]
        assert [(x["spans"], x["steps"], x["final_answer"]) for x in saved] == [(x["spans"], x["steps"], x["final_answer"])
                                                                            for x in a]
        # the judge (judge.py) through the same server: every rating one of the scale's or None, a second call
        # answered from the cache
        import judge
        j = judge.Judge.load(tiny_model_dir, url, cache=tmp_path / "judge.jsonl")
        items = [(x["question"], " or ".join(x["answers"]), x["final_answer"] or "none") for x in a[:3]]
        scores = j.accuracy(items)
        assert j.asked == 6 and all(s in (None, 0.0, 0.25, 0.5, 0.75, 1.0) for s in scores), scores
        assert j.accuracy(items) == scores and j.asked == 6
        assert len((tmp_path / "judge.jsonl").read_text().splitlines()) == 6
        # the judged RAG reward (steprewards.judge_rag, stepgrpo.py --w_rag) through the same server, on the gold
        # policy's trajectories (the tiny random policy finishes none): every finished trajectory's term on the scale,
        # each prompt cached; a second judge on the same cache asks nothing and gives the same terms
        import steprewards
        from transformers import AutoTokenizer
        gold = rollout.rollout(rollout.GoldPolicy(AutoTokenizer.from_pretrained(tiny_model_dir), qs), ret, qs[:4], s=s)
        assert all(x["final_answer"] and x["evidence"] for x in gold)
        terms = []
        for _ in range(2):
            w = steprewards.Weights(rag=(2.0, 1.0), judge=judge.Judge.load(tiny_model_dir, url, cache=tmp_path / "rag.jsonl"))
            terms.append((steprewards.judge_rag(w, gold), w.judge.asked))
        assert all(0 <= v <= 3.0 for v in terms[0][0]) and terms[0][1] > 0, terms
        assert terms[1] == (terms[0][0], 0)
        # stepgrpo.py --w_rag with --judge_url runs a step through it and logs the term
        import stepgrpo
        stepgrpo.main([*map(str, ["--model", tiny_model_dir, "--data", tiny_index, "--retriever", "bm25", "--rollout",
                                  "onpolicy", "--batch_questions", "2", "-n", "2", "--train_steps", "1",
                                  "--eval_questions", "0", "--dtype", "fp32", "--backend", "hf", "--w_rag", "2.0", "1.0",
                                  "--judge", tiny_model_dir, "--judge_url", url, "--out", tmp_path / "grpo"])])
        rec = [json.loads(line) for line in open(tmp_path / "grpo" / "log.jsonl")][-1]
        assert 0 <= rec["rag"] <= 3.0, rec
        # what a served model cannot do: swap in other weights
        with pytest.raises(SystemExit, match="^error: --backend openai scores the one model"):
            evaluate(*common, "--backend", "openai", "--base_url", url, "--model", tiny_model_dir, tiny_model_dir,
                     "--out", tmp_path / "x", tmp_path / "y")
    finally:
        server.terminate()
        server.wait(timeout=60)
    # a server that is gone: a one-line error naming it, after the retries (the policy's server, and a judge's); their
    # back-off not slept here
    import remote
    monkeypatch.setattr(time, "sleep", lambda s: None)
    with pytest.raises(SystemExit, match=f"^error: the server {url} did not answer"):
        evaluate(*common, "--backend", "openai", "--base_url", url, "--out", tmp_path / "gone")
    with pytest.raises(SystemExit, match=f"error: the server {url} did not answer /models after {remote.TRIES} tries"):
        judge.Judge.load(tiny_model_dir, url)  # stepgrpo.py --judge_url's start too
