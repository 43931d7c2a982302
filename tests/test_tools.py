"""Every tool in tools/ imports and answers --help on a CPU machine (a stale import in a GPU-only
benchmark otherwise shows up only on the device)."""

import subprocess
import sys
from pathlib import Path

import pytest

TOOLS = sorted((Path(__file__).resolve().parent.parent / "tools").glob("*.py"))


@pytest.mark.parametrize("tool", TOOLS, ids=[t.name for t in TOOLS])
def test_tool_help(tool):
    r = subprocess.run([sys.executable, str(tool), "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "usage" in r.stdout.lower()


def test_bench_quant_runs_on_cpu(tmp_path):
    """The quant benchmark's CPU path end to end: the best of --repeat medians, all of them saved,
    and the ratio to a copy of each kernel's own byte count beside the headline ratio."""
    import json

    out = tmp_path / "quant.json"
    tool = Path(__file__).resolve().parent.parent / "tools" / "bench_quant.py"
    r = subprocess.run([sys.executable, str(tool), "--only", "rowwise,requant_colwise", "--repeat", "2", "--shapes",
                        "256x256", "--weight-shapes", "1x256x256", "--out", str(out)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [row["case"].split()[0] for row in rows] == ["rowwise", "requant_colwise"]
    for row in rows:
        assert len(row["ms_runs"]) == 2 and row["ms"] == min(row["ms_runs"])
        assert row["ratio_vs_same_bytes_copy"] > 0 and row["bit_exact_vs_ref"]
