"""moefp8/overlap_auto.py: dispatch.overlap=auto times both schedules over the first steps and
keeps the faster; every rank decides alike; the configuration around it."""

import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from moefp8.build import overlap_auto
from moefp8.config import Config, validate
from moefp8.launch import dispatch_capacity
from moefp8.overlap import OverlapPolicy
from moefp8.overlap_auto import OverlapAuto

REPO = Path(__file__).resolve().parent.parent


class _Model:
    def __init__(self):
        self.overlap, self.history = None, []

    def set_overlap(self, policy):
        self.overlap = policy
        self.history.append(policy is not None)


def drive(auto: OverlapAuto, model: _Model, seconds, steps: int):
    """`steps` steps; seconds(schedule_on: bool, step) is the step's time."""
    for i in range(steps):
        auto.begin_step()
        auto.end_step(seconds(model.overlap is not None, i))


@pytest.mark.parametrize("on_faster", [True, False])
def test_keeps_the_faster_schedule_and_ignores_the_warmup(on_faster):
    model, said = _Model(), []
    policy = OverlapPolicy()
    auto = OverlapAuto(model, policy, warmup=1, rounds=3, say=said.append)
    fast, slow = (0.9, 1.0) if on_faster else (1.0, 0.9)  # (on, off)

    def seconds(on, i):
        if i < 2:  # the warm-up round: each schedule's first step compiles; 'on' the slowest by far
            return 50.0 if on else 1.0
        return fast if on else slow
    drive(auto, model, seconds, auto.trial_steps)
    assert model.history == [False, True] * 4 + [on_faster]  # alternated, then the choice
    assert auto.choice == ("on" if on_faster else "off") and (model.overlap is policy) == on_faster
    assert auto.medians == {"on": fast, "off": slow}
    assert len(said) == 1 and said[0].startswith(f"dispatch.overlap=auto: {auto.choice} from now on")
    assert "median of 3 steps each" in said[0]
    drive(auto, model, seconds, 5)  # decided: no more switching, nothing more said
    assert len(model.history) == 9 and (model.overlap is policy) == on_faster and len(said) == 1


def test_every_rank_decides_on_the_mean_over_ranks():
    """Rank-local medians would disagree (this rank finds 'on' faster); the all-reduced times,
    the same on every rank, say 'off'."""
    model, seen = _Model(), []

    def all_reduce(t):  # two ranks: the other one measured 'on' much slower
        seen.append(t.clone())
        other = torch.tensor([[1.0] * 3, [3.0] * 3], dtype=t.dtype)  # [off, on] x rounds
        return t.add_(other)
    auto = OverlapAuto(model, OverlapPolicy(), warmup=0, rounds=3, all_reduce=all_reduce, world=2, say=lambda s: None)
    drive(auto, model, lambda on, i: 0.8 if on else 1.0, auto.trial_steps)
    assert seen[0].shape == (2, 3) and seen[0].device == auto.device and auto.choice == "off"
    assert auto.medians == pytest.approx({"off": 1.0, "on": 1.9})


def test_auto_configuration():
    c = Config()
    c.dispatch.overlap = "auto"
    validate(c)
    c.dispatch.overlap = "sometimes"
    with pytest.raises(ValueError, match=r"dispatch.overlap='sometimes': expected false, true or auto"):
        validate(c)
    c.dispatch.overlap, c.train.deterministic = "auto", True
    with pytest.raises(ValueError, match=r"dispatch.overlap=auto: .*train.deterministic=true.*set dispatch.overlap="):
        validate(c)
    c.train.deterministic = False
    c.train.micro_batch, c.train.seq_len = 6, 128
    assert dispatch_capacity(c) == 6 * 128  # both schedules run: the whole micro-batch
    c.dispatch.overlap = True
    assert dispatch_capacity(c) == 3 * 128
    said = []
    c.dispatch.overlap = "auto"
    assert overlap_auto(c, None, _Model(), said.append) is None and said == [
        "dispatch.overlap=auto: off (EP=1: no exchanges to overlap)"]


def test_the_capacity_follows_the_schedule():
    """all_to_all with the capacity sized from the batch: the overlapped steps pass halves, and
    the capacity mode moves whole capacity blocks, so the trials (and the choice) run each
    schedule with its own capacity; a given dispatch.capacity stays."""
    c = Config()
    c.dispatch.backend, c.dispatch.ep_size, c.dispatch.overlap = "all_to_all", 2, "auto"
    c.train.micro_batch, c.train.seq_len = 6, 128
    par = types.SimpleNamespace(ep_size=2, world=2, all_reduce_=lambda t: t.mul_(2), device=torch.device("cpu"))
    model = _Model()
    model.dispatcher = types.SimpleNamespace(capacity=768)
    auto = overlap_auto(c, par, model, lambda s: None)
    assert auto.device == par.device  # the collectives' device: under NCCL a CUDA one (a CPU tensor raised there)
    caps = []
    for i in range(auto.trial_steps + 2):
        auto.begin_step()
        caps.append(model.dispatcher.capacity)
        auto.end_step(1.0 if model.overlap is None else 2.0)
    assert caps == [768, 384] * 4 + [768, 768] and auto.choice == "off"
    assert auto.policy.gemm_sm_reserve == 0
    c.dispatch.gemm_sm_reserve = 16  # the overlapped trials' GEMMs leave that many SMs to the exchanges
    assert overlap_auto(c, par, model, lambda s: None).policy.gemm_sm_reserve == 16
    c.dispatch.gemm_sm_reserve = 0
    c.dispatch.capacity = 1000
    model.dispatcher.capacity = 1000
    auto = overlap_auto(c, par, model, lambda s: None)
    for _ in range(3):
        auto.begin_step()
        assert model.dispatcher.capacity == 1000
        auto.end_step(1.0)


def test_auto_in_training_under_torchrun(data_dir, tmp_path):
    """EP2 on 2 gloo ranks: the first 8 steps alternate the schedules, then one is kept; the run
    trains on (finite losses, every step logged) and both ranks print the same decision."""
    run = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        "-m", "moefp8.train", "dispatch=all_to_all", "dispatch.ep_size=2", "dispatch.overlap=auto",
                        "train.steps=10", "train.micro_batch=2", "train.seq_len=64", "train.log_every=1",
                        "train.progress=false", "logger.mode=disabled", f"data.path={data_dir}",
                        "data.max_bytes=2000000", f"train.out_dir={run}", "train.ckpt_every=0"],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [line for line in r.stdout.splitlines() if line.startswith("dispatch.overlap=auto: ")]
    assert len(lines) == 1 and " from now on (step time, median of 3 steps each" in lines[0], r.stdout[-2000:]
    assert "step     10/10" in r.stdout and "nan" not in r.stdout.split(lines[0])[1].lower()


@pytest.mark.gpu
def test_gpu_auto_decides_under_nccl(data_dir, tmp_path):
    """Two GPUs, EP2 over NCCL, through the Hydra entry point: the trial steps' times are all-reduced
    on the GPU (a CPU tensor raised "No backend type associated with device type cpu" there) and
    every rank keeps the printed choice to the end."""
    import subprocess
    import sys
    from pathlib import Path

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        "-m", "moefp8.train", "model=tiny", "dispatch=all_to_all", "dispatch.ep_size=2",
                        "dispatch.overlap=auto", "train.steps=10", "train.micro_batch=4", "train.seq_len=128",
                        "train.ckpt_every=0", "train.progress=false", "logger.mode=disabled", f"data.path={data_dir}",
                        "data.max_bytes=2000000", f"train.out_dir={tmp_path / 'run'}"],
                       cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "dispatch.overlap=auto: " in r.stdout and " from now on (step time" in r.stdout, r.stdout[-2000:]
