"""tools/profile_step.py end to end on CPU (tiny model, one step each): both recipes timed, a
kernel table per recipe, the JSON written."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_profile_step_smoke(tmp_path):
    out = tmp_path / "profile.json"
    r = subprocess.run([sys.executable, "tools/profile_step.py", "model=tiny", "train.device=cpu", "train.micro_batch=2",
                        "train.seq_len=32", "--warmup", "1", "--steps", "1", "--profile-steps", "1", "--top", "5",
                        "--json", str(out)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "fp8 / bf16 tokens/s" in r.stdout
    doc = json.loads(out.read_text())
    assert [row["recipe"] for row in doc["rows"]] == ["bf16", "fp8"]
    assert all(row["step_ms"] > 0 and 0 < len(row["top"]) <= 5 for row in doc["rows"])
    assert all(0 < row["host_ms"] <= row["step_ms"] * 1.5 and row["gpu_ops_per_step"] == 0 for row in doc["rows"])
