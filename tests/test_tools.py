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
    r = subprocess.run([sys.executable, str(tool), "--only", "rowwise,requant_colwise,permute_requant_colwise",
                        "--repeat", "2", "--shapes",
                        "256x256", "--weight-shapes", "1x256x256", "--out", str(out)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [row["case"].split()[0] for row in rows] == ["rowwise", "requant_colwise", "permute_requant_colwise"]
    for row in rows:
        assert len(row["ms_runs"]) == 2 and row["ms"] == min(row["ms_runs"])
        assert row["ratio_vs_same_bytes_copy"] > 0 and row["bit_exact_vs_ref"]


def test_train_summary_writes_results_json(data_dir, tmp_path):
    """tools/train_summary.py on a real (tiny, CPU) run directory: the run's figures in a §6 JSON."""
    import json

    from moefp8.hydra_config import compose_config
    from moefp8.train import train

    run = tmp_path / "run"
    train(compose_config(["model=tiny", "train.steps=12", "train.micro_batch=2", "train.seq_len=64",
                          "train.progress=false", "logger.mode=disabled", f"data.path={data_dir}", "data.max_bytes=2000000",
                          f"train.out_dir={run}", "train.ckpt_every=0", "train.eval_every=6", "data.val_windows=8"]))
    out = tmp_path / "train.json"
    tool = Path(__file__).resolve().parent.parent / "tools" / "train_summary.py"
    r = subprocess.run([sys.executable, str(tool), str(run), "--skip", "2", "--train-command", "python -m moefp8.train",
                        "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(out.read_text())
    rows = {row["what"]: row["value"] for row in doc["rows"]}
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows["steps"] == 12 and rows["loss, last step"] == round(metrics[-1]["loss"], 4)
    assert rows["held-out loss, last evaluation"] == round(metrics[-1]["val_loss"], 4)
    tps = sorted(m["tokens_per_s"] for m in metrics[2:])
    assert rows["tokens/s, all ranks (median of steps 3-12)"] == round((tps[4] + tps[5]) / 2, 1)
    assert doc["train_command"] == "python -m moefp8.train" and doc["model"]["name"] == "tiny"
    r = subprocess.run([sys.executable, str(tool), str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and f"no metrics.jsonl in {tmp_path}" in r.stderr
