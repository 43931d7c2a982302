"""tools/bench_norm.py end to end on the CPU path (a small shape): every variant timed, the fused
ones against torch's in the same run, and their outputs equal torch's (the CPU path is torch's code)."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_bench_norm_smoke(tmp_path):
    out = tmp_path / "norm.json"
    r = subprocess.run([sys.executable, "tools/bench_norm.py", "--shapes", "64x256", "--out", str(out)], cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(out.read_text())
    cases = {row["case"] for row in doc["rows"]}
    assert cases == {"torch add+norm 64x256", "moefp8 add+norm 64x256", "torch norm 64x256", "moefp8 norm 64x256"}
    assert all(row["ms"] > 0 and row["sol_ms"] > 0 and row["y_err"] == row["dx_err"] == 0 for row in doc["rows"])
