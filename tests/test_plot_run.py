"""tools/plot_run.py on synthetic run dirs: current and older metrics.jsonl (with and without the
per-layer expert load, held-out loss, MFU), a torn last line, several runs overlaid, and the bad
inputs that are one line on stderr and exit status 1."""

import json
import math
import random
import struct
import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parent.parent / "tools" / "plot_run.py"


def write_run(run_dir: Path, steps: int = 200, per_layer: bool = True, val: bool = True, mfu: bool = True,
              torn: bool = True, layers: int = 6) -> Path:
    """A metrics.jsonl shaped like moefp8.train's: one JSON object per step; torn: a last line cut
    mid-write, as a killed run leaves it."""
    rng = random.Random(str(run_dir))
    run_dir.mkdir(parents=True)
    lines = []
    for s in range(1, steps + 1):
        load = [1 + rng.random() * (1 + i / 2) * math.exp(-s / 100) for i in range(layers)]
        m = {"step": s, "loss": 1.5 + 4 * math.exp(-s / 20) + rng.gauss(0, 0.05), "aux_loss": 1e-4, "lr": 3e-3,
             "grad_norm": 0.5, "tokens_per_s": 2e4 + rng.gauss(0, 1e3), "step_time_s": 0.1,
             "load_max_over_mean": max(load), "experts_empty": 0}
        if per_layer:
            m["load_max_over_mean_by_layer"] = load
        if mfu:
            m["mfu"] = 0.3 + rng.gauss(0, 0.01)
        if val and s % 50 == 0:
            m["val_loss"] = m["loss"] + 0.1
        lines.append(json.dumps(m))
    text = "\n".join(lines) + "\n"
    if torn:
        text += json.dumps({"step": steps + 1, "loss": 1.0})[:17]
    (run_dir / "metrics.jsonl").write_text(text)
    return run_dir


def run_tool(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), *map(str, args)], capture_output=True, text=True, timeout=120)


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk; fails on anything but a PNG."""
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR", head
    return struct.unpack(">II", head[16:24])


def test_plot_run_overlays_runs(tmp_path):
    """A current run (per-layer load, held-out loss, MFU) and an older CPU run (the scalar load only,
    neither) in one PNG at --out; the torn lines skipped; nothing else written."""
    new = write_run(tmp_path / "fp8", per_layer=True, val=True, mfu=True)
    old = write_run(tmp_path / "bf16", steps=150, per_layer=False, val=False, mfu=False)
    out = tmp_path / "both.png"
    r = run_tool(new, old, "--out", out)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    assert len(lines) == 3 and lines[-1] == f"wrote {out}"
    assert lines[0].startswith("fp8: 200 steps (last 200), last loss ") and lines[0].endswith(" tokens/s")
    assert lines[1].startswith("bf16: 150 steps (last 150), last loss ")
    last = json.loads((new / "metrics.jsonl").read_text().splitlines()[-2])
    assert f"last loss {last['loss']:.4f}" in lines[0]
    w, h = png_size(out)
    assert w >= 800 and h >= 800 and out.stat().st_size > 30_000
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["bf16", "both.png", "fp8", "metrics.jsonl",
                                                           "metrics.jsonl"]


def test_plot_run_default_out(tmp_path):
    """One run without the per-layer key, val_loss or MFU: the PNG lands in the run dir."""
    run = write_run(tmp_path / "tiny-fp8", steps=30, per_layer=False, val=False, mfu=False, torn=False)
    r = run_tool(run)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.splitlines()[-1] == f"wrote {run / 'plot.png'}"
    assert sorted(p.name for p in run.iterdir()) == ["metrics.jsonl", "plot.png"]
    w, h = png_size(run / "plot.png")
    assert w >= 800 and h >= 600 and (run / "plot.png").stat().st_size > 20_000


def test_plot_run_same_names_and_ragged_layers(tmp_path):
    """Two run dirs of one name are told apart by their paths; a step with fewer layers is drawn."""
    a, b = write_run(tmp_path / "a" / "run", steps=20), write_run(tmp_path / "b" / "run", steps=20, layers=2)
    lines = (b / "metrics.jsonl").read_text().splitlines()
    m = json.loads(lines[5])
    m["load_max_over_mean_by_layer"] = m["load_max_over_mean_by_layer"][:1]
    (b / "metrics.jsonl").write_text("\n".join(lines[:5] + [json.dumps(m)] + lines[6:]))
    r = run_tool(a, b, "--out", tmp_path / "p.png")
    assert r.returncode == 0, r.stderr[-2000:]
    assert [line.split(":")[0] for line in r.stdout.splitlines()[:2]] == [str(a), str(b)]
    png_size(tmp_path / "p.png")


@pytest.mark.parametrize("case", ["no_metrics", "empty", "only_torn", "missing_dir", "no_out_folder"])
def test_plot_run_bad_input_is_one_line(tmp_path, case):
    """Exit status 1, one line on stderr naming the run dir or file, no traceback, no PNG (also not
    the first, good run dir's when the second is bad)."""
    good = write_run(tmp_path / "good", steps=10)
    bad = tmp_path / "bad"
    args, named = [good, bad], str(bad)
    if case != "missing_dir":
        bad.mkdir()
    if case == "empty":
        (bad / "metrics.jsonl").write_text("")
    elif case == "only_torn":
        (bad / "metrics.jsonl").write_text('{"step": 1, "lo')
    elif case == "no_out_folder":
        args, named = [good, "--out", tmp_path / "nowhere" / "p.png"], str(tmp_path / "nowhere")
    r = run_tool(*args)
    assert r.returncode == 1
    assert len(r.stderr.strip().splitlines()) == 1 and named in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("plot_run: ")
    assert not list(tmp_path.rglob("*.png"))
    if case == "no_metrics":
        assert "no metrics.jsonl" in r.stderr
