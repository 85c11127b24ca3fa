"""clock.py (where a script's wall time goes) and report.stage_minutes (the main job's table of it)."""
import json
import time

import clock
import report

def test_clock_sums_each_phase_counts_imports_from_the_process_start_and_writes_rank_0s(tmp_path, monkeypatch):
    """Each phase sums its blocks; imports run from the process's start to started() plus any imports block; the rest
    is other; the JSON line goes to $STAGE_TIMES under $STAGE_NAME, from rank 0 alone."""
    times = tmp_path / "times.jsonl"
    monkeypatch.setenv("STAGE_TIMES", str(times))
    monkeypatch.setenv("STAGE_NAME", "sft")
    c = clock.Clock()
    c.started()
    for sec in (0.2, 0.1):
        with c("compute"):
            time.sleep(sec)
    with c("imports"):
        time.sleep(0.05)
    time.sleep(0.1)
    assert c.done(print, rank=1) and not times.exists()
    parts = c.done(print)
    assert 0.3 <= parts["compute"] < 0.4 and parts["imports"] >= c.main - c.t0 + 0.05
    assert parts["other"] >= 0.1 and abs(sum(parts.values()) - (time.time() - c.t0)) < 0.05
    rec = json.loads(times.read_text())
    assert rec["stage"] == "sft" and rec["compute"] == parts["compute"]
    import psutil  # the peak resident memory: at least what this process holds now
    assert rec["peak_gib"] >= psutil.Process().memory_info().rss / 2**30 - 0.01 > 0

def test_stage_minutes_sums_a_stages_processes_by_phase(tmp_path):
    """A stage of two processes sums their phases and takes the larger peak memory; a stage without a clock shows its
    minutes alone; the last row is the whole job."""
    log = tmp_path / "stages.log"
    log.write_text("start 0\nworld 6\nsft 600\neval 300\n")
    recs = [dict(stage="sft", imports=6, model=3, compute=570, checkpoint=12, other=9, peak_gib=3.21),
            dict(stage="eval", imports=6, engine=24, compute=100, peak_gib=5.5),
            dict(stage="eval", imports=6, compute=140, peak_gib=4.0)]
    (tmp_path / "times.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    table = report.stage_minutes(log).splitlines()
    assert table[0] == ("| stage | minutes | imports s | inputs s | model s | engine s | compute s | checkpoint s | "
                        "other s | peak GiB |")
    assert table[2] == "| world | 0.1 |  |  |  |  |  |  |  |  |"
    assert table[3] == "| sft | 10.0 | 6 |  | 3 |  | 570 | 12 | 9 | 3.2 |"
    assert table[4] == "| eval | 5.0 | 12 |  |  | 24 | 240 |  |  | 5.5 |"
    assert table[5] == "| all | 15.1 | 18 | 0 | 3 | 24 | 810 | 12 | 9 | 5.5 |"
    assert "compute 89%" in table[6]
