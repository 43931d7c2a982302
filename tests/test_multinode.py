"""Expert parallelism across nodes, on one host posing as two: two torchrun launchers on
127.0.0.1 (`--nnodes 2`, c10d rendezvous), 2 ranks each (gloo on CPU; NCCL on 4 GPUs, each
"node" seeing 2 of them), EP4 spanning both "nodes". They train as one launcher of 4 ranks does,
bit for bit, with node-limited routing on and the hierarchical dispatch; a node that dies ends the
other within train.dist_timeout_s; a run dir or data folder that the nodes do not see alike is one
line (docs/multinode.md)."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from moefp8.errors import UserError
from moefp8.parallel import file_digest, same_file
from moefp8.testing import spawn_group, torchrun_worker_pid

REPO = Path(__file__).resolve().parent.parent
# PYTHONFAULTHANDLER: a worker aborted by `finish` prints where its threads were
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_args(data_dir, out: Path, *overrides) -> list[str]:
    return ["-m", "moefp8.train", "model=tiny", "logger.mode=disabled", "train.progress=false", "train.micro_batch=4",
            "train.seq_len=64", "train.log_every=1", "optim.warmup_steps=2", f"data.path={data_dir}",
            "data.max_bytes=2000000", "dispatch=all_to_all", "dispatch.ep_size=4", f"train.out_dir={out}", *overrides]


# cpu: gloo; cuda: NCCL on 4 GPUs, each "node" sees its own 2 (CUDA_VISIBLE_DEVICES), and NCCL's
# all-reduce algorithm is pinned so that the data-parallel sums' order is the rank order's alone
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
NCCL_ENV = {"NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple"}


def need_gpus(device: str) -> None:
    if device == "cuda" and torch.cuda.device_count() < 4:
        pytest.skip("needs 4 GPUs")


def two_nodes(args: list[str], device: str = "cpu", **kw) -> list[subprocess.Popen]:
    """Two launchers of 2 ranks each, rendezvous on 127.0.0.1: node 0 ranks 0-1, node 1 ranks 2-3
    (on cuda: GPUs 0-1 and 2-3)."""
    port, procs = free_port(), []
    for n in (0, 1):
        env = ENV if device == "cpu" else {**ENV, **NCCL_ENV, "CUDA_VISIBLE_DEVICES": f"{2 * n},{2 * n + 1}"}
        procs.append(subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank",
                                       str(n), "--nproc_per_node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                                       f"127.0.0.1:{port}", "--rdzv-id", f"moefp8-test-{port}", *args], cwd=REPO, env=env, text=True, **kw))
        if n == 0:  # node 0's launcher binds the rendezvous store first (the other side of a lost node)
            time.sleep(3)
    return procs


def finish(procs: list[subprocess.Popen], timeout_s: float, workers: int = 2) -> list[str]:
    """The launchers' outputs (stdout=PIPE, stderr=STDOUT) once all have exited. Past timeout_s the
    test fails with where each worker was: the workers are aborted (PYTHONFAULTHANDLER prints their
    threads' stacks), their launchers then exit, and the message holds each launcher's last lines."""
    deadline = time.time() + timeout_s
    try:
        return [p.communicate(timeout=max(deadline - time.time(), 1))[0] for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            for r in range(workers):
                if (pid := torchrun_worker_pid(p.pid, r)) is not None:
                    os.kill(pid, signal.SIGABRT)
        outs = []
        for p in procs:
            try:
                outs.append(p.communicate(timeout=60)[0])
            except subprocess.TimeoutExpired:
                p.kill()
                outs.append(p.communicate()[0])
        pytest.fail(f"no exit in {timeout_s:g} s; the workers were aborted:\n"
                    + "\n".join(f"--- launcher {i} ---\n{o[-6000:]}" for i, o in enumerate(outs)))


def losses(run: Path) -> list[tuple]:
    return [(m["step"], m["loss"], m["grad_norm"]) for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())]


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_two_nodes_train_as_one_launcher_bit_for_bit(data_dir, tmp_path, device):
    """EP4 across 2 x 2 ranks with node-limited routing (each token's experts on at most one node)
    and the hierarchical dispatch: the same losses and grad norms, step by step, as 4 ranks of one
    launcher told they are 2 nodes of 2, with the flat dispatch. (Two launchers with the flat
    dispatch matched too, when tried; not repeated here for CI time.)"""
    need_gpus(device)
    # a collective stuck for 120 s raises on gloo (NCCL's watchdog aborts): a hang becomes a report
    steps = ["train.steps=3", "dispatch.max_nodes=1", f"train.device={device}", "train.dist_timeout_s=120"]
    one = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
                            *train_args(data_dir, tmp_path / "one", *steps, "dispatch.ranks_per_node=2")],
                           cwd=REPO, env=ENV if device == "cpu" else {**ENV, **NCCL_ENV}, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    out = finish([one], 300, workers=4)[0]
    assert one.returncode == 0, out[-3000:]
    want = losses(tmp_path / "one")
    assert len(want) == 3
    for hierarchical in ("true",):
        run = tmp_path / f"nodes-{hierarchical}"
        procs = two_nodes(train_args(data_dir, run, *steps, f"dispatch.hierarchical={hierarchical}"), device,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        outs = finish(procs, 300)
        assert all(p.returncode == 0 for p in procs), outs[0][-3000:] + outs[1][-3000:]
        assert ("dispatch: hierarchical, 2 nodes x 2 ranks" in outs[0]) == (hierarchical == "true")
        assert losses(run) == want, hierarchical


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_a_node_that_dies_ends_the_other_within_the_timeout(data_dir, tmp_path, device):
    need_gpus(device)
    run = tmp_path / "run"
    procs = two_nodes(train_args(data_dir, run, "train.steps=100000", "train.ckpt_every=0",
                                 "train.dist_timeout_s=20", "dispatch.hierarchical=true",
                                 f"train.device={device}"), device,
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 240
        while time.time() < deadline and all(p.poll() is None for p in procs):
            try:
                if len((run / "metrics.jsonl").read_text().splitlines()) >= 3:
                    break
            except FileNotFoundError:
                pass
            time.sleep(0.2)
        # (5 s was too short on CI's 2 cores with another test beside: a node's collectives timed out early)
        early = [p.communicate()[1][-2000:] for p in procs if p.poll() is not None]
        assert not early, f"a node exited before step 3: {early}"
        # node 1 goes down: its ranks and its launcher (torchrun's workers outlive a killed launcher)
        workers = [torchrun_worker_pid(procs[1].pid, r) for r in (0, 1)]
        assert all(workers), workers
        for pid in (*workers, procs[1].pid):
            os.kill(pid, signal.SIGKILL)
        t0 = time.time()
        _, err = procs[0].communicate(timeout=120)
        elapsed = time.time() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    assert procs[0].returncode != 0 and elapsed < 60, (elapsed, err[-3000:])
    ours = [line for line in err.splitlines() if line.startswith("error: rank")]
    # gloo: the failed collective raises; NCCL: the step watchdog stops the rank; both lines say this
    assert ours and all("a peer rank died or hangs" in line for line in ours), err[-3000:]
    # no Python traceback through our code (torchrun's "Root Cause" report after it aside). NCCL's
    # watchdog prints where the collective that timed out was launched ("#3 _arrived from
    # .../moefp8/grad_sync.py:86": the gradient buckets' all-reduce, from the backward): that is
    # PyTorch's report of the hang, not a traceback, and passes.
    assert not re.search(r'File "[^"]*/(moefp8|dispatch|kernels)/', err.split("Root Cause")[0]), err[-3000:]


def _not_shared(rank, world, dev, root):
    """Rank 1 reads another folder at "the same path", as a node without the shared mount would."""
    path = Path(root) / ("a" if rank == 0 else "b") / "lock.json"
    with pytest.raises(UserError) as e:
        same_file(path, "train.out_dir=/runs/x", "put it on a shared filesystem", rank, world)
    msg = str(e.value)
    assert msg.startswith(f"train.out_dir=/runs/x: rank 1 on {socket.gethostname()} finds other contents at ")
    assert msg.endswith("; put it on a shared filesystem") and e.value.quiet == (rank != 0)
    same_file(Path(root) / "a" / "lock.json", "x", "y", rank, world)  # the same file: fine
    dist.barrier()
    if rank == 1:
        (Path(root) / "a" / "lock.json").unlink()
    dist.barrier()
    with pytest.raises(UserError, match="rank 0 on .* cannot read it at .*cannot read it either"):
        same_file(Path(root) / "a" / "lock.json", "x", "y", rank, world)


def test_a_folder_the_nodes_do_not_see_alike_is_one_line(tmp_path):
    for d, text in (("a", '{"pid": 1}'), ("b", '{"pid": 2}')):
        (tmp_path / d).mkdir()
        (tmp_path / d / "lock.json").write_text(text)
    assert file_digest(tmp_path / "a" / "lock.json") and file_digest(tmp_path / "missing") is None
    spawn_group(_not_shared, 2, str(tmp_path), timeout_s=120)
