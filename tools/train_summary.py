"""A training run's figures as a results JSON (docs/design.md §6), from its run directory.

    torchrun --nproc_per_node 8 -m moefp8.train experiment=small_gpu dispatch=all_to_all dispatch.ep_size=8 \
        train.steps=200 train.out_dir=outputs/ep8
    python tools/train_summary.py outputs/ep8 --ranks 8 --train-command "<the command above>"
        # -> bench/results/train-<device>-ep8.json

Reads the run's metrics.jsonl (rank 0's, one line per step) and config.yaml. Figures: steps,
first / last loss, last held-out loss, median tokens/s (all ranks together) and step time over
the steps after --skip (compilation and autotuning happen in the first ones), median MFU, the
largest expert-load max/mean, peak memory. Speed of light: the dense BF16 peak of all the ranks'
GPUs, the one MFU is reported against (moefp8.launch.peak_flops).
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from moefp8.testing import print_table, results_path, save_results  # noqa: E402


def summarize(run_dir: Path, skip: int) -> tuple[list[dict], dict]:
    """-> (rows, the run's config fields of interest)."""
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise SystemExit(f"train_summary: no metrics.jsonl in {run_dir} (is it a moefp8.train run directory?)")
    steps = []
    for line in metrics.read_text().splitlines():
        try:
            steps.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by a kill
            continue
    if not steps:
        raise SystemExit(f"train_summary: {metrics} holds no step")
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(run_dir / "config.yaml")
    timed = steps[skip:] or steps
    med = lambda k: statistics.median(s[k] for s in timed) if all(k in s for s in timed) else None  # noqa: E731
    vals = [s for s in steps if "val_loss" in s]
    rows = [
        {"what": "steps", "value": steps[-1]["step"]},
        {"what": "loss, first step", "value": round(steps[0]["loss"], 4)},
        {"what": "loss, last step", "value": round(steps[-1]["loss"], 4)},
        {"what": "held-out loss, last evaluation", "value": round(vals[-1]["val_loss"], 4) if vals else None,
         "step": vals[-1]["step"] if vals else None},
        {"what": f"tokens/s, all ranks (median of steps {timed[0]['step']}-{timed[-1]['step']})",
         "value": round(med("tokens_per_s"), 1)},
        {"what": "step time s (median)", "value": round(med("step_time_s"), 4)},
        {"what": "MFU vs dense BF16 peak (median)", "value": round(med("mfu"), 4) if med("mfu") is not None else None},
        {"what": "expert load max/mean, largest of the run", "value": round(max(s["load_max_over_mean"] for s in steps), 3)},
    ]
    mem = [k for k in steps[-1] if k.startswith("mem") or k.endswith("_mb")]
    for k in mem:
        rows.append({"what": f"{k} (rank 0, last step)", "value": steps[-1][k]})
    fields = {"model": OmegaConf.to_container(cfg.model), "recipe": OmegaConf.select(cfg, "recipe.recipe"),
              "dispatch": OmegaConf.to_container(cfg.dispatch), "micro_batch": cfg.train.micro_batch,
              "seq_len": cfg.train.seq_len, "grad_accum": cfg.train.grad_accum}
    return rows, fields


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("run_dir", type=Path)
    p.add_argument("--ranks", type=int, default=1, help="processes the run had (names the file -ep<N> when > 1 with EP)")
    p.add_argument("--train-command", default="", help="the training command, kept in the JSON")
    p.add_argument("--skip", type=int, default=10, help="first steps left out of the medians")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args()
    rows, fields = summarize(a.run_dir, a.skip)
    ep = fields["dispatch"].get("ep_size", 1)
    from moefp8.launch import PEAK_BF16_TFLOPS
    from moefp8.testing import device_name

    per_gpu = next((tf for key, tf in PEAK_BF16_TFLOPS.items() if key in device_name()), None)
    peak = {"what": f"dense BF16 peak, {a.ranks} GPUs (the MFU's)", "unit": "TFLOP/s",
            "value": per_gpu * a.ranks if per_gpu else None}
    path = a.out or results_path("train", ep=ep if ep > 1 else None)
    print_table(rows, ["what", "value"])
    save_results("train_summary", rows, peak, path=path, ranks=a.ranks, run_dir=str(a.run_dir),
                 train_command=a.train_command, **fields)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
