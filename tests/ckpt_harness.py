"""Subprocesses of tests/test_checkpoint.py.

`python tests/ckpt_harness.py serve RUN LAST KEEP`: a fork server for the kill test. torch takes
~4 s to import on the CI's CPUs, so the server imports it once and forks a fresh saver for each
line "go" on stdin, printing the child's pid, then (once it ends, killed or not) its wait status.
Each saver does what train.py does at start (remove_partial, find_latest, load), re-saves the
step it resumed from (the re-save path, as at the end of a run that resumed at its end), then
saves the steps after it up to LAST with keep_last=KEEP.

`python tests/ckpt_harness.py fsize RUN LIMIT`: saves a small checkpoint, then with the file size
limit at LIMIT bytes (SIGXFSZ ignored, so a write past it fails with EFBIG inside DCP) a bigger
one; prints the CheckpointError and exits 3.
"""

import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from moefp8 import checkpoint  # noqa: E402

N = 8_000_000  # floats in the big tensor: 32 MB, ~0.25 s a save (fsync included) on the CI's disk


def state_of(step: int, n: int = N) -> dict:
    """The deterministic state of `step`: every value derived from the step."""
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(n, generator=g), "b": torch.full((7, 3), float(step))},
            "data": {"pos": step * 1000}, "step": step}


def empty_state(n: int = N) -> dict:
    return {"model": {"w": torch.zeros(n), "b": torch.zeros(7, 3)}, "data": {"pos": -1}, "step": -1}


def same(a: dict, b: dict) -> bool:
    return (torch.equal(a["model"]["w"], b["model"]["w"]) and torch.equal(a["model"]["b"], b["model"]["b"])
            and a["data"] == b["data"] and a["step"] == b["step"])


def saver(run: str, last: int, keep: int) -> None:
    checkpoint.remove_partial(run)
    start = 1
    p = checkpoint.find_latest(run)
    if p is not None:
        st = empty_state()
        checkpoint.load(p, st)
        assert same(st, state_of(st["step"])), f"{p} does not hold the state of its step"
        start = st["step"]
    for step in range(start, last + 1):
        checkpoint.save(run, step, state_of(step), {"loss": 1.0 / step}, keep_last=keep)


def serve(run: str, last: int, keep: int) -> None:
    while sys.stdin.readline().strip() == "go":
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                saver(run, last, keep)
            except BaseException:
                traceback.print_exc()
                code = 1
            sys.stderr.flush()
            os._exit(code)
        print(pid, flush=True)
        _, status = os.waitpid(pid, 0)
        print(status, flush=True)


def fsize(run: str, limit: int) -> None:
    import resource
    import signal

    checkpoint.save(run, 1, state_of(1, 1000))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    try:
        checkpoint.save(run, 2, state_of(2, 1_000_000))
    except checkpoint.CheckpointError as e:
        print(e)
        sys.exit(3)


if __name__ == "__main__":
    torch.set_num_threads(1)
    cmd, run, *rest = sys.argv[1:]
    if cmd == "serve":
        serve(run, int(rest[0]), int(rest[1]))
    elif cmd == "fsize":
        fsize(run, int(rest[0]))
