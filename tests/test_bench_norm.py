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


def test_sweep_picks_a_config_of_each_part(monkeypatch):
    """The --sweep path (GPU in use) on CPU tensors under the interpreter: two configs per part."""
    import importlib.util
    import os

    import pytest
    import torch

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1")
    spec = importlib.util.spec_from_file_location("bench_norm", REPO / "tools" / "bench_norm.py")
    B = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(B)
    monkeypatch.setattr(B, "SWEEP", {"fwd": [dict(BLOCK_T=1, num_warps=4), dict(BLOCK_T=2, num_warps=4)],
                                     "bwd": [dict(BLOCK_T=1, num_warps=4, PROGS_PER_SM=1),
                                             dict(BLOCK_T=2, num_warps=4, PROGS_PER_SM=2)]})
    x, a, dh, dy = (torch.randn(40, 256).bfloat16() for _ in range(4))
    fwd, bwd, log = B.sweep(x, a, torch.ones(256), dh, dy)
    assert fwd in B.SWEEP["fwd"] and bwd in B.SWEEP["bwd"] and len(log) == 4 and all(e["ms"] > 0 for e in log)
