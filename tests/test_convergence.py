"""tools/convergence.py: both recipes train through the real entry point; JSON and PNG written."""

import json
import math
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))
import convergence  # noqa: E402
from convergence import (RERUN, SEEDED, compare, ema, grad_spikes, mean_run, recipe_means,  # noqa: E402
                         reference_of, run_overrides, seed_pairs, spikes_before, where)


def in_process(cmd: list[str], capsys, monkeypatch):
    """tools/convergence.py's main() in this process, for the calls that only read runs
    (--skip-train: no subprocess start-up); -> like subprocess.run's result."""
    monkeypatch.setattr(sys, "argv", ["convergence.py", *cmd[2:]])
    capsys.readouterr()
    code, err = 0, ""
    try:
        convergence.main()
    except SystemExit as e:
        if e.code not in (None, 0):
            code, err = 1, str(e.code)
    out = capsys.readouterr()
    return types.SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err + err)


def test_ema():
    assert ema([1.0, 0.0, 0.0]) == [1.0, 0.9, pytest.approx(0.81)]


def test_noise_floor_runs():
    base = ["model=tiny", "train.seed=3"]
    assert run_overrides("fp8", base) == [*base, "recipe=fp8"]
    assert run_overrides("bf16_again", base) == [*base, "recipe=bf16"]  # same seed and data: GPU nondeterminism only
    assert run_overrides("bf16_seed+1", base) == [*base, "recipe=bf16", "train.seed=4"]
    assert run_overrides("fp8_again", base) == [*base, "recipe=fp8"]
    ablation = ["recipe.fp8_dense=false"]  # --fp8-overrides: the FP8 runs only
    assert run_overrides("fp8_again", base, ablation) == [*base, "recipe=fp8", *ablation]
    assert run_overrides("bf16_again", base, ablation) == [*base, "recipe=bf16"]
    assert run_overrides("fp8_again2", base, ablation) == [*base, "recipe=fp8", *ablation]  # a third FP8 run
    assert RERUN.fullmatch("bf16_again3") and not RERUN.fullmatch("fp8_seed+1") and not RERUN.fullmatch("fp8_x")
    # either recipe at another seed (the seed pairs): the configured seed + K, the FP8 ablation on the FP8 ones
    assert run_overrides("fp8_seed+2", base, ablation) == [*base, "recipe=fp8", "train.seed=5", *ablation]
    assert run_overrides("bf16_seed+2", ["model=tiny"]) == ["model=tiny", "recipe=bf16", "train.seed=2"]
    assert SEEDED.fullmatch("fp8_seed+12") and not SEEDED.fullmatch("fp8_seed+") and not SEEDED.fullmatch("fp8_again")
    assert not SEEDED.fullmatch("fp8_seed+0") and not SEEDED.fullmatch("bf16_seed+01")  # +0 is a rerun: fp8_again


def test_compare_before_the_data_repeats():
    """With the steps per epoch inside the last half, the statistic is also given over the last half's
    steps before the data repeats; without (or with the whole run in one epoch) it is not."""
    def run(*ema):
        return {"steps": list(range(1, 9)), "ema": list(ema), "val": {}}

    a, b = run(9, 9, 9, 9, 1.001, 1.002, 1.01, 1.004), run(*[1.0] * 8)  # last half: steps 5-8
    got = compare(a, b, 0.0025, epoch=6)
    assert got["max_pct"] == pytest.approx(1.0) and got["first_epoch_max_pct"] == pytest.approx(0.2)
    assert got["first_epoch_mean_pct"] == pytest.approx(0.15)
    assert "first_epoch_max_pct" not in compare(a, b, 0.0025, epoch=8) and "first_epoch_max_pct" not in compare(a, b, 0.0025)


def test_grad_spikes_and_the_max_they_explain():
    """A gradient norm over 2.5x the median of the 50 steps before it is a spike; spikes under 10 steps
    apart are one event (its first step, its largest ratio); a pair's maximum names the spikes of its
    two runs in the 30 steps up to it. Steps before the 51st are not judged (no window yet)."""
    g = [1.0] * 200
    g[10] = 50.0  # inside the first window: not judged
    g[99], g[102], g[150] = 3.0, 7.0, 2.4  # steps 100 and 103: one event, 7x; step 151 under the factor
    g[179] = float("nan")  # not a spike
    run = {"steps": list(range(1, 201)), "grad_norm": g}
    spikes = grad_spikes(run)
    assert spikes == [(100, 7.0)]
    assert spikes_before(120, {"fp8": spikes, "bf16": [(95, 3.1)]}) == ["fp8 100 (7.0x)", "bf16 95 (3.1x)"]
    assert spikes_before(131, {"fp8": spikes}) == [] and spikes_before(99, {"fp8": spikes}) == []
    a, b = {"steps": [1, 2, 3, 4], "ema": [1, 1, 1.003, 1.001], "val": {}}, {"steps": [1, 2, 3, 4], "ema": [1] * 4, "val": {}}
    assert compare(a, b, 0.0025)["max_step"] == 3


def test_where_counts_machines_by_host_and_boot():
    s = {"step": 0, "date": "2026-11-22T21:00:00+00:00", "commit": "abc", "device": "NVIDIA H200", "world": 2,
         "host": "vm"}
    old = [s, {**s, "step": 900}]  # lines written before boot ids were recorded
    assert where(old).endswith("2 start(s) on 1 machine(s), 2026-11-22..2026-11-22")
    fresh = [{**s, "boot": "1a2b3c4d"}, {**s, "step": 953, "boot": "5e6f7a8b"}]  # resumed on a new machine named alike
    assert "on 2 machine(s)" in where(fresh) and "on 1 machine(s)" in where([fresh[0], {**fresh[0], "step": 9}])
    assert where([]) == "not recorded"


def test_recipe_means():
    """Each same-seed run's held-out mean over the last half, FP8 runs' average against BF16 runs'; the
    seed+1 run (other data order) is not one of them."""
    def run(*val):  # held-out losses at steps 2, 4, 6, 8 of an 8-step run: the last half is steps 6 and 8
        return {"steps": list(range(1, 9)), "val": dict(zip((2, 4, 6, 8), val))}

    curves = {"bf16": run(9, 9, 1.0, 1.0), "fp8": run(9, 9, 1.01, 1.03), "bf16_again": run(0, 0, 1.02, 1.02),
              "fp8_again": run(0, 0, 1.04, 1.04), "bf16_seed+1": run(0, 0, 5, 5)}
    got = recipe_means(curves)  # fp8 runs 1.02 and 1.04, bf16 runs 1.0 and 1.02; steps 2 and 4 not counted
    assert got["value"] == pytest.approx(100 * (1.03 / 1.01 - 1), abs=1e-4)
    assert got["runs_per_recipe"] == {"bf16": 2, "fp8": 2} and "bf16_seed+1" not in got["last_half_mean"]
    assert got["bf16_spread_pct"] == pytest.approx(100 * 0.02 / 1.01, abs=1e-4)
    assert got["fp8_spread_pct"] == pytest.approx(100 * 0.02 / 1.03, abs=1e-4)
    # the difference's standard error from the runs' scatter: each recipe's sample variance 0.0002 over 2 runs
    assert got["se_pct"] == pytest.approx(100 * math.sqrt(0.0002 / 2 + 0.0002 / 2) / 1.01, abs=1e-4)
    assert got["resolves_pct"] == pytest.approx(2 * got["se_pct"], abs=1e-3)
    assert "se_pct" not in recipe_means({n: c for n, c in curves.items() if n != "fp8_again"})  # one FP8 run: no scatter
    curves["fp8_again"]["val"] = {2: 1.0}  # no evaluation in the last half: the run is left out
    assert recipe_means(curves)["runs_per_recipe"]["fp8"] == 1
    assert recipe_means({"bf16": run(1, 1, 1, 1), "fp8": {"steps": [1, 2], "val": {}}}) == {}  # no held-out fp8


def test_seed_pairs():
    """FP8 against BF16 at each seed with both recipes (same-seed reruns averaged), then over the seeds with
    the standard error from their scatter; the same-seed recipe means leave the other seeds out."""
    def run(*val):  # held-out losses at steps 2, 4, 6, 8 of an 8-step run: the last half is steps 6 and 8
        return {"steps": list(range(1, 9)), "val": dict(zip((2, 4, 6, 8), val))}

    curves = {"bf16": run(9, 9, 1.0, 1.0), "fp8": run(9, 9, 0.99, 0.99), "bf16_again": run(9, 9, 1.0, 1.0),
              "fp8_again": run(9, 9, 0.99, 0.99),  # seed +0: fp8 -1%, the reruns agree
              "bf16_seed+1": run(0, 0, 2.0, 2.0), "fp8_seed+1": run(0, 0, 2.02, 2.02),  # seed +1: +1%
              "bf16_seed+2": run(0, 0, 4.0, 4.0), "fp8_seed+2": run(0, 0, 4.0, 4.0),  # seed +2: 0%
              "bf16_seed+3": run(0, 0, 3.0, 3.0),  # one recipe only: no pair
              "bf16_megablocks": run(0, 0, 7.0, 7.0)}  # another MoE: not a draw of either recipe
    got = seed_pairs(curves)
    assert got["seeds"] == 3 and got["per_seed_pct"] == pytest.approx({"seed+0": -1.0, "seed+1": 1.0, "seed+2": 0.0})
    assert got["value"] == pytest.approx(0.0, abs=1e-4)
    assert got["se_pct"] == pytest.approx(1.0 / math.sqrt(3), abs=1e-4)  # sample sd of (-1, 1, 0) is 1
    assert got["resolves_pct"] == pytest.approx(2 / math.sqrt(3), abs=1e-3)
    same = recipe_means(curves)  # one seed, reruns agree: -1% with no scatter, which says nothing of other seeds
    assert same["value"] == pytest.approx(-1.0, abs=1e-4) and same["se_pct"] == 0
    assert set(same["last_half_mean"]) == {"bf16", "fp8", "bf16_again", "fp8_again"}
    assert seed_pairs({n: curves[n] for n in ("bf16", "fp8", "bf16_seed+1")}) == {}  # one seed with both recipes


def test_plot_reference_is_the_bf16_run_of_the_seed():
    """The plot draws an FP8 run at another seed against that seed's BF16 run (against seed 0's, the recipe's
    difference would drown in the seeds' spread); BF16 runs at other seeds, reruns and FP8 runs without
    their seed's BF16 against bf16."""
    curves = dict.fromkeys(["bf16", "fp8", "fp8_again", "bf16_seed+1", "fp8_seed+1", "fp8_seed+2", "bf16_megablocks"])
    got = {n: reference_of(n, curves) for n in curves}
    assert got == {"bf16": "bf16", "fp8": "bf16", "fp8_again": "bf16", "bf16_seed+1": "bf16",
                   "fp8_seed+1": "bf16_seed+1", "fp8_seed+2": "bf16", "bf16_megablocks": "bf16"}


def test_mean_run():
    """Runs averaged over their common steps (EMA and held-out): an FP8 run outside 0.25% of one BF16 run
    and inside of the other's can be inside of their mean."""
    def run(steps, ema, val):
        return {"steps": steps, "ema": ema, "val": val}

    curves = {"bf16": run([1, 2, 3, 4], [1.0, 1.0, 1.0, 1.004], {2: 2.0, 4: 1.0}),
              "bf16_again": run([1, 2, 3, 4, 5], [1.0, 1.0, 1.0, 1.0, 9.0], {4: 1.02}),
              "fp8": run([1, 2, 3, 4], [1.0, 1.0, 1.0, 0.999], {4: 1.01})}
    m = mean_run(curves, ["bf16", "bf16_again"])
    assert m["steps"] == [1, 2, 3, 4] and m["ema"] == pytest.approx([1.0, 1.0, 1.0, 1.002]) and m["val"] == {4: 1.01}
    one = compare(curves["fp8"], curves["bf16"], 0.0025)["max_pct"]
    assert one == pytest.approx(100 * (1 - 0.999 / 1.004), abs=1e-4)  # 0.498%: outside
    got = compare(curves["fp8"], m, 0.0025)
    assert got["max_pct"] == pytest.approx(100 * (1 - 0.999 / 1.002), abs=1e-4)  # 0.299%
    assert got["max_step"] == 4 and got["val_max_pct"] == 0


@pytest.mark.slow
def test_convergence_tool_cpu(tmp_path, capsys, monkeypatch):
    """Four runs in two calls (as on a 2-GPU machine: --train picks this call's runs), with held-out
    losses; every FP8 run is compared with every BF16 run."""
    cmd = [sys.executable, "tools/convergence.py", "--out", str(tmp_path), "--noise-floor", "--noise-kind", "seed",
           "--runs", "fp8_again", "model=tiny", "train.steps=6", "optim.warmup_steps=2", "data.max_bytes=2000000",
           "train.log_every=3", "train.ckpt_every=0", "logger.mode=disabled",
           f"data.path={tmp_path / 'data'}", "data.prepare_from=stdlib",
           "train.eval_every=2", "data.val_windows=4", "train.micro_batch=2"]
    r = subprocess.run([*cmd, "--train", "bf16,fp8,bf16_seed+1"], cwd=REPO, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode != 0 and "no metrics in" in r.stderr and "fp8_again" in r.stderr  # not trained yet
    r = subprocess.run([*cmd, "--train", "fp8_again"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    doc = json.loads((tmp_path / "convergence.json").read_text())
    assert (tmp_path / "convergence.png").stat().st_size > 10_000
    assert doc["tool"] == "convergence" and doc["curves"]["steps"] == list(range(1, 7))
    rows = {row["impl"]: row for row in doc["rows"]}
    gap = rows["fp8 vs bf16: max |EMA rel. loss diff|, last half"]
    assert isinstance(gap["pass"], bool) and gap["value"] >= 0 and gap["baseline_value"] == 0.25
    assert gap["noise_floor"] == "bf16_seed+1" and gap["noise_floor_pct"] > 0  # another seed differs from BF16
    assert 0 <= gap["share_of_last_half_within_threshold"] <= 1 and 0 <= gap["noise_floor_share_within_threshold"] <= 1
    assert 4 <= gap["max_step"] <= 6 and set(gap["grad_norm_spikes"]) == {"bf16", "fp8", "bf16_seed+1", "fp8_again"}
    assert "grad-norm spikes (> 2.5x" in r.stdout  # 6 steps: shorter than the window, none judged
    assert rows["fp8 tokens/s"]["value"] > 0 and len(doc["curves"]["rel_diff"]) == 6
    vs = gap["fp8_vs_bf16_seed+1"]  # FP8 against the other BF16 run: is it inside BF16's own spread
    c = doc["curves"]
    want = max(abs(c["fp8"]["ema"][i] / c["bf16_seed+1"]["ema"][i] - 1) for i in range(3, 6))
    assert vs["max_pct"] == pytest.approx(100 * want, abs=1e-4) and 0 <= vs["share_within_threshold"] <= 1
    assert "fp8 vs bf16_seed+1: max" in r.stdout
    assert {n: len(v) for n, v in doc["run_starts"].items()} == {"bf16": 1, "fp8": 1, "bf16_seed+1": 1, "fp8_again": 1}
    assert doc["run_starts"]["fp8_again"][0]["device"] == "cpu" and "fp8_again trained on cpu x1, commit" in r.stdout
    pairs = {(x["run"], x["vs"]): x for x in doc["pairs"]}
    assert set(pairs) == {("fp8", "bf16"), ("fp8", "bf16_seed+1"), ("fp8_again", "bf16"),
                          ("fp8_again", "bf16_seed+1"), ("bf16_seed+1", "bf16"), ("fp8_again", "fp8")}
    means = rows["fp8 runs vs bf16 runs: mean held-out loss over the last half, relative"]
    assert means["runs_per_recipe"] == {"bf16": 1, "fp8": 2} and isinstance(means["pass"], bool)
    held = rows["fp8 vs bf16: max |held-out rel. loss diff|, last half"]  # evaluations at steps 4 and 6
    v8, v16 = c["fp8"]["val"], c["bf16"]["val"]
    assert sorted(v8) == ["2", "4", "6"] and held["points"] == 2
    assert held["value"] == pytest.approx(100 * max(abs(v8[s] / v16[s] - 1) for s in ("4", "6")), abs=1e-4)
    # --skip-train only reads the runs; --suffix names the outputs (one JSON per ablation beside the main one)
    r = in_process([*cmd, "--skip-train", "--suffix", "reread"], capsys, monkeypatch)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    again = json.loads((tmp_path / "convergence-reread.json").read_text())
    assert again["plot"] == "convergence-reread.png" and (tmp_path / "convergence-reread.png").is_file()
    assert again["pairs"] == doc["pairs"]  # the same runs read twice give the same statistics
    # --upto: the runs compared over their first steps only (runs cut short); more than they have is refused
    r = in_process([*cmd, "--skip-train", "--suffix", "upto", "--upto", "4"], capsys, monkeypatch)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    cut = json.loads((tmp_path / "convergence-upto.json").read_text())
    assert cut["curves"]["steps"] == [1, 2, 3, 4] and cut["curves"]["fp8"]["loss"] == c["fp8"]["loss"][:4]
    assert sorted(cut["curves"]["fp8"]["val"]) == ["2", "4"] and "--upto 4" in cut["rows"][0]["case"]
    want = max(abs(c["fp8"]["ema"][i] / c["bf16"]["ema"][i] - 1) for i in (2, 3))  # last half: steps 3, 4
    assert cut["rows"][0]["value"] == pytest.approx(100 * want, abs=1e-4)
    r = in_process([*cmd, "--skip-train", "--upto", "7"], capsys, monkeypatch)
    assert r.returncode != 0 and "bf16 at step 6 of 7," in r.stderr and "--upto asks for more steps" in r.stderr, r.stderr
    # --earlier: runs whose folders are gone (their machine lost) read back from a result JSON give the same statistics
    shutil.move(tmp_path / "runs" / "bf16", tmp_path / "bf16_gone")
    shutil.move(tmp_path / "runs" / "fp8", tmp_path / "fp8_gone")
    r = in_process([*cmd, "--skip-train", "--suffix", "earlier"], capsys, monkeypatch)
    assert r.returncode != 0 and "no metrics in" in r.stderr
    r = in_process([*cmd, "--skip-train", "--suffix", "earlier", "--earlier", str(tmp_path / "convergence.json")],
                   capsys, monkeypatch)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    back = json.loads((tmp_path / "convergence-earlier.json").read_text())
    assert back["earlier"]["runs"] == ["bf16", "fp8"] and "bf16, fp8 read from" in r.stdout
    assert back["pairs"] == doc["pairs"] and back["run_starts"] == doc["run_starts"]
    assert [{k: v for k, v in row.items() if k != "case"} for row in back["rows"]] == [
        {k: v for k, v in row.items() if k != "case"} for row in doc["rows"]]
    # a JSON from before 2026-11-23 (no step lists, gradient norms or tokens/s per run) still reads
    old = json.loads((tmp_path / "convergence.json").read_text())
    for name in ("bf16", "fp8", "bf16_seed+1", "fp8_again"):
        for key in ("steps", "grad_norm", "tokens_per_s_median"):
            old["curves"][name].pop(key)
    (tmp_path / "old.json").write_text(json.dumps(old))
    r = in_process([*cmd, "--skip-train", "--suffix", "old", "--earlier", str(tmp_path / "old.json")], capsys, monkeypatch)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    back = json.loads((tmp_path / "convergence-old.json").read_text())
    assert back["pairs"] == doc["pairs"] and back["rows"][0]["grad_norm_spikes"] == doc["rows"][0]["grad_norm_spikes"]
    # fp8 / bf16 tokens/s from the old JSON's row, whose figures are rounded to 0.1 tokens/s: the ratio of the
    # rounded figures, which may differ from the unrounded one in its third decimal (tiny CPU runs: ~100s of tokens/s)
    old_row = doc["rows"][-1]
    assert back["rows"][-1]["ratio"] == round(old_row["value"] / old_row["baseline_value"], 3)
    # one more same-seed BF16 run trained beside the runs read back: FP8 (each run, and the mean of both) against
    # the mean of the BF16 runs
    r = subprocess.run([*cmd, "--runs", "fp8_again,bf16_again", "--train", "bf16_again", "--suffix", "means",
                        "--earlier", str(tmp_path / "convergence.json")], cwd=REPO, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    means = json.loads((tmp_path / "convergence-means.json").read_text())
    rows = {row["impl"]: row for row in means["rows"]}
    both = rows["the mean of 2 fp8 runs vs the mean of 2 bf16 runs: max |EMA rel. loss diff|, last half"]
    c = means["curves"]
    m8, m16 = ([(c[a]["ema"][i] + c[b]["ema"][i]) / 2 for i in range(6)] for a, b in (("fp8", "fp8_again"),
                                                                                       ("bf16", "bf16_again")))
    assert both["fp8_runs"] == ["fp8", "fp8_again"] and both["bf16_runs"] == ["bf16", "bf16_again"]
    assert both["value"] == pytest.approx(100 * max(abs(m8[i] / m16[i] - 1) for i in range(3, 6)), abs=1e-4)
    assert "fp8 vs the mean of 2 bf16 runs: max |EMA rel. loss diff|, last half" in rows


@pytest.mark.slow
def test_convergence_tool_data_parallel_resumes(tmp_path):
    """--nproc 2: each run is a torchrun job of two data-parallel processes (gloo on CPU). Stopped by
    train.time_limit_s, the runs are reported unfinished (no JSON); called again, the tool resumes
    them. A run cut off without a checkpoint of its last steps resumes from its last checkpoint and
    the loss curve goes on as it was."""
    cmd = [sys.executable, "tools/convergence.py", "--out", str(tmp_path), "--nproc", "2", "model=tiny",
           "train.steps=4", "optim.warmup_steps=1", "data.max_bytes=1000000", "train.ckpt_every=2",
           "logger.mode=disabled", f"data.path={tmp_path / 'data'}", "data.prepare_from=stdlib", "train.grad_accum=2",
           "train.micro_batch=2"]
    r = subprocess.run([*cmd, "train.time_limit_s=1e-9"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode != 0 and "runs not finished: bf16 at step 1 of 4, fp8 at step 1 of 4" in r.stderr, r.stderr
    assert not (tmp_path / "convergence.json").exists()  # no statistics over part of a run
    assert "--nproc_per_node=2" in r.stdout and "cpu x 2 (EP 1); 2048 tokens/step" in r.stdout
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert r.stdout.count("resumed from") == 2
    first = json.loads((tmp_path / "convergence.json").read_text())["curves"]
    run = tmp_path / "runs" / "fp8"  # as if killed after step 3: step 4's checkpoint never written
    shutil.rmtree(run / "step_0000004")
    (run / "latest").write_text("step_0000002")
    r = subprocess.run([*cmd, "--train", "fp8"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "resumed from" in r.stdout and "step_0000002" in r.stdout
    again = json.loads((tmp_path / "convergence.json").read_text())["curves"]
    assert again["steps"] == [1, 2, 3, 4] and again["fp8"]["loss"] == first["fp8"]["loss"]
    starts = json.loads((tmp_path / "convergence.json").read_text())["run_starts"]  # fp8 started thrice, 2 ranks
    assert [(s["step"], s["world"]) for s in starts["fp8"]] == [(0, 2), (1, 2), (2, 2)] and len(starts["bf16"]) == 2
    row = json.loads((tmp_path / "convergence.json").read_text())["rows"][0]  # 2 x 2 x 2 windows per step
    assert row["data_steps_per_epoch"] > 4 and "first_epoch_max_pct" not in row
