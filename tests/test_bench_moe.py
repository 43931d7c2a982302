"""tools/bench_moe.py's expert-parallel path end to end on 2 gloo ranks (tiny shapes): both
recipes timed with fixed iterations (no rank-dependent repetition counts: collectives inside)."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_bench_moe_ep_smoke(tmp_path):
    out = tmp_path / "moe.json"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        "tools/bench_moe.py", "--smoke", "--out", str(out)], cwd=REPO, capture_output=True, text=True,
                       timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["ranks"] == 2 and {row["impl"] for row in doc["rows"]} == {"moefp8 fp8", "moefp8 bf16"}
    assert all(row["ms"] > 0 and "EP2" in row["case"] for row in doc["rows"])
