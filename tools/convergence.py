"""FP8 vs BF16 convergence: trains one config twice, `recipe=bf16` and `recipe=fp8`, from the same
seed and data through the real entry point (`python -m moefp8.train`), then writes both loss
curves, the EMA(0.9)-smoothed relative difference (fp8 - bf16) / bf16 and a PNG plot.

DeepSeek-V3's acceptance criterion: the smoothed relative loss error stays below 0.25%; checked
here over the last half of the run. Throughput (median tokens/s after warm-up) of both recipes
is compared too.

    python tools/convergence.py model=small train.steps=2000               # one GPU
    python tools/convergence.py --parallel experiment=small_gpu           # two GPUs, one run each
    python tools/convergence.py --parallel --noise-floor experiment=small_gpu   # + BF16 again (3 GPUs)

--noise-floor trains a third run and reports the same statistic between it and the BF16 run: the
scale the FP8 gap is judged against. --noise-kind rerun (the default): BF16 again with the same seed
and data, so the two differ only by the GPU's nondeterministic kernels (atomics, split reductions),
the smallest perturbation a training run meets; seed: BF16 with the next seed (another init and
data order), the run-to-run spread. --runs adds more of these (bf16_again, fp8_again, bf16_seed+1,
and further same-seed reruns fp8_again2, bf16_again2, ...; and either recipe at another seed,
fp8_seed+K / bf16_seed+K) and --train picks which of the runs this
call trains (the others are read from an earlier call): every FP8 run is then compared with every BF16 run, and each rerun with its own recipe's first run.
With two or more same-seed BF16 runs the FP8 run is also compared with their mean curve (a row of its
own; the pass/fail row stays fp8 against the first BF16 run). --runs bf16_megablocks adds BF16 with
megablocks' dMoE as the routed experts (one GPU per run; recipe.moe_impl=megablocks), compared with
the fp8 and bf16 runs, its tokens/s beside theirs:
    python tools/convergence.py --runs bf16_megablocks experiment=small_gpu train.steps=200

Each pair's largest difference comes with its step and the gradient-norm spikes (a step's norm over
2.5x the median of the 50 before it) either run had in the 30 steps up to it: a spike moves one run's
loss for some steps, in either recipe, and with it the smoothed difference.

Held-out loss: with train.eval_every and data.val_windows among the overrides the runs also log
the loss on fixed held-out windows (the same for every run), and the same comparison is made on
it, point by point over the last half (no smoothing: it is an average over the whole held-out set,
without the per-batch noise of the training loss).

The stdlib corpus is ~10 MB on a typical machine: 2000 steps x 16384 tokens read it three times.
For a run that stays under one epoch point the data at a bigger folder of text, e.g. the
installed packages' sources: data.prepare_from=<site-packages dir> data.path=outputs/data/sitepkgs
data.max_bytes=64000000.
    python tools/convergence.py --out outputs/conv model=tiny train.steps=40   # CPU smoke run

Bigger batches (less per-batch noise in the training loss) through data parallelism: --nproc N runs
each recipe as a torchrun job of N processes; with --parallel the runs share the GPUs, N each. Under
a wall-clock limit (a scheduler's, a lease's) give train.time_limit_s: every run stops with a
checkpoint when it is spent, the tool says which runs are not finished, and the same command
resumes them; the statistics are written once every run has reached train.steps.
    python tools/convergence.py --parallel --nproc 2 experiment=small_gpu_b256 train.time_limit_s=500
                                          # 4 GPUs, 256 x 1024 tokens per step; call again to resume
Runs cut short for good (their machine lost with its checkpoints) are still compared over the steps
they share: --skip-train --upto N (the last half is then N/2..N). Runs may also be trained on
different machines, one at a time (--train bf16 on one, --train fp8 on another, with the finished
bf16 run dir copied over): each run's starts.jsonl (step, date, commit, GPU, world size, host, boot id of
every start) goes into the JSON as `run_starts` and is printed, with a warning when the runs'
GPUs or process counts differ (their tokens/s then do not compare). Runs whose folders are gone with
their machine are read back from the result JSON of an earlier call (--earlier PATH: each run's losses,
held-out losses, gradient norms and tokens/s), so a later call can add runs to them:
    python tools/convergence.py --nproc 2 --noise-floor --runs fp8_again --train fp8_again \
        --earlier bench/results/convergence-NVIDIA-H200-b256-sources.json experiment=small_gpu_b256 ...
With two or more same-seed runs of each recipe, the mean FP8 curve is also compared with the mean BF16 curve.
Seed pairs: same-seed reruns on one machine differ only by the GPUs' nondeterminism, so their scatter
is the error of one seed's FP8-BF16 difference, not of the recipes' (3B, session 46: 4 runs at one
seed, -0.71% +- 0.08%; a pair on another machine read +0.72%). Runs of both recipes at other seeds
(--runs fp8_seed+1,bf16_seed+1,fp8_seed+2,bf16_seed+2) add a row of their own: the difference seed by
seed, its mean over the seeds and that mean's standard error from their scatter. Rows of recipe
means carry both readings of the threshold: `pass` (|FP8 - BF16|) and `pass_no_worse` (FP8 - BF16).

Every argument that is not an option of this tool is a Hydra override given to both runs.
Saves bench/results/convergence-<device>[-<suffix>].json and .png (CPU runs: outputs/), or under --out.
"""

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from moefp8.testing import REPO, print_table, results_path, save_results  # noqa: E402

RECIPES = ("bf16", "fp8")
NOISE = {"rerun": "bf16_again", "seed": "bf16_seed+1"}  # --noise-floor kind -> the third run's name
MEGABLOCKS = "bf16_megablocks"  # BF16 with megablocks' dMoE as the routed experts (recipe.moe_impl=megablocks)
EXTRA = ("bf16_again", "fp8_again", "bf16_seed+1", MEGABLOCKS)  # --runs: a recipe again (same seed), the next seed,
# or megablocks' BF16 MoE on the same seed, data and weights (compared with fp8 and bf16; not in the BF16 means)
RERUN = re.compile(r"(bf16|fp8)_again\d*")  # more reruns of the same seed: fp8_again2, bf16_again3, ...
SEEDED = re.compile(r"(bf16|fp8)_seed\+([1-9]\d*)")  # a recipe at the configured seed + K: fp8_seed+1, bf16_seed+2, ...


def recipe_of(name: str) -> str:
    """The recipe of a run name: "fp8_again2" -> "fp8", "bf16_seed+1" -> "bf16"."""
    return name.split("_")[0]


def seed_offset(name: str) -> int | None:
    """How far a run's seed is from the configured one: "fp8_seed+2" -> 2; "fp8", "bf16_again" -> 0;
    None for megablocks' run (another MoE, not a recipe's draw)."""
    if name == MEGABLOCKS:
        return None
    m = SEEDED.fullmatch(name)
    return int(m.group(2)) if m else 0


def ema(xs: list[float], beta: float = 0.9) -> list[float]:
    out, s = [], None
    for x in xs:
        s = x if s is None else beta * s + (1 - beta) * x
        out.append(s)
    return out


def read_losses(run_dir: Path) -> dict:
    """metrics.jsonl -> steps, losses, tokens/s, the held-out losses ({step: val_loss}) and the last
    step's expert-load stats; a resumed run's later lines win."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise SystemExit(f"convergence: no metrics in {path} (did the training run fail?)")
    by_step = {}
    for line in path.read_text().splitlines():
        m = json.loads(line)
        by_step[m["step"]] = m
    steps = sorted(by_step)
    load = {k: by_step[steps[-1]].get(k) for k in ("load_max_over_mean", "experts_empty")} if steps else {}
    return {"steps": steps, "loss": [by_step[s]["loss"] for s in steps],
            "tokens_per_s": [by_step[s]["tokens_per_s"] for s in steps],
            "grad_norm": [by_step[s].get("grad_norm", float("nan")) for s in steps],
            "val": {s: by_step[s]["val_loss"] for s in steps if "val_loss" in by_step[s]}, "load": load}


def read_earlier(path: Path) -> dict[str, dict]:
    """An earlier call's result JSON -> its runs as `read_losses` gives them (plus their starts), for runs
    whose folders are gone with their machine: per-step training losses and held-out losses, and the
    gradient norms and median tokens/s where the JSON kept them (this tool's JSONs do from 2026-11-23 on).
    Older JSONs kept neither: their gradient-norm spike events and their fp8 / bf16 tokens/s medians
    are taken instead (the other runs' tokens/s are then unknown: NaN)."""
    if not path.is_file():
        raise SystemExit(f"convergence: --earlier {path}: no such file")
    doc = json.loads(path.read_text())
    curves, first = doc["curves"], doc["rows"][0]
    tps_row = next((r for r in doc["rows"] if r["impl"] == "fp8 tokens/s"), {})
    old_tps = {"fp8": tps_row.get("value"), "bf16": tps_row.get("baseline_value")}
    runs = {}
    for name, c in curves.items():
        if not isinstance(c, dict):
            continue  # "steps", "rel_diff": the shared steps and fp8 vs bf16
        steps = c.get("steps", curves["steps"])
        if len(steps) != len(c["loss"]):
            raise SystemExit(f"convergence: --earlier {path}: run {name} has {len(c['loss'])} losses for "
                             f"{len(steps)} steps (a JSON of runs cut to different lengths keeps no step list)")
        n = len(steps)
        run = {"steps": steps, "loss": c["loss"], "val": {int(s): v for s, v in c["val"].items()},
               "grad_norm": c.get("grad_norm", [float("nan")] * n), "tokens_per_s": [float("nan")] * n,
               "tps": c.get("tokens_per_s_median", old_tps.get(name)) or float("nan"),
               "load": first.get("final_expert_load", {}).get(name, {}),
               "starts": doc.get("run_starts", {}).get(name, [])}
        if "grad_norm" not in c:
            run["spikes"] = [tuple(e) for e in first.get("grad_norm_spikes", {}).get(name, [])]
        runs[name] = run
    return runs


def read_starts(run_dir: Path) -> list[dict]:
    """starts.jsonl: one line per start of the run (step, date, commit, device, world, host, boot id)."""
    path = run_dir / "starts.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def where(starts: list[dict]) -> str:
    """A run's starts in one phrase: "NVIDIA H200 x2, commit f2be4e2, 3 start(s) on 2 machine(s)" (machines told
    apart by host name and boot id: a resume on a fresh machine of the same name counts as another)."""
    if not starts:
        return "not recorded"
    kinds = sorted({f"{s['device']} x{s['world']}" for s in starts})
    commits = sorted({s["commit"] for s in starts})
    return (f"{' + '.join(kinds)}, commit {' + '.join(commits)}, {len(starts)} start(s) on "
            f"{len({(s['host'], s.get('boot', '')) for s in starts})} machine(s), "
            f"{starts[0]['date'][:10]}..{starts[-1]['date'][:10]}")


def upto(c: dict, step: int) -> dict:
    """Run curve `c` (read_losses) cut to its steps <= `step`."""
    keep = [i for i, s in enumerate(c["steps"]) if s <= step]
    return {**c, **{k: [c[k][i] for i in keep] for k in ("steps", "loss", "tokens_per_s", "grad_norm")},
            "val": {s: v for s, v in c["val"].items() if s <= step},
            **({"spikes": [e for e in c["spikes"] if e[0] <= step]} if "spikes" in c else {})}


def grad_spikes(c: dict, factor: float = 2.5, window: int = 50, gap: int = 10) -> list[tuple[int, float]]:
    """A run's gradient-norm spikes: steps whose norm exceeds `factor` x the median of the `window`
    steps before it (from step `window` + 1 on), spikes less than `gap` steps apart counted as one
    event; each event as (its first step, its largest ratio). A spike moves the run's loss for some
    steps, and the smoothed difference to any other run with it."""
    events, g = [], c["grad_norm"]
    for i in range(window, len(g)):
        ratio = g[i] / statistics.median(g[i - window:i])
        if ratio > factor:  # False for NaN
            if events and c["steps"][i] - events[-1][2] < gap:
                events[-1][1], events[-1][2] = max(events[-1][1], ratio), c["steps"][i]
            else:
                events.append([c["steps"][i], ratio, c["steps"][i]])
    return [(s, round(r, 1)) for s, r, _ in events]


def spikes_before(step: int, spikes: dict, within: int = 30) -> list[str]:
    """The runs' gradient-norm spike events at most `within` steps before `step` (and at it): "fp8 1359 (2.5x)"."""
    return [f"{name} {s} ({r}x)" for name, ev in spikes.items() for s, r in ev if step - within <= s <= step]


def planned_steps(run_dir: Path) -> int | None:
    """train.steps of the config a run was last started with (its run dir's config.yaml)."""
    path = run_dir / "config.yaml"
    if not path.is_file():
        return None
    from omegaconf import OmegaConf

    return int(OmegaConf.load(path).train.steps)


def steps_per_epoch(overrides: list[str], nproc: int) -> int | None:
    """Optimizer steps per pass over the runs' training windows (their config, nproc data-parallel
    processes); None where the data is not here (runs trained on another machine)."""
    from moefp8.data import Loader
    from moefp8.hydra_config import compose_config

    try:
        cfg = compose_config(overrides)
        t = cfg.train
        return Loader(cfg.data.path, t.micro_batch, t.seq_len, 0, nproc, t.seed,
                      cfg.data.val_windows).steps_per_epoch(t.grad_accum)
    except (OSError, ValueError):
        return None


def run_overrides(name: str, overrides: list[str], fp8_overrides: list[str] = ()) -> list[str]:
    """The overrides of run `name`: "bf16", "fp8", a recipe again with the same seed and data
    ("bf16_again", "fp8_again") or BF16 with the seed after the configured one ("bf16_seed+1":
    another init and data order; "fp8_seed+K", "bf16_seed+K": seed + K), or "bf16_megablocks" (BF16 with
    megablocks' dMoE experts). The FP8
    runs get `fp8_overrides` last (an ablation of the recipe, e.g. recipe.fp8_dense=false)."""
    if name == MEGABLOCKS:
        return [*overrides, "recipe=bf16", "recipe.moe_impl=megablocks"]
    recipe, k = recipe_of(name), seed_offset(name)
    seed = [f"train.seed={next((int(o.split('=', 1)[1]) for o in overrides if o.startswith('train.seed=')), 0) + k}"]
    return [*overrides, f"recipe={recipe}", *(seed if k else ()), *(fp8_overrides if recipe == "fp8" else ())]


def rel_diff(a: dict, b: dict, key: str = "ema") -> tuple[list[int], list[float]]:
    """The steps where both runs have `key` ("ema": the smoothed training loss; "val": the held-out
    loss) and (a - b) / b there."""
    ya, yb = (dict(zip(r["steps"], r["ema"])) if key == "ema" else r["val"] for r in (a, b))
    steps = [s for s in sorted(ya) if s in yb]
    return steps, [ya[s] / yb[s] - 1 for s in steps]


def compare(a: dict, b: dict, threshold: float, epoch: int | None = None) -> dict:
    """Run a against run b: the EMA(0.9) relative training-loss difference over the last half
    (max |.|, mean, share of steps inside the threshold; with `epoch` (steps per pass over the data)
    inside the last half, also max and mean over its steps before the data repeats) and, where both
    logged it, the relative held-out loss difference at each evaluation in the last half (max |.|, mean)."""
    steps, rel = rel_diff(a, b)
    if not steps:
        raise SystemExit("convergence: two runs share no step")
    half = len(rel) // 2
    last = rel[half:]
    at = max(range(len(last)), key=lambda i: abs(last[i]))
    out = {"max_pct": round(100 * abs(last[at]), 4), "max_step": steps[half + at],
           "mean_pct": round(100 * sum(last) / len(last), 4),
           "share_within_threshold": round(sum(abs(r) < threshold for r in last) / len(last), 4)}
    first = [r for s, r in zip(steps[half:], last) if epoch and s <= epoch]
    if first and len(first) < len(last):
        out.update(first_epoch_max_pct=round(100 * max(abs(r) for r in first), 4),
                   first_epoch_mean_pct=round(100 * sum(first) / len(first), 4))
    vs, vr = rel_diff(a, b, "val")
    vr = [r for s, r in zip(vs, vr) if s > steps[-1] / 2]
    if vr:
        out.update(val_max_pct=round(100 * max(abs(r) for r in vr), 4), val_mean_pct=round(100 * sum(vr) / len(vr), 4),
                   val_points=len(vr), val_final={"run": a["val"][vs[-1]], "vs": b["val"][vs[-1]]})
    return out


def launcher(nproc: int) -> list[str]:
    """The command that starts one run: the entry point itself, or torchrun with `nproc` data-parallel
    processes (a free rendezvous port each, so runs can start side by side)."""
    if nproc == 1:
        return [sys.executable, "-m", "moefp8.train"]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            "-m", "moefp8.train"]


def train(runs: dict[str, Path], overrides: list[str], parallel: bool, fp8_overrides: list[str] = (),
          nproc: int = 1) -> None:
    """Runs each recipe through the real entry point (`nproc` data-parallel processes each); with
    `parallel`, all at once, run i on GPUs i*nproc .. i*nproc + nproc - 1 (CUDA_VISIBLE_DEVICES), each
    alone on its GPUs, so tokens/s stay comparable. A run whose folder holds a checkpoint resumes
    from it (train.resume=auto), so a run cut off by a time limit goes on when called again."""
    procs = {}
    for i, (recipe, run_dir) in enumerate(runs.items()):
        cmd = [*launcher(nproc), *run_overrides(recipe, overrides, fp8_overrides), f"train.out_dir={run_dir}"]
        gpus = ",".join(str(g) for g in range(i * nproc, (i + 1) * nproc))
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpus} if parallel else None
        print("convergence:", " ".join(cmd), f"(GPU {gpus})" if parallel else "", flush=True)
        procs[recipe] = subprocess.Popen(cmd, cwd=REPO, env=env)
        if not parallel:
            procs[recipe].wait()
    failed = [r for r, p in procs.items() if p.wait()]
    if failed:
        raise SystemExit(f"convergence: the {', '.join(failed)} run(s) failed (commands above)")


def recipe_means(curves: dict) -> dict:
    """Recipe against recipe on the held-out loss: each same-seed run's mean over the last half (the
    runs of other seeds are left out: see `seed_pairs`), then the FP8 runs' average relative to the BF16 runs',
    with each recipe's spread (max - min over its runs, relative) beside it. With two or more runs
    of each recipe, also the standard error of that difference from the runs' own scatter (`se_pct`:
    sqrt(s_fp8^2 / n_fp8 + s_bf16^2 / n_bf16), relative): a difference within the threshold says
    little unless 2 x se_pct is under it too (`resolves_pct`: the smallest difference these runs can
    tell from zero, 2 x se). {} without held-out losses."""
    last = {}
    for name, c in curves.items():
        steps = [s for s in c["val"] if s > c["steps"][-1] / 2]
        if steps and seed_offset(name) == 0:
            last[name] = sum(c["val"][s] for s in steps) / len(steps)
    group = {r: [v for n, v in last.items() if recipe_of(n) == r] for r in RECIPES}
    if not all(group.values()):
        return {}
    mean = {r: sum(v) / len(v) for r, v in group.items()}
    se = {}
    if all(len(v) > 1 for v in group.values()):
        var = {r: statistics.variance(v) / len(v) for r, v in group.items()}
        se_pct = 100 * math.sqrt(var["fp8"] + var["bf16"]) / mean["bf16"]
        se = {"se_pct": round(se_pct, 4), "resolves_pct": round(2 * se_pct, 4)}
    return {"impl": "fp8 runs vs bf16 runs: mean held-out loss over the last half, relative",
            "value": round(100 * (mean["fp8"] / mean["bf16"] - 1), 4), "unit": "%", **se,
            "runs_per_recipe": {r: len(v) for r, v in group.items()},
            **{f"{r}_spread_pct": round(100 * (max(v) - min(v)) / mean[r], 4) for r, v in group.items()},
            "last_half_mean": {n: round(v, 6) for n, v in last.items()}}


def seed_pairs(curves: dict) -> dict:
    """FP8 against BF16 seed by seed on the held-out loss: at every seed with runs of both recipes, the
    FP8 runs' last-half mean relative to the BF16 runs' (same-seed reruns averaged), then the mean of
    those differences over the seeds with its standard error from their scatter (`se_pct`;
    `resolves_pct` = 2 se). Same-seed reruns on one machine differ only by the GPUs' nondeterminism,
    so `recipe_means`' error is that of one seed; the recipe's perturbation grows through training
    like any other, and the difference it leaves at one seed is one draw of many: the seeds' scatter
    is what "FP8 within X% of BF16" is judged against. {} with fewer than two such seeds."""
    last = {}
    for name, c in curves.items():
        k, steps = seed_offset(name), [s for s in c["val"] if s > c["steps"][-1] / 2]
        if k is not None and steps:
            last.setdefault(k, {}).setdefault(recipe_of(name), []).append(sum(c["val"][s] for s in steps) / len(steps))
    diffs = {k: 100 * (statistics.fmean(g["fp8"]) / statistics.fmean(g["bf16"]) - 1)
             for k, g in sorted(last.items()) if "fp8" in g and "bf16" in g}
    if len(diffs) < 2:
        return {}
    se = statistics.stdev(diffs.values()) / math.sqrt(len(diffs))
    return {"impl": "fp8 vs bf16 seed by seed: mean held-out loss over the last half, relative, averaged over "
            "the seeds", "value": round(statistics.fmean(diffs.values()), 4), "unit": "%", "se_pct": round(se, 4),
            "resolves_pct": round(2 * se, 4), "seeds": len(diffs),
            "per_seed_pct": {f"seed+{k}": round(v, 4) for k, v in diffs.items()}}


def mean_run(curves: dict, names: list[str]) -> dict:
    """Several runs averaged over the steps they all have (the smoothed training loss and the held-out
    loss): the curve that a recipe's same-seed reruns estimate together, to compare a run against."""
    steps = sorted(set.intersection(*(set(curves[n]["steps"]) for n in names)))
    at = [dict(zip(curves[n]["steps"], curves[n]["ema"])) for n in names]
    val = sorted(set.intersection(*(set(curves[n]["val"]) for n in names)))
    return {"steps": steps, "ema": [sum(e[s] for e in at) / len(at) for s in steps],
            "val": {s: sum(curves[n]["val"][s] for n in names) / len(names) for s in val}}


def reference_of(name: str, curves: dict) -> str:
    """The BF16 run a run is plotted against: an FP8 run at another seed against the BF16 run of its
    seed where there is one (another seed draws other weights and data order: against seed 0's BF16 the
    recipe's difference would drown in the seeds' spread); every other run against bf16 (a BF16 run at
    another seed then draws that spread)."""
    k = seed_offset(name)
    return f"bf16_seed+{k}" if recipe_of(name) == "fp8" and k and f"bf16_seed+{k}" in curves else "bf16"


def plot(path: Path, curves: dict, threshold: float) -> None:
    """Top: each run's training loss (EMA). Middle: each run's EMA relative difference to the BF16 run
    of its seed (`reference_of`). Bottom: the same for the held-out loss, where logged. One color per
    run throughout."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    held = any(c["val"] for c in curves.values())
    fig, axes = plt.subplots(3 if held else 2, 1, figsize=(8, 10 if held else 7), sharex=True)
    colors = dict(zip(curves, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    for name, c in curves.items():
        axes[0].plot(c["steps"], c["ema"], color=colors[name], label=name)
        ref = reference_of(name, curves)
        if name == ref:
            continue
        steps, rel = rel_diff(c, curves[ref])
        axes[1].plot(steps, [100 * r for r in rel], color=colors[name], linewidth=1.5 if name == "fp8" else 0.8,
                     label=f"{name} vs {ref}")
        vs, vr = rel_diff(c, curves[ref], "val")
        if held and vs:
            axes[2].plot(vs, [100 * r for r in vr], "o-", color=colors[name], markersize=3, label=f"{name} vs {ref}")
    axes[0].set_yscale("log")
    axes[0].set_ylabel("training loss, EMA(0.9)")
    axes[0].legend()
    axes[1].set_ylabel("training loss EMA:\n(run - its bf16) / its bf16, %")
    if held:
        axes[2].set_ylabel("held-out loss:\n(run - its bf16) / its bf16, %")
    half = curves["bf16"]["steps"][len(curves["bf16"]["steps"]) // 2]
    for ax in axes[1:]:
        lo, hi = ax.get_ylim()
        ax.set_ylim(max(lo, -3), min(hi, 3))  # early-training swings would hide the last half's scale
        for y in (100 * threshold, -100 * threshold):
            ax.axhline(y, color="r", linestyle="--", linewidth=1)
        ax.axvline(half, color="gray", linestyle=":", linewidth=1)
        ax.legend(loc="upper right", fontsize=8)
    axes[-1].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="folder for the runs, the JSON and the PNG")
    p.add_argument("--suffix", default="", help="appended to the JSON's and PNG's names: convergence-<device>-<suffix>.json")
    p.add_argument("--threshold", type=float, default=0.0025, help="acceptance: max |EMA relative difference|")
    p.add_argument("--skip-train", action="store_true", help="only read existing runs and report")
    p.add_argument("--parallel", action="store_true", help="train the runs at once, on --nproc GPUs each")
    p.add_argument("--nproc", type=int, default=1, help="data-parallel processes per run (torchrun); the batch "
                   "per step is train.micro_batch x train.grad_accum x nproc sequences")
    p.add_argument("--noise-floor", action="store_true", help="also train a third, BF16 run and report the same "
                   "smoothed relative difference between the two BF16 runs")
    p.add_argument("--noise-kind", choices=sorted(NOISE), default="rerun", help="the third run: BF16 again with the "
                   "same seed (rerun) or with the next seed (seed)")
    p.add_argument("--runs", default="", help=f"more runs, comma-separated, of {', '.join(EXTRA)}")
    p.add_argument("--train", default="", help="the runs to train in this call, comma-separated (default: all)")
    p.add_argument("--upto", type=int, default=0, help="statistics over steps 1..UPTO only (the last half: UPTO/2.."
                   "UPTO): runs that reached UPTO count as finished (runs cut short, e.g. their machine lost)")
    p.add_argument("--earlier", default=None, help="a result JSON of an earlier call: runs whose folders hold no "
                   "metrics are read from it (their curves; runs trained on a machine since lost)")
    p.add_argument("--fp8-overrides", default="", help="Hydra overrides for the FP8 runs only, space-separated "
                   "(an ablation of the recipe, e.g. 'recipe.fp8_dense=false')")
    args, overrides = p.parse_known_args()
    json_path = Path(args.out) / "convergence.json" if args.out else results_path("convergence")
    if args.suffix:
        json_path = json_path.with_name(f"{json_path.stem}-{args.suffix}.json")
    runs = (Path(args.out) if args.out else REPO / "outputs" / "convergence") / "runs"
    extra = [r for r in args.runs.split(",") if r]
    if args.noise_floor:
        extra.insert(0, NOISE[args.noise_kind])
    bad = [r for r in extra if r not in EXTRA and not RERUN.fullmatch(r) and not SEEDED.fullmatch(r)]
    if bad:
        raise SystemExit(f"convergence: --runs {','.join(bad)}: expected names of {', '.join(EXTRA)} "
                         "(or more reruns: bf16_again2, fp8_again2, ...; or other seeds: fp8_seed+1, bf16_seed+2, ...)")
    names = list(dict.fromkeys([*RECIPES, *extra]))
    to_train = [] if args.skip_train else [r for r in args.train.split(",") if r] or names
    if set(to_train) - set(names):
        raise SystemExit(f"convergence: --train {args.train}: not among the runs {', '.join(names)}")
    run_dirs = {name: (runs / name).resolve() for name in names}
    if args.nproc < 1:
        raise SystemExit(f"convergence: --nproc {args.nproc}: expected at least 1 process per run")
    if to_train and args.parallel:
        import torch

        need = len(to_train) * args.nproc
        if torch.cuda.device_count() < need:
            raise SystemExit(f"convergence: --parallel needs {need} GPUs ({len(to_train)} runs x --nproc "
                             f"{args.nproc}), {torch.cuda.device_count()} visible")
    if to_train:
        if args.parallel:  # prepare the data once here: the runs would race to write the same shards
            from moefp8.data import ensure
            from moefp8.hydra_config import compose_config

            d = compose_config(overrides).data
            ensure(d.path, d.prepare_from, d.glob, d.max_bytes, tokenizer=d.tokenizer, check=d.verify)
        train({n: run_dirs[n] for n in to_train}, overrides, args.parallel, args.fp8_overrides.split(), args.nproc)
    earlier = read_earlier(Path(args.earlier)) if args.earlier else {}
    from_earlier = [n for n in names if n in earlier and n not in to_train
                    and not (run_dirs[n] / "metrics.jsonl").is_file()]
    curves = {}
    for name, run_dir in run_dirs.items():
        c = earlier[name] if name in from_earlier else read_losses(run_dir)
        curves[name] = c = upto(c, args.upto) if args.upto else c
        c["ema"] = ema(c["loss"])
    if from_earlier:
        print(f"convergence: {', '.join(from_earlier)} read from {args.earlier}")
    short = [f"{n} at step {c['steps'][-1] if c['steps'] else 0} of {want}" for n, c in curves.items()
             if (want := args.upto or (None if n in from_earlier else planned_steps(run_dirs[n])))
             and (not c["steps"] or c["steps"][-1] < want)]
    if short:  # e.g. stopped by train.time_limit_s: no statistics over part of a run
        raise SystemExit(f"convergence: runs not finished: {', '.join(short)}; "
                         + ("--upto asks for more steps than they have" if args.upto else "the same command resumes them"))
    # every FP8 run against every BF16 run, and each rerun against its recipe's first run
    pairs = [(a, b) for a in names if recipe_of(a) == "fp8" for b in names if recipe_of(b) == "bf16"]
    pairs += [(a, recipe_of(a)) for a in extra if (a, recipe_of(a)) not in pairs]
    epoch = steps_per_epoch(overrides, args.nproc)
    stats = {pair: compare(curves[pair[0]], curves[pair[1]], args.threshold, epoch) for pair in pairs}
    spikes = {name: c["spikes"] if "spikes" in c else grad_spikes(c) for name, c in curves.items()}
    for (a, b), st in stats.items():  # was the largest difference a spike in either run?
        st["spikes_before_max"] = spikes_before(st["max_step"], {a: spikes[a], b: spikes[b]})
    main_pair, noise_name = stats["fp8", "bf16"], NOISE[args.noise_kind] if args.noise_floor else None
    noise = stats[noise_name, "bf16"] if noise_name else None
    tps = {r: c["tps"] if "tps" in c else statistics.median(c["tokens_per_s"][min(5, len(c["tokens_per_s"]) - 1):])
           for r, c in curves.items()}  # median after warm-up
    worst = main_pair["max_pct"] / 100
    case = f"{' '.join(overrides) or 'defaults'}, {curves['bf16']['steps'][-1]} steps" + (
        f" (--upto {args.upto}: runs cut there)" if args.upto else "") + (
        f", fp8 runs with {args.fp8_overrides}" if args.fp8_overrides else "")
    rows = [
        {"case": case, "impl": "fp8 vs bf16: max |EMA rel. loss diff|, last half", "value": main_pair["max_pct"],
         "unit": "%", "baseline": "DeepSeek-V3 acceptance", "baseline_value": 100 * args.threshold,
         "ratio": round(args.threshold / worst, 3) if worst else None, "pass": worst < args.threshold,
         "mean_rel_diff_last_half_pct": main_pair["mean_pct"],
         "share_of_last_half_within_threshold": main_pair["share_within_threshold"],
         "max_step": main_pair["max_step"], "grad_norm_spikes_before_max": main_pair["spikes_before_max"],
         "grad_norm_spikes": spikes,
         "data_steps_per_epoch": epoch,
         **{k: main_pair[k] for k in ("first_epoch_max_pct", "first_epoch_mean_pct") if k in main_pair},
         "final_ema_loss": {r: round(c["ema"][-1], 5) for r, c in curves.items()},
         "final_expert_load": {r: c["load"] for r, c in curves.items()},
         "noise_floor": noise_name, "noise_floor_pct": noise["max_pct"] if noise else None,
         "noise_floor_mean_pct": noise["mean_pct"] if noise else None,
         "noise_floor_share_within_threshold": noise["share_within_threshold"] if noise else None,
         **({f"fp8_vs_{noise_name}": {k: stats["fp8", noise_name][k] for k in
                                      ("max_pct", "mean_pct", "share_within_threshold")}} if noise else {})},
    ]
    if "val_max_pct" in main_pair:
        v = main_pair["val_max_pct"] / 100
        rows.append({"case": case, "impl": "fp8 vs bf16: max |held-out rel. loss diff|, last half",
                     "value": main_pair["val_max_pct"], "unit": "%", "baseline": "DeepSeek-V3 acceptance",
                     "baseline_value": 100 * args.threshold, "ratio": round(args.threshold / v, 3) if v else None,
                     "pass": v < args.threshold, "mean_rel_diff_last_half_pct": main_pair["val_mean_pct"],
                     "points": main_pair["val_points"], "final": main_pair["val_final"]})
    bf16_runs = [n for n in names if recipe_of(n) == "bf16" and seed_offset(n) == 0]  # same seed as fp8
    fp8_runs = [n for n in names if recipe_of(n) == "fp8" and seed_offset(n) == 0]
    vs_means = {}  # the BF16 reference as the mean of its same-seed reruns (the JSON's first row: the first BF16 run)
    if len(bf16_runs) > 1:
        vs_means["fp8"] = compare(curves["fp8"], mean_run(curves, bf16_runs), args.threshold, epoch)
    if len(bf16_runs) > 1 and len(fp8_runs) > 1:  # and FP8 as the mean of its own: recipe against recipe
        vs_means[f"the mean of {len(fp8_runs)} fp8 runs"] = compare(
            mean_run(curves, fp8_runs), mean_run(curves, bf16_runs), args.threshold, epoch)
    for what, vs_mean in vs_means.items():
        vs_mean["pass"] = vs_mean["max_pct"] / 100 < args.threshold
        rows.append({"case": case, "impl": f"{what} vs the mean of {len(bf16_runs)} bf16 runs: max |EMA rel. loss "
                     "diff|, last half", "value": vs_mean["max_pct"], "unit": "%", "baseline": "DeepSeek-V3 acceptance",
                     "baseline_value": 100 * args.threshold, "pass": vs_mean["pass"], "bf16_runs": bf16_runs,
                     **({"fp8_runs": fp8_runs} if what != "fp8" else {}),
                     **{k: vs_mean[k] for k in ("max_step", "mean_pct", "share_within_threshold", "val_max_pct",
                                                "val_mean_pct") if k in vs_mean}})
    by_recipe, by_seed = recipe_means(curves), seed_pairs(curves)
    for row in (by_recipe, by_seed):  # pass: |FP8 - BF16| within the threshold; pass_no_worse: FP8 - BF16 within it
        if row:
            rows.append({"case": case, **row, "baseline": "DeepSeek-V3 acceptance",
                         "baseline_value": 100 * args.threshold, "pass": abs(row["value"]) / 100 < args.threshold,
                         "pass_no_worse": row["value"] / 100 < args.threshold})
    rows.append({"case": case, "impl": "fp8 tokens/s", "value": round(tps["fp8"], 1), "unit": "tokens/s",
                 "baseline": "bf16 tokens/s (same config)", "baseline_value": round(tps["bf16"], 1),
                 "ratio": round(tps["fp8"] / tps["bf16"], 3)})
    if MEGABLOCKS in tps:
        rows.append({"case": case, "impl": f"{MEGABLOCKS} tokens/s", "value": round(tps[MEGABLOCKS], 1),
                     "unit": "tokens/s", "baseline": "bf16 tokens/s (same config)", "baseline_value": round(tps["bf16"], 1),
                     "ratio": round(tps[MEGABLOCKS] / tps["bf16"], 3)})
    starts = {name: curves[name]["starts"] if name in from_earlier else read_starts(run_dir)
              for name, run_dir in run_dirs.items()}
    shared, rel = rel_diff(curves["fp8"], curves["bf16"])
    png = json_path.with_suffix(".png")
    json_path.parent.mkdir(parents=True, exist_ok=True)
    plot(png, curves, args.threshold)
    save_results("convergence", rows, {"what": "acceptance threshold on the smoothed relative loss difference",
                                       "value": 100 * args.threshold, "unit": "%"}, path=json_path,
                 plot=png.name, run_starts=starts,
                 pairs=[{"run": a, "vs": b, **st} for (a, b), st in stats.items()],
                 **({"earlier": {"path": args.earlier, "runs": from_earlier}} if from_earlier else {}),
                 curves={"steps": shared, "rel_diff": rel,
                         **{r: {"steps": c["steps"], "loss": c["loss"], "ema": c["ema"],
                                "val": {str(k): v for k, v in c["val"].items()},
                                **({} if "spikes" in c else {"grad_norm": c["grad_norm"]}),
                                "tokens_per_s_median": None if math.isnan(tps[r]) else tps[r]} for r, c in curves.items()}})
    print_table([{"run": a, "vs": b, "EMA train max %": st["max_pct"], "at step": st["max_step"],
                  "grad-norm spike <= 30 steps before": ", ".join(st["spikes_before_max"]) or "-",
                  "EMA train mean %": st["mean_pct"], "inside": st["share_within_threshold"],
                  "held-out max %": st.get("val_max_pct", "-"), "held-out mean %": st.get("val_mean_pct", "-")}
                 for (a, b), st in stats.items()],
                ["run", "vs", "EMA train max %", "at step", "grad-norm spike <= 30 steps before", "EMA train mean %",
                 "inside", "held-out max %", "held-out mean %"])
    print("grad-norm spikes (> 2.5x the median of the 50 steps before; step, ratio): "
          + "; ".join(f"{n} {', '.join(f'{s} ({r}x)' for s, r in ev) or 'none'}" for n, ev in spikes.items()))
    if "first_epoch_max_pct" in main_pair:
        print(f"the data repeats from step {epoch + 1} (an epoch is {epoch} steps): over the last half's steps "
              f"before it, max |EMA rel. loss diff| {main_pair['first_epoch_max_pct']:.3f}%, mean "
              f"{main_pair['first_epoch_mean_pct']:+.3f}%")
    for name, st in starts.items():  # runs trained in separate calls or sessions may differ here
        print(f"{name} trained on {where(st)}")
    if len({tuple(sorted({(s['device'], s['world']) for s in st})) for st in starts.values()}) > 1:
        print("the runs trained on different GPUs or numbers of processes: their tokens/s do not compare")
    verdict = "PASS" if worst < args.threshold else "FAIL"
    print(f"max |EMA rel. loss diff| over the last half: {100 * worst:.3f}% (threshold {100 * args.threshold}%): "
          f"{verdict}; tokens/s fp8 {tps['fp8']:,.0f} vs bf16 {tps['bf16']:,.0f} ({tps['fp8'] / tps['bf16']:.2f}x)")
    if "val_max_pct" in main_pair:
        print(f"max |held-out rel. loss diff| over the last half: {main_pair['val_max_pct']:.3f}%: "
              f"{'PASS' if main_pair['val_max_pct'] / 100 < args.threshold else 'FAIL'}")
    if by_recipe:
        print(f"held-out loss, last-half mean, {by_recipe['runs_per_recipe']['fp8']} fp8 runs vs "
              f"{by_recipe['runs_per_recipe']['bf16']} bf16 runs: {by_recipe['value']:+.3f}% (the bf16 runs span "
              f"{by_recipe['bf16_spread_pct']:.3f}%, the fp8 runs {by_recipe['fp8_spread_pct']:.3f}%)"
              + (f"; standard error {by_recipe['se_pct']:.3f}%: these runs tell apart differences of "
                 f"{by_recipe['resolves_pct']:.3f}% or more" if "se_pct" in by_recipe else ""))
    if by_seed:
        print(f"held-out loss, last-half mean, fp8 vs bf16 seed by seed: "
              + ", ".join(f"{k} {v:+.3f}%" for k, v in by_seed["per_seed_pct"].items())
              + f"; over {by_seed['seeds']} seeds {by_seed['value']:+.3f}%, standard error {by_seed['se_pct']:.3f}%: "
              f"they tell apart differences of {by_seed['resolves_pct']:.3f}% or more")
    for what, vs_mean in vs_means.items():
        print(f"{what} vs the mean of the bf16 runs ({', '.join(bf16_runs)}): max {vs_mean['max_pct']:.3f}% at step "
              f"{vs_mean['max_step']}, mean {vs_mean['mean_pct']:+.3f}%, {vs_mean['share_within_threshold']:.1%} of "
              f"the last half inside: {'PASS' if vs_mean['pass'] else 'FAIL'}")
    if noise is not None:
        vs = stats["fp8", noise_name]
        print(f"mean EMA rel. loss diff over the last half: fp8 vs bf16 {main_pair['mean_pct']:+.3f}%, "
              f"{noise_name} vs bf16 {noise['mean_pct']:+.3f}%")
        print(f"noise floor ({noise_name} vs bf16), max of the same statistic: {noise['max_pct']:.3f}%")
        print(f"fp8 vs {noise_name}: max {vs['max_pct']:.3f}%, mean {vs['mean_pct']:+.3f}%, "
              f"{vs['share_within_threshold']:.1%} of the last half inside")
    print(f"saved {json_path} and {png}")


if __name__ == "__main__":
    main()
