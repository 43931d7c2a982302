"""Soak: one training run for N minutes through the real entry point (`python -m moefp8.train`)
with periodic checkpoints, sampling memory and throughput, then checking that both stay flat.

    python tools/soak.py                                  # 30 min, tiny model on CPU (small on a GPU)
    python tools/soak.py --minutes 60 model=small         # any Hydra override goes to the run
    taskset -c 0 python tools/soak.py --threads 1         # one core, leaving the rest to other work

Every `--sample-s` seconds it records the run's resident memory (/proc/<pid>/status VmRSS, and
the CUDA allocator's allocated/reserved MB from metrics.jsonl on GPUs), the steps done, and the
tokens/s since the last sample per wall-clock second and per CPU-second the run consumed
(/proc/<pid>/stat utime + stime). The `--minutes` count from the run's first logged step (start-up,
imports and data preparation, is not soak time; it may take up to `--start-timeout-s`). At the end
(SIGTERM after `--minutes`; a soak run is meant to be cut) it drops a warm-up (the first `--warmup-frac` of the samples) and compares the
last third of the rest with the first third (medians):

  * memory: last <= first * (1 + --mem-tol) + --mem-slack-mb. A leak of L bytes per step
    shows up as L * steps; the tiny model on CPU makes ~2000 steps in 30 min at ~530 MB RSS, so
    the defaults (3% + 8 MB, ~24 MB) catch anything from ~12 KB per step up (one step's
    activations are ~0.5 MB there);
  * throughput: last >= first * (1 - --tps-tol), checkpoint time included. 10%: a VM's CPU speed
    drifts by a few percent over half an hour; a slowdown from growing state (a list scanned per
    step, a fragmenting allocator) grows without bound and crosses it. Which figure decides
    (--tps-metric): on CPU tokens per CPU-second of the run ("cpu"), which other processes
    sharing the cores barely move (they take wall time, not the run's CPU time); on GPUs tokens
    per wall-clock second ("wall"; the host's CPU time there is mostly spinning on the device).
    The other figures (and the median per-step tokens/s from metrics.jsonl) are reported too.

The run keeps its two newest checkpoints (train.keep_last=2, as a cluster job would). Writes
bench/results/soak-<device>.json (rows: the two comparisons, docs/design.md §6; the
samples) and the log (the run's output and the samples) beside it, or --json/--log. Exit status
0: flat; 1: memory or throughput was not flat; 2: no verdict (the run failed, or too few samples).
"""

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from moefp8.testing import REPO, device_name, git_commit, save_results  # noqa: E402


def cpu_s(pid: int) -> float | None:
    """CPU-seconds (user + system, all threads) the process has used so far."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    f = stat[stat.rfind(")") + 2:].split()  # after "pid (comm) ": field 3 is f[0]
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


class Metrics:
    """Incremental reader of the run's metrics.jsonl (complete lines only)."""

    def __init__(self, path: Path):
        self.path, self.offset, self.rows = path, 0, []

    def poll(self) -> list[dict]:
        try:
            with open(self.path) as f:
                f.seek(self.offset)
                chunk = f.read()
        except FileNotFoundError:
            return []
        done = chunk[: chunk.rfind("\n") + 1]
        self.offset += len(done.encode())
        new = [json.loads(line) for line in done.splitlines() if line.strip()]
        self.rows += new
        return new


def thirds(xs: list[float]) -> tuple[float, float]:
    n = len(xs) // 3
    return statistics.median(xs[:n]), statistics.median(xs[-n:])


def no_verdict(why: str) -> int:
    print(f"soak: no verdict: {why}", file=sys.stderr)
    return 2


def analyse(body: list[dict], steps: list[dict], a) -> list[dict]:
    """The comparisons: one row per figure, first third (baseline) vs last third of the samples after warm-up."""
    t_lo, t_hi = body[0]["t_s"], body[-1]["t_s"]
    rows = []
    mem_key = "cuda_reserved_mb" if all(s.get("cuda_reserved_mb") is not None for s in body) else "rss_mb"
    for key in dict.fromkeys([mem_key, "rss_mb"]):
        first, last = thirds([s[key] for s in body])
        bound = first * (1 + a.mem_tol) + a.mem_slack_mb
        rows.append({"case": key, "value": last, "unit": "MB", "baseline": "first third after warm-up",
                     "baseline_value": first, "ratio": first / last, "bound": bound, "ok": last <= bound,
                     "decides": True})
    series = {"tokens_per_s_wall": [s["tokens_per_s_wall"] for s in body],
              "tokens_per_cpu_s": [s["tokens_per_cpu_s"] for s in body if s["tokens_per_cpu_s"] is not None],
              "tokens_per_s_step_median": [m["tokens_per_s"] for m in steps if t_lo <= m["t_s"] <= t_hi]}
    for case, xs in series.items():
        if len(xs) < 6:
            continue
        first, last = thirds(xs)
        rows.append({"case": case, "value": last, "unit": "tokens/s", "baseline": "first third after warm-up",
                     "baseline_value": first, "ratio": last / first, "bound": first * (1 - a.tps_tol),
                     "ok": last >= first * (1 - a.tps_tol), "decides": case == f"tokens_per_{a.tps_metric}"})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=30.0, help="of training, from the run's first logged step")
    ap.add_argument("--start-timeout-s", type=float, default=900.0, help="longest wait for the first logged step")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--threads", type=int, default=0, help="OMP/MKL threads of the run (0: torch's default)")
    ap.add_argument("--sample-s", type=float, default=10.0)
    ap.add_argument("--ckpt-every", type=int, default=100, help="train.ckpt_every (steps)")
    ap.add_argument("--warmup-frac", type=float, default=0.1)
    ap.add_argument("--mem-tol", type=float, default=0.03)
    ap.add_argument("--mem-slack-mb", type=float, default=8.0)
    ap.add_argument("--tps-tol", type=float, default=0.10)
    ap.add_argument("--tps-metric", choices=["cpu_s", "s_wall"], default=None,
                    help="throughput figure that decides: tokens per CPU-second (default on CPU) or per wall second")
    ap.add_argument("--out-dir", default=None, help="the run dir, a new one (default: outputs/soak/<date>)")
    ap.add_argument("--json", default=None, help="default: bench/results/soak-<device>.json")
    ap.add_argument("--log", default=None, help="default: the JSON path with .log")
    a, overrides = ap.parse_known_args()
    import torch

    cuda = a.device == "cuda" or (a.device == "auto" and torch.cuda.is_available())
    a.tps_metric = a.tps_metric or ("s_wall" if cuda else "cpu_s")
    dev = device_name().replace(" ", "-") if cuda else "cpu"
    json_path = Path(a.json) if a.json else REPO / "bench" / "results" / f"soak-{dev}.json"
    log_path = Path(a.log) if a.log else json_path.with_suffix(".log")
    run_dir = Path(a.out_dir or REPO / "outputs" / "soak" / time.strftime("%Y%m%d-%H%M%S"))
    if run_dir.exists() and any(run_dir.iterdir()):  # a soak starts afresh, and deletes nothing of anyone's
        raise SystemExit(f"soak: --out-dir {run_dir} is not empty; pick a new folder")
    cmd = [sys.executable, "-m", "moefp8.train", f"train.device={'cuda' if cuda else 'cpu'}",
           "train.steps=1000000000", f"train.ckpt_every={a.ckpt_every}", "train.keep_last=2", "train.log_every=100",
           "train.resume=none", "train.progress=false", "logger.mode=disabled", f"train.out_dir={run_dir}",
           *(["model=small"] if cuda and not any(o.startswith(("model=", "experiment=")) for o in overrides) else []),
           *overrides]
    env = dict(os.environ)
    if a.threads:
        env.update(OMP_NUM_THREADS=str(a.threads), MKL_NUM_THREADS=str(a.threads))
    commit = git_commit()  # what runs: the run imports the working tree now (edits later do not count)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = open(log_path, "w")
    log.write(f"# soak: {' '.join(cmd)}\n# commit {commit}; minutes={a.minutes} sample_s={a.sample_s} "
              f"threads={a.threads or 'default'}\n")
    log.flush()
    print(f"soak: {a.minutes:g} min, log {log_path}")
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
    metrics, samples, steps = Metrics(run_dir / "metrics.jsonl"), [], []
    last_t, last_step, last_cpu, started, now = None, 0, None, None, 0.0
    try:
        while started is None or now - started < a.minutes * 60:
            time.sleep(a.sample_s)
            if proc.poll() is not None:
                return no_verdict(f"the run exited with status {proc.returncode} (see {log_path})")
            now = time.time() - t0
            if started is None and now > a.start_timeout_s:
                return no_verdict(f"no step logged in {a.start_timeout_s:g} s (see {log_path}); "
                                  f"raise --start-timeout-s if start-up is that slow")
            for m in metrics.poll():
                steps.append({"t_s": now, **m})
            if not steps:
                continue  # still starting (imports, data preparation)
            step, cpu = steps[-1]["step"], cpu_s(proc.pid)
            if started is None:
                started, last_t, last_step, last_cpu = now, now, step, cpu
                continue
            tokens_per_step = steps[-1]["tokens_per_s"] * steps[-1]["step_time_s"]
            s = {"t_s": round(now, 1), "step": step, "rss_mb": rss_mb(proc.pid),
                 "tokens_per_s_wall": (step - last_step) * tokens_per_step / (now - last_t),
                 "tokens_per_cpu_s": (step - last_step) * tokens_per_step / (cpu - last_cpu)
                 if cpu is not None and last_cpu is not None and cpu > last_cpu else None,
                 "cuda_alloc_mb": steps[-1].get("cuda_alloc_mb"), "cuda_reserved_mb": steps[-1].get("cuda_reserved_mb"),
                 "loss": steps[-1]["loss"]}
            samples.append(s)
            last_t, last_step, last_cpu = now, step, cpu
            log.write("# sample " + json.dumps(s) + "\n")
            log.flush()
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
    body = samples[int(len(samples) * a.warmup_frac):]
    if len(body) < 6:
        return no_verdict(f"only {len(body)} samples after warm-up in {a.minutes:g} min (see {log_path}); "
                          f"run longer (--minutes) or sample more often (--sample-s)")
    rows = analyse(body, steps, a)
    ok = all(r["ok"] for r in rows if r["decides"])
    summary = (f"soak: {samples[-1]['step']} steps in {samples[-1]['t_s'] / 60:.1f} min; "
               + "; ".join(f"{r['case']} {r['baseline_value']:.1f} -> {r['value']:.1f} (bound {r['bound']:.1f}"
                           f"{'' if r['decides'] else ', reported'})" for r in rows)
               + ("; flat" if ok else "; NOT FLAT"))
    log.write(f"# {summary}\n")
    log.close()
    log_name = os.path.relpath(log_path, REPO) if log_path.is_relative_to(REPO) else str(log_path)
    save_results("soak", rows, {"what": "none: a soak compares the last third with the first (baseline)"},
                 path=json_path, commit=commit, minutes=a.minutes, run_command=" ".join(cmd),
                 threads=a.threads or None, tps_metric=f"tokens_per_{a.tps_metric}", ok=ok, samples=samples,
                 log=log_name)
    print(summary)
    print(f"soak: {json_path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
