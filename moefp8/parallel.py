"""The process layout of a training run and its guards: data x expert parallel groups
(`Parallel`), rank-0 decisions every rank learns (`Parallel.on_main`), files every node must see
alike (`same_file`), and the step watchdog that ends a rank blocked on a dead or hung peer
(`StepWatchdog`).

    par = Parallel(cfg, device)               # one process: no process group, everything local
    index = par.on_main(lambda: prepare(...))  # rank 0 runs it; its UserError is raised everywhere
    same_file(run_dir / "lock.json", ...)      # every rank reads what rank 0 wrote, or one line
"""

import contextlib
import datetime
import hashlib
import os
import socket
import sys
import threading
import time

import torch
import torch.distributed as dist

from moefp8.config import Config
from moefp8.dispatch import build_ep_group
from moefp8.errors import RankError, UserError, first_line

SLOW_WAIT_S = 24 * 3600  # how long the other ranks wait for rank 0's `on_main(..., slow=True)` job


def ranks_per_node(cfg: Config, world: int, env=os.environ) -> int:
    """Ranks per node: dispatch.ranks_per_node, else torchrun's LOCAL_WORLD_SIZE, else all of them."""
    return cfg.dispatch.ranks_per_node or int(env.get("LOCAL_WORLD_SIZE", world))


def check_parallel(cfg: Config, world: int) -> None:
    """The checks that need the process count (torchrun's WORLD_SIZE): ValueError naming the value."""
    ep, backend = cfg.dispatch.ep_size, cfg.dispatch.backend
    if backend != "local" and world == 1:
        raise ValueError(f"dispatch={backend}: expert parallelism needs several processes (torchrun "
                         f"--nproc_per_node N -m moefp8.train ...); use dispatch=local on one process")
    if world % ep:
        raise ValueError(f"dispatch.ep_size={ep}: does not divide the {world} processes")


@contextlib.contextmanager
def same_on_every_rank(rank: int):
    """Around code whose UserErrors every rank meets alike (a config, a broadcast decision, the
    shared checkpoint verification, the same files): rank 0 reports them, the others stay quiet."""
    try:
        yield
    except UserError as e:
        e.quiet = e.quiet or rank != 0
        raise


class Parallel:
    """This process's place in the data x expert parallel layout (all ranks read different data;
    consecutive groups of dispatch.ep_size ranks share one copy of the routed experts).

    world, rank: all processes (torchrun's WORLD_SIZE, RANK); ep_group: this rank's EP group (None
    on one process); ep_rank = rank % ep_size; expert_dp_group: the ranks holding the same expert
    shard (rank % ep_size equal), over which the experts' gradients are summed; None when alone.
    ranks_per_node: the node size (`ranks_per_node`); spans_nodes: the EP group holds several
    nodes; node_groups: (this rank's node group, its local-rank group) inside the EP group for
    dispatch.hierarchical, else None. grad_group: the group the replicated parameters' gradients are
    summed over, all ranks: None (the default group) unless train.grad_reduce_ctas caps its NCCL CTAs
    (then a communicator of its own, as are the expert_dp_groups)."""

    def __init__(self, cfg: Config, device: torch.device):
        self.world, self.rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
        self.device = device  # where the collectives' tensors live (NCCL: CUDA only)
        ep, d = cfg.dispatch.ep_size, cfg.dispatch
        check_parallel(cfg, self.world)
        self.ep_size, self.ep_rank = ep, self.rank % ep
        self.ep_group = self.expert_dp_group = self.node_groups = self.grad_group = None
        self.ranks_per_node = ranks_per_node(cfg, self.world)
        self.spans_nodes = ep > self.ranks_per_node and ep % self.ranks_per_node == 0
        if self.world == 1:
            return
        # Every collective of every group waits at most this long for its peers (a dead or hung
        # rank on another node); gloo then raises, NCCL's watchdog aborts the process.
        timeout = datetime.timedelta(seconds=cfg.train.dist_timeout_s)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timeout)
        # new_group is collective: every rank creates every group, in order, each with the timeout
        # (new_group's default is 30 min for gloo, 10 for NCCL, not the world's).
        if d.backend != "local":
            self.ep_group = build_ep_group(self.world, ep, cfg.model.n_experts, timeout, d.nccl_ctas)
        if d.hierarchical:
            from moefp8.dispatch.hierarchical import build_node_groups

            self.node_groups = build_node_groups(self.world, ep, self.ranks_per_node, timeout)
        grad_opts = None  # train.grad_reduce_ctas: the gradient reductions' communicators capped
        if cfg.train.grad_reduce_ctas and dist.get_backend() == "nccl":
            grad_opts = dist.ProcessGroupNCCL.Options()
            grad_opts.config.min_ctas, grad_opts.config.max_ctas = 1, cfg.train.grad_reduce_ctas
            self.grad_group = dist.new_group(list(range(self.world)), timeout=timeout, pg_options=grad_opts)
        for r in range(ep):
            g = dist.new_group(list(range(r, self.world, ep)), timeout=timeout, pg_options=grad_opts)
            if r == self.ep_rank:
                self.expert_dp_group = g
        # rank 0's long jobs before training (data preparation at first use: minutes, more for a large
        # corpus) are waited for on a CPU group without a practical time limit: on the world's group the
        # waiting ranks' broadcast would end the run at train.dist_timeout_s (NCCL's watchdog)
        self.slow_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=SLOW_WAIT_S))

    def __enter__(self) -> "Parallel":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """Ends the process group after the run or a UserError (every rank reports and exits); a
        bug's exception or a RankError leaves it to the process's exit (a peer may be stuck in a collective)."""
        if self.world > 1 and (exc is None or (isinstance(exc, UserError) and not isinstance(exc, RankError))):
            dist.destroy_process_group()

    def all_reduce_(self, x: torch.Tensor, group=None) -> torch.Tensor:
        if self.world > 1:
            dist.all_reduce(x, group=group)
        return x

    def on_main(self, fn, slow: bool = False):
        """fn() on rank 0 alone; its result there (None on the other ranks). Whatever it raises is
        raised on every rank: its UserError as it is on rank 0 and as a quiet copy (the same
        message, not printed again) on the others, so that each rank exits with one report. Other
        exceptions (bugs) are raised on rank 0 with their traceback, quietly elsewhere. slow: fn may
        take longer than train.dist_timeout_s (data preparation): the others wait up to SLOW_WAIT_S."""
        out, err = None, None
        if self.rank == 0:
            try:
                out = fn()
            except Exception as e:  # noqa: BLE001 - told to the other ranks, then raised here
                err = e
        if self.world > 1:
            box = [None if err is None else (str(err) if isinstance(err, UserError)
                                             else f"rank 0 failed: {type(err).__name__}: {first_line(err)}")]
            dist.broadcast_object_list(box, group=self.slow_group if slow else None)
            if box[0] is not None and self.rank != 0:
                raise UserError(box[0], quiet=True)
        if err is not None:
            raise err
        return out


def file_digest(path) -> str | None:
    """sha256 of a file's bytes; None where it cannot be read (missing, a folder, no permission)."""
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return None


def same_file(path, what: str, fix: str, rank: int, world: int, digest=file_digest) -> None:
    """Multi-node runs: every rank reads `path` (the same path string on every node) and must find
    what rank 0 finds (`digest` of it, not None), or every rank raises the same UserError naming the
    first rank and host that differ (reported by rank 0, quiet elsewhere). Catches a run dir or
    data folder on a filesystem that is not shared between the nodes (or differs). One process:
    nothing to compare."""
    if world == 1:
        return
    mine = (digest(path), socket.gethostname())
    box = [None] * world
    dist.all_gather_object(box, mine)
    ref, host0 = box[0]
    for r, (d, host) in enumerate(box):
        if d != ref or d is None:
            seen = "cannot read it" if d is None else "finds other contents"
            raise UserError(f"{what}: rank {r} on {host} {seen} at {path} (rank 0 on {host0} "
                            f"{'cannot read it either' if ref is None else 'wrote or reads it'}); {fix}",
                            quiet=rank != 0)


class StepWatchdog:
    """Multi-process runs: ends the process with one line when no step (or checkpoint save) has
    finished for `limit_s()` seconds, counted from the end of the first step (the first one
    compiles). Collectives already wait at most train.dist_timeout_s, and NCCL's own watchdog is
    meant to take the process down after it, but a rank blocked on a stopped or dead peer may
    stay blocked in a CUDA synchronisation; this thread does not depend on either.

    limit_s = dist_timeout_s + 3 x the slowest step after the first + grace_s (30 s); around a
    checkpoint save `allow(s)` adds s seconds once (the save's collectives have their own timeout).
    With enabled=False (one process) no thread runs and the calls do nothing."""

    def __init__(self, rank: int, dist_timeout_s: float, exit_fn=None, poll_s: float = 1.0, grace_s: float = 30.0,
                 enabled: bool = True):
        self.rank, self.timeout_s, self.poll_s, self.grace_s = rank, dist_timeout_s, poll_s, grace_s
        self.exit_fn = exit_fn or (lambda: os._exit(1))
        self.last = self.slowest = self.extra = None
        self.stop_evt = threading.Event()
        if enabled:
            threading.Thread(target=self._run, name="moefp8-step-watchdog", daemon=True).start()

    def limit_s(self) -> float:
        return self.timeout_s + 3 * (self.slowest or 0.0) + self.grace_s + (self.extra or 0.0)

    def beat(self, step_s: float | None = None) -> None:
        """A step (of step_s seconds) or a save finished: progress. The first step arms the
        watchdog without counting (its compilation would stretch every later limit)."""
        if step_s is not None and self.last is not None:
            self.slowest = max(self.slowest or 0.0, step_s)
        self.last, self.extra = time.monotonic(), None

    def allow(self, extra_s: float) -> None:
        self.extra = extra_s

    def stop(self) -> None:
        self.stop_evt.set()

    def __enter__(self) -> "StepWatchdog":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _run(self) -> None:
        while not self.stop_evt.wait(self.poll_s):
            if self.last is not None and time.monotonic() - self.last > self.limit_s():
                print(f"error: rank {self.rank}: no training step finished in {self.limit_s():.0f} s "
                      f"(train.dist_timeout_s={self.timeout_s:g} s + 3 x the slowest step + {self.grace_s:g} s): "
                      f"a peer rank died or hangs, or a collective is stuck; stopping", file=sys.stderr, flush=True)
                self.exit_fn()
                return

