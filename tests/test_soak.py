"""tools/soak.py end to end for a few seconds on a tiny configuration: it trains, samples, prunes
checkpoints and writes its JSON and log (the 30-minute run and its verdict: bench/results/)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest


REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_soak_smoke(tmp_path, data_dir):
    out = tmp_path / "soak.json"
    r = subprocess.run([sys.executable, "tools/soak.py", "--minutes", "0.5", "--sample-s", "0.5", "--ckpt-every", "5",
                        "--device", "cpu", "--out-dir", str(tmp_path / "run"), "--json", str(out), "model=tiny",
                        "train.micro_batch=1", "train.seq_len=32", f"data.path={data_dir}", "data.max_bytes=2000000"],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode in (0, 1), r.stdout[-2000:] + r.stderr[-2000:]  # 1: not flat (too short to judge)
    doc = json.loads(out.read_text())
    assert doc["tool"] == "soak" and doc["device"] == "cpu" and doc["tps_metric"] == "tokens_per_cpu_s"
    cases = {row["case"]: row for row in doc["rows"]}
    assert {"rss_mb", "tokens_per_s_wall", "tokens_per_cpu_s"} <= set(cases)
    assert all(row["baseline_value"] > 0 for row in doc["rows"])
    # the last third's figures: memory and the per-step rate; the windowed rates may read 0 on a loaded 2-core
    # machine (half-second windows with no finished step: checkpoint saves, other test workers)
    assert cases["rss_mb"]["value"] > 0 and cases["tokens_per_s_step_median"]["value"] > 0
    assert doc["ok"] == all(row["ok"] for row in doc["rows"] if row["decides"]) and (r.returncode == 0) == doc["ok"]
    assert len(doc["samples"]) >= 6 and doc["samples"][-1]["step"] > doc["samples"][0]["step"]
    log = (tmp_path / "soak.log").read_text()
    assert "# sample " in log and "# soak: " in log and "checkpoint " in log
    steps = sorted(p.name for p in (tmp_path / "run").glob("step_*") if not p.name.endswith(".tmp"))
    assert 1 <= len(steps) <= 3  # the tool keeps the newest two (a third may land after the last prune)


def test_soak_without_a_verdict_exits_2_with_one_line(tmp_path):
    """A run that dies (here a config group that does not exist) is no verdict: status 2, not 1 (not flat), and no JSON."""
    out = tmp_path / "soak.json"
    r = subprocess.run([sys.executable, "tools/soak.py", "--minutes", "0.5", "--sample-s", "0.2", "--device", "cpu",
                        "--out-dir", str(tmp_path / "run"), "--json", str(out), "model=no_such_model"],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1].startswith("soak: no verdict: the run exited with status ")
    assert not out.exists()
