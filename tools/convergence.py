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
data order), the run-to-run spread.

The stdlib corpus is ~10 MB on a typical machine: 2000 steps x 16384 tokens read it three times.
For a run that stays under one epoch point the data at a bigger folder of text, e.g. the
installed packages' sources: data.prepare_from=<site-packages dir> data.path=outputs/data/sitepkgs
data.max_bytes=64000000.
    python tools/convergence.py --out outputs/conv model=tiny train.steps=40   # CPU smoke run

Every argument that is not an option of this tool is a Hydra override given to both runs.
Saves bench/results/convergence-<device>.json and .png (CPU runs: outputs/), or under --out.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from moefp8.testing import REPO, results_path, save_results  # noqa: E402

RECIPES = ("bf16", "fp8")
NOISE = {"rerun": "bf16_again", "seed": "bf16_seed+1"}  # --noise-floor kind -> the third run's name


def ema(xs: list[float], beta: float = 0.9) -> list[float]:
    out, s = [], None
    for x in xs:
        s = x if s is None else beta * s + (1 - beta) * x
        out.append(s)
    return out


def read_losses(run_dir: Path) -> tuple[list[int], list[float], list[float], dict]:
    """metrics.jsonl -> (steps, losses, tokens/s, the last step's expert-load stats); a resumed
    run's later lines win."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise SystemExit(f"convergence: no metrics in {path} (did the training run fail?)")
    by_step = {}
    for line in path.read_text().splitlines():
        m = json.loads(line)
        by_step[m["step"]] = m
    steps = sorted(by_step)
    load = {k: by_step[steps[-1]].get(k) for k in ("load_max_over_mean", "experts_empty")} if steps else {}
    return steps, [by_step[s]["loss"] for s in steps], [by_step[s]["tokens_per_s"] for s in steps], load


def run_overrides(name: str, overrides: list[str]) -> list[str]:
    """The overrides of run `name`: "bf16", "fp8", or a noise-floor run: "bf16_again" (BF16, same
    seed) or "bf16_seed+1" (BF16 with the seed after the configured one: another init and data order)."""
    if name == NOISE["seed"]:
        seed = next((int(o.split("=", 1)[1]) for o in overrides if o.startswith("train.seed=")), 0)
        return [*overrides, "recipe=bf16", f"train.seed={seed + 1}"]
    if name == NOISE["rerun"]:
        return [*overrides, "recipe=bf16"]
    return [*overrides, f"recipe={name}"]


def train(runs: dict[str, Path], overrides: list[str], parallel: bool) -> None:
    """Runs each recipe through the real entry point; with `parallel`, all at once, run i on GPU i
    (CUDA_VISIBLE_DEVICES), each alone on its GPU, so tokens/s stay comparable."""
    procs = {}
    for i, (recipe, run_dir) in enumerate(runs.items()):
        cmd = [sys.executable, "-m", "moefp8.train", *run_overrides(recipe, overrides), f"train.out_dir={run_dir}"]
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(i)} if parallel else None
        print("convergence:", " ".join(cmd), f"(GPU {i})" if parallel else "", flush=True)
        procs[recipe] = subprocess.Popen(cmd, cwd=REPO, env=env)
        if not parallel:
            procs[recipe].wait()
    failed = [r for r, p in procs.items() if p.wait()]
    if failed:
        raise SystemExit(f"convergence: the {', '.join(failed)} run(s) failed (commands above)")


def plot(path: Path, curves: dict, rel: list[float], steps: list[int], threshold: float,
         noise: tuple[str, list[int], list[float]] | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    for recipe, c in curves.items():
        (line,) = a.plot(c["steps"], c["ema"], label=f"{recipe} (EMA 0.9)")
        a.plot(c["steps"], c["loss"], color=line.get_color(), alpha=0.25)
    a.set_ylabel("training loss")
    a.legend()
    if noise:  # the noise-floor run against BF16, behind the FP8 curve
        b.plot(noise[1], [100 * r for r in noise[2]], color="gray", alpha=0.6, label=f"{noise[0]} vs bf16")
    b.plot(steps, [100 * r for r in rel], color="k", label="fp8 vs bf16")
    b.legend(loc="lower right")
    for y in (100 * threshold, -100 * threshold):
        b.axhline(y, color="r", linestyle="--", linewidth=1)
    b.axvline(steps[len(steps) // 2], color="gray", linestyle=":", linewidth=1)
    b.set_ylabel("(run - bf16) / bf16, EMA, %")
    b.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="folder for the runs, the JSON and the PNG")
    p.add_argument("--threshold", type=float, default=0.0025, help="acceptance: max |EMA relative difference|")
    p.add_argument("--skip-train", action="store_true", help="only read existing runs and report")
    p.add_argument("--parallel", action="store_true", help="run all at once, one GPU each (needs 2 GPUs, 3 with "
                   "--noise-floor)")
    p.add_argument("--noise-floor", action="store_true", help="also train a third, BF16 run and report the same "
                   "smoothed relative difference between the two BF16 runs")
    p.add_argument("--noise-kind", choices=sorted(NOISE), default="rerun", help="the third run: BF16 again with the "
                   "same seed (rerun) or with the next seed (seed)")
    args, overrides = p.parse_known_args()
    json_path = Path(args.out) / "convergence.json" if args.out else results_path("convergence")
    runs = (Path(args.out) if args.out else REPO / "outputs" / "convergence") / "runs"
    noise_name = NOISE[args.noise_kind] if args.noise_floor else None
    names = RECIPES + ((noise_name,) if noise_name else ())
    run_dirs = {name: (runs / name).resolve() for name in names}
    if args.parallel:
        import torch

        if torch.cuda.device_count() < len(names):
            raise SystemExit(f"convergence: --parallel needs {len(names)} GPUs, {torch.cuda.device_count()} visible")
    if not args.skip_train:
        if args.parallel:  # prepare the data once here: the runs would race to write the same shards
            from rich.console import Console

            from moefp8.hydra_config import compose_config
            from moefp8.train import ensure_data

            ensure_data(compose_config(overrides), Console())
        train(run_dirs, overrides, args.parallel)
    curves = {}
    for recipe, run_dir in run_dirs.items():
        steps, loss, tps, load = read_losses(run_dir)
        curves[recipe] = {"steps": steps, "loss": loss, "ema": ema(loss), "tokens_per_s": tps, "load": load}
    steps = [s for s in curves["bf16"]["steps"] if s in set(curves["fp8"]["steps"])]
    if not steps:
        raise SystemExit("convergence: the two runs share no step")
    e16 = dict(zip(curves["bf16"]["steps"], curves["bf16"]["ema"]))
    e8 = dict(zip(curves["fp8"]["steps"], curves["fp8"]["ema"]))
    rel = [(e8[s] - e16[s]) / e16[s] for s in steps]
    last = rel[len(rel) // 2:]
    worst = max(abs(r) for r in last)
    noise = noise_mean = noise_curve = None

    def within(rs: list[float]) -> float:  # share of the last half's steps inside the threshold
        return round(sum(abs(r) < args.threshold for r in rs) / len(rs), 4)

    if noise_name:  # the same statistic between the two BF16 runs
        en = dict(zip(curves[noise_name]["steps"], curves[noise_name]["ema"]))
        both = [s for s in steps if s in en]
        noise_curve = (noise_name, both, [(en[s] - e16[s]) / e16[s] for s in both])
        noise_last = noise_curve[2][len(both) // 2:]
        noise, noise_mean = max(abs(r) for r in noise_last), sum(noise_last) / len(noise_last)
        # FP8 against the other BF16 run: whether FP8 sits inside BF16's own run-to-run spread
        vs_noise = [(e8[s] - en[s]) / en[s] for s in both][len(both) // 2:]
    tps = {r: statistics.median(c["tokens_per_s"][min(5, len(c["tokens_per_s"]) - 1):]) for r, c in curves.items()}
    case = f"{' '.join(overrides) or 'defaults'}, {steps[-1]} steps"
    rows = [
        {"case": case, "impl": "fp8 vs bf16: max |EMA rel. loss diff|, last half", "value": round(100 * worst, 4),
         "unit": "%", "baseline": "DeepSeek-V3 acceptance", "baseline_value": 100 * args.threshold,
         "ratio": round(args.threshold / worst, 3) if worst else None, "pass": worst < args.threshold,
         "mean_rel_diff_last_half_pct": round(100 * sum(last) / len(last), 4),
         "share_of_last_half_within_threshold": within(last),
         "final_ema_loss": {r: round(c["ema"][-1], 5) for r, c in curves.items()},
         "final_expert_load": {r: c["load"] for r, c in curves.items()},
         "noise_floor": noise_name, "noise_floor_pct": round(100 * noise, 4) if noise is not None else None,
         "noise_floor_mean_pct": round(100 * noise_mean, 4) if noise is not None else None,
         "noise_floor_share_within_threshold": within(noise_last) if noise is not None else None,
         **({f"fp8_vs_{noise_name}": {"max_pct": round(100 * max(abs(r) for r in vs_noise), 4),
                                      "mean_pct": round(100 * sum(vs_noise) / len(vs_noise), 4),
                                      "share_within_threshold": within(vs_noise)}} if noise is not None else {})},
        {"case": case, "impl": "fp8 tokens/s", "value": round(tps["fp8"], 1), "unit": "tokens/s",
         "baseline": "bf16 tokens/s (same config)", "baseline_value": round(tps["bf16"], 1),
         "ratio": round(tps["fp8"] / tps["bf16"], 3)},
    ]
    png = json_path.with_suffix(".png")
    json_path.parent.mkdir(parents=True, exist_ok=True)
    plot(png, curves, rel, steps, args.threshold, noise_curve)
    save_results("convergence", rows, {"what": "acceptance threshold on the smoothed relative loss difference",
                                       "value": 100 * args.threshold, "unit": "%"}, path=json_path,
                 plot=png.name, curves={"steps": steps, "rel_diff": rel,
                                        **{r: {"loss": c["loss"], "ema": c["ema"]} for r, c in curves.items()}})
    verdict = "PASS" if worst < args.threshold else "FAIL"
    print(f"max |EMA rel. loss diff| over the last half: {100 * worst:.3f}% (threshold {100 * args.threshold}%): "
          f"{verdict}; tokens/s fp8 {tps['fp8']:,.0f} vs bf16 {tps['bf16']:,.0f} ({tps['fp8'] / tps['bf16']:.2f}x)")
    if noise is not None:
        print(f"mean EMA rel. loss diff over the last half: fp8 vs bf16 {100 * sum(last) / len(last):+.3f}%, "
              f"{noise_name} vs bf16 {100 * noise_mean:+.3f}%")
        print(f"noise floor ({noise_name} vs bf16), max of the same statistic: {100 * noise:.3f}%")
        print(f"fp8 vs {noise_name}: max {100 * max(abs(r) for r in vs_noise):.3f}%, mean "
              f"{100 * sum(vs_noise) / len(vs_noise):+.3f}%, {within(vs_noise):.0%} of the last half inside")
    print(f"saved {json_path} and {png}")


if __name__ == "__main__":
    main()
