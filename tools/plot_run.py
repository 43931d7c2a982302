"""Training runs at a glance: one PNG of their metrics.jsonl over steps, several runs overlaid.

    python tools/plot_run.py outputs/runs/small-fp8                    # -> outputs/runs/small-fp8/plot.png
    python tools/plot_run.py outputs/runs/small-fp8 outputs/runs/small-bf16 --out fp8-vs-bf16.png

Panels: training loss (each step faint, its EMA(--ema) solid), held-out loss (`val_loss`, on the
steps that evaluated it: train.eval_every), tokens/s (all ranks together), MFU (logged on GPU runs
whose peak is known), and per run the expert load max/mean of each MoE layer as a heatmap (layers x
steps, 1.0 = balanced; `load_max_over_mean_by_layer`), or for runs logged before that key the
largest layer's max/mean as a line (`load_max_over_mean`). Runs are labelled by their run dir's name
and keep one colour across panels. Prints one line per run (steps, last loss, median tokens/s) and
the PNG's path; writes nothing but the PNG.

A line of metrics.jsonl that does not parse (the last one, cut by a kill) is skipped. A run dir
without metrics.jsonl, or with no step in it, is one line on stderr and exit status 1.
"""

import argparse
import json
import math
import statistics
import sys
from pathlib import Path


def fail(msg: str):
    sys.exit(f"plot_run: {msg}")


def read_metrics(run_dir: Path) -> list[dict]:
    """The steps of run_dir/metrics.jsonl, by step (the last line of a step wins); lines that do not
    parse as a JSON object with a step and a loss are skipped. Exits with one line when there is none."""
    path = run_dir / "metrics.jsonl"
    if not run_dir.is_dir():
        fail(f"{run_dir}: no such run dir")
    if not path.is_file():
        fail(f"no metrics.jsonl in {run_dir} (is it a moefp8.train run dir?)")
    by_step = {}
    for line in path.read_text(errors="replace").splitlines():
        try:
            m = json.loads(line)
        except json.JSONDecodeError:  # a line cut by a kill
            continue
        if isinstance(m, dict) and isinstance(m.get("step"), int) and isinstance(m.get("loss"), (int, float)):
            by_step[m["step"]] = m
    if not by_step:
        fail(f"{path} holds no step")
    return [by_step[s] for s in sorted(by_step)]


def ema(xs: list[float], beta: float) -> list[float]:
    """Exponential moving average, beta the weight of the past (0: xs itself), from xs[0]."""
    out, avg = [], None
    for x in xs:
        avg = x if avg is None else beta * avg + (1 - beta) * x
        out.append(avg)
    return out


def series(steps: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the steps that have key."""
    pts = [(s["step"], s[key]) for s in steps if isinstance(s.get(key), (int, float))]
    return [p[0] for p in pts], [p[1] for p in pts]


def layer_loads(steps: list[dict]) -> tuple[list[int], list[list[float]]] | None:
    """(steps, [layer][step] max/mean) from load_max_over_mean_by_layer; None where no step has it.
    A step with fewer layers than the most (or none) is NaN there."""
    rows = [(s["step"], s["load_max_over_mean_by_layer"]) for s in steps
            if isinstance(s.get("load_max_over_mean_by_layer"), list) and s["load_max_over_mean_by_layer"]]
    if not rows:
        return None
    n = max(len(r) for _, r in rows)
    grid = [[float(r[i]) if i < len(r) and isinstance(r[i], (int, float)) else math.nan for _, r in rows]
            for i in range(n)]
    return [s for s, _ in rows], grid


def labels(run_dirs: list[Path]) -> list[str]:
    """Each run dir's name; the path as given where two names are the same."""
    names = [d.resolve().name or str(d) for d in run_dirs]
    return [n if names.count(n) == 1 else str(d) for n, d in zip(names, run_dirs)]


def note(ax, text: str) -> None:
    """A panel with nothing to draw says why (tick_params, not set_xticks: the load panels share
    their x axis with the loss panel)."""
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="0.4")
    ax.tick_params(left=False, labelleft=False, bottom=False, labelbottom=False)


def plot(runs: dict[str, list[dict]], out: Path, beta: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    import numpy as np

    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    color = {name: colors[i % len(colors)] for i, name in enumerate(runs)}
    fig = plt.figure(figsize=(13, 7 + 2.2 * len(runs)), layout="constrained")
    grid = fig.add_gridspec(2 + len(runs), 2, height_ratios=[3, 3] + [2] * len(runs))
    ax_loss, ax_val = fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[0, 1])
    ax_tps, ax_mfu = fig.add_subplot(grid[1, 0]), fig.add_subplot(grid[1, 1])

    tops = []
    for name, steps in runs.items():
        x, y = series(steps, "loss")
        smooth = ema(y, beta)
        ax_loss.plot(x, y, color=color[name], alpha=0.25, lw=0.8)
        ax_loss.plot(x, smooth, color=color[name], lw=1.6, label=name)
        tops.append(max(smooth[len(smooth) // 20:]))  # the first 5% of steps: the initial drop
    bottom = min(min(series(s, "loss")[1]) for s in runs.values())
    if max(tops) > bottom:  # zoom past the first steps' drop from ln(vocab)
        ax_loss.set_ylim(bottom - 0.05 * (max(tops) - bottom), max(tops) + 0.1 * (max(tops) - bottom))
    ax_loss.set_title(f"training loss (faint: each step; solid: EMA {beta:g})")

    have_val = False
    for name, steps in runs.items():
        x, y = series(steps, "val_loss")
        if x:
            have_val = True
            ax_val.plot(x, y, "o-", color=color[name], ms=3, lw=1.2, label=name)
    if have_val:
        ax_val.set_title("held-out loss (val_loss)")
    else:
        note(ax_val, "no held-out loss (train.eval_every=0)")

    for name, steps in runs.items():
        x, y = series(steps, "tokens_per_s")
        if x:
            ax_tps.plot(x, y, color=color[name], lw=0.8, alpha=0.8, label=f"{name}: median {statistics.median(y):,.0f}")
    ax_tps.set_title("tokens/s (all ranks)")
    ax_tps.set_ylim(bottom=0)
    ax_tps.yaxis.set_major_formatter(matplotlib.ticker.StrMethodFormatter("{x:,.0f}"))

    have_mfu = False
    for name, steps in runs.items():
        x, y = series(steps, "mfu")
        if x:
            have_mfu = True
            ax_mfu.plot(x, [100 * v for v in y], color=color[name], lw=0.8, alpha=0.8,
                        label=f"{name}: median {100 * statistics.median(y):.1f}%")
    if have_mfu:
        ax_mfu.set_title("MFU % (vs the GPU's dense peak)")
        ax_mfu.set_ylim(bottom=0)
    else:
        note(ax_mfu, "no MFU (CPU run)")

    loads = {name: layer_loads(steps) for name, steps in runs.items()}
    finite = [v for ld in loads.values() if ld for row in ld[1] for v in row if math.isfinite(v)]
    vmax = max(finite + [1.5])  # one colour scale for every run's heatmap
    for i, (name, steps) in enumerate(runs.items()):
        ax = fig.add_subplot(grid[2 + i, :], sharex=ax_loss)
        if loads[name]:
            x, rows = loads[name]
            x_edges = np.concatenate([[x[0] - 0.5], (np.asarray(x[1:]) + np.asarray(x[:-1])) / 2, [x[-1] + 0.5]])
            mesh = ax.pcolormesh(x_edges, np.arange(len(rows) + 1), np.asarray(rows), vmin=1.0, vmax=vmax,
                                 cmap="magma_r", shading="flat")
            fig.colorbar(mesh, ax=ax, label="max / mean", pad=0.01)
            ax.set_ylabel("MoE layer")
            if len(rows) <= 16:
                ax.set_yticks(np.arange(len(rows)) + 0.5, [str(j) for j in range(len(rows))])
            ax.set_title(f"{name}: expert load max/mean per MoE layer (1 = balanced)", color=color[name])
        else:
            x, y = series(steps, "load_max_over_mean")
            if x:
                ax.plot(x, y, color=color[name], lw=0.8)
                ax.axhline(1.0, color="0.6", lw=0.6, ls="--")
                ax.set_title(f"{name}: expert load max/mean, the largest layer's (no per-layer data in this run)",
                             color=color[name])
            else:
                note(ax, f"{name}: no expert-load metrics")
    ax.set_xlabel("step")

    for ax in (ax_loss, ax_val, ax_tps, ax_mfu):
        if ax.lines:
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle(" vs ".join(runs))
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("run_dirs", type=Path, nargs="+", metavar="RUN_DIR", help="moefp8.train run dirs (train.out_dir)")
    p.add_argument("--out", type=Path, default=None, help="the PNG to write (default: <first RUN_DIR>/plot.png)")
    p.add_argument("--ema", type=float, default=0.9, help="EMA weight of the past for the loss line (0: none)")
    a = p.parse_args()
    if not 0 <= a.ema < 1:
        fail(f"--ema {a.ema}: must be in [0, 1)")
    out = a.out or a.run_dirs[0] / "plot.png"
    runs = {}
    for name, run_dir in zip(labels(a.run_dirs), a.run_dirs):
        runs[name] = read_metrics(run_dir)
    if not out.parent.is_dir():
        fail(f"--out {out}: no folder {out.parent}")
    for name, steps in runs.items():
        tps = series(steps, "tokens_per_s")[1]
        med = f"{statistics.median(tps):,.0f}" if tps else "-"
        print(f"{name}: {len(steps)} steps (last {steps[-1]['step']}), last loss {steps[-1]['loss']:.4f}, "
              f"median {med} tokens/s")
    try:
        plot(runs, out, a.ema)
    except OSError as e:
        fail(f"cannot write {out}: {e.strerror or e}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
