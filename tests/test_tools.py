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
