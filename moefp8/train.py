"""MoE pretraining entry point: `python -m moefp8.train [hydra overrides]` (README "Training").

    python -m moefp8.train                                  # tiny model on CPU (small on a GPU)
    python -m moefp8.train model=small recipe=bf16 train.steps=1000 optim.lr=3e-4
    python -m moefp8.train train.out_dir=outputs/runs/a train.resume=none

Hydra composes `configs/config.yaml` onto the `moefp8.config.Config` schema; the result is
converted once into dataclasses (`OmegaConf.to_object`) and checked by `validate`; nothing below
this file sees Hydra. Everything a run writes lives in its run dir `train.out_dir` (identical on
every rank, computed from the config): config.yaml, metrics.jsonl (one JSON line per step),
starts.jsonl (one line per start: step, date, commit, device, world size, host, boot id), step_N/
checkpoints + `latest`, wandb/ (offline by default). `train.resume=auto` continues from the
newest complete checkpoint there.

One loop (`train`): per step, grad_accum micro-batches (loss + the routers' balance losses,
backward), non-finite check, global-norm clipping, AdamW on the fp32 masters, then the routers'
aux-loss-free bias update from the load summed over the step, logging, checkpointing.
Under torchrun every process is a data-parallel rank and consecutive groups of dispatch.ep_size
ranks shard the routed experts (`Parallel`): gradients are averaged over all ranks (the experts'
over the ranks holding the same shard), the expert load is summed over all ranks before the bias
update, and each expert is checkpointed under its global index (resumable under another EP size).

    torchrun --nproc_per_node 4 -m moefp8.train dispatch=all_to_all dispatch.ep_size=4
"""

import datetime
import json
import math
import os
import secrets
import socket
import sys
import threading
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
import torch.distributed as dist
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from moefp8 import checkpoint
from moefp8.config import Config, bf16_linears, validate
from moefp8.data import Loader, prepare
from moefp8.dispatch import DEEPEP_INSTALL, build_dispatcher, build_ep_group, node_limited_groups
from moefp8.fp8 import SCALE_STATS
from moefp8.hydra_config import CONFIG_DIR, first_line, load_config, register_schema
from moefp8.model import Transformer, flops_per_token, param_counts
from moefp8.optim import AdamW, clip_grad_norm, lr_at
from moefp8.router import load_stats
from moefp8.testing import boot_id, git_commit

# Dense BF16 peak of the GPU (SXM), TFLOP/s: MFU is reported against it for both recipes.
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "B200": 2250.0, "A100": 312.0}


class Diverged(RuntimeError):
    """A non-finite loss or gradient norm under nan_policy=stop (the message names the stage)."""


class DataError(ValueError):
    """The training data cannot be read (the message names the file)."""


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("train.device='cuda': no CUDA device is available (use train.device=auto or cpu)")
    return torch.device(name)


def check_gpus(device: torch.device, local_rank: int, visible: int, nproc: int) -> None:
    """More processes on this node than GPUs it can see (torchrun's LOCAL_RANK / LOCAL_WORLD_SIZE
    against torch.cuda.device_count()): ValueError before any CUDA or NCCL call."""
    if device.type == "cuda" and max(local_rank + 1, nproc) > visible:
        cvd = os.environ.get("CUDA_VISIBLE_DEVICES", "unset")
        raise ValueError(f"train.device=cuda: {max(local_rank + 1, nproc)} processes on this node but only "
                         f"{visible} GPU(s) visible (CUDA_VISIBLE_DEVICES={cvd}); launch at most {visible} per "
                         f"node (torchrun --nproc_per_node {visible})")


def check_launch(cfg: Config, env=os.environ) -> None:
    """What the config needs from this machine and launch: the device, one GPU per process, DeepEP
    installed if asked for, the process count (ValueError naming the value)."""
    device = resolve_device(cfg.train.device)
    if device.type == "cuda":
        check_gpus(device, int(env.get("LOCAL_RANK", "0")), torch.cuda.device_count(),
                   int(env.get("LOCAL_WORLD_SIZE", "1")))
    if cfg.dispatch.backend == "deepep":
        try:
            import deep_ep  # noqa: F401
        except ImportError as e:
            raise ValueError(f"dispatch=deepep: `import deep_ep` failed ({e}). {DEEPEP_INSTALL}") from None
    check_parallel(cfg, int(env.get("WORLD_SIZE", "1")))
    routing_config(cfg, int(env.get("WORLD_SIZE", "1")), env)  # node-limited routing fits the topology


def peak_flops(cfg: Config, device: torch.device) -> float | None:
    if cfg.train.peak_tflops > 0:
        return cfg.train.peak_tflops * 1e12
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, tf in PEAK_BF16_TFLOPS.items():
            if key in name:
                return tf * 1e12
    return None  # CPU or an unknown GPU: no MFU


def ensure_data(cfg: Config, console: Console) -> None:
    """Prepares data.path from data.prepare_from on first use (rank 0 only; the others wait)."""
    if os.path.exists(os.path.join(cfg.data.path, "index.json")):
        return
    console.print(f"data: preparing {cfg.data.path} from {cfg.data.prepare_from!r} ({cfg.data.glob}, "
                  f"<= {cfg.data.max_bytes / 1e6:.0f} MB)")
    idx = prepare(cfg.data.prepare_from, cfg.data.path, cfg.data.glob, cfg.data.max_bytes)
    console.print(f"data: {idx['files']} files, {idx['bytes'] / 1e6:.1f} MB, {len(idx['shards'])} shard(s)")


def config_changes(old_path: Path, new_yaml: str) -> list[str]:
    """One line `key: old -> new` per config value that differs between the YAML a run dir was last
    started with and this start's (keys only one side has count too); [] without an old YAML."""
    if not old_path.is_file():
        return []
    from omegaconf import OmegaConf

    def flat(d, prefix=""):
        out = {}
        for k, v in d.items():
            out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
        return out

    try:
        old = flat(OmegaConf.to_container(OmegaConf.load(old_path)))
    except Exception as e:  # noqa: BLE001 - an unreadable old copy is not a reason to stop training
        return [f"{old_path} unreadable ({first_line(e)})"]
    new = flat(OmegaConf.to_container(OmegaConf.create(new_yaml)))
    missing = "(absent)"
    return [f"{k}: {old.get(k, missing)} -> {new.get(k, missing)}" for k in sorted(old.keys() | new.keys())
            if old.get(k, missing) != new.get(k, missing)]


def start_wandb(cfg: Config, run_dir: Path, is_main: bool):
    if not is_main or cfg.logger.mode == "disabled":
        return None
    import wandb

    os.environ.setdefault("WANDB_SILENT", "true")
    # One wandb run per run dir: its id is kept in the run dir, so a resumed training continues the
    # same wandb run (resume="allow") instead of starting a new one at every restart.
    id_file = run_dir / "wandb_run_id"
    run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(4)  # wandb: [a-z0-9]
    if not id_file.is_file():
        tmp = id_file.with_suffix(".tmp")
        tmp.write_text(run_id + "\n")
        os.replace(tmp, id_file)
    return wandb.init(project=cfg.logger.project, name=cfg.logger.name or run_dir.name, dir=str(run_dir),
                      mode=cfg.logger.mode, config=asdict(cfg), id=run_id, resume="allow")


def check_parallel(cfg: Config, world: int) -> None:
    """The checks that need the process count (torchrun's WORLD_SIZE): ValueError naming the value."""
    ep, backend = cfg.dispatch.ep_size, cfg.dispatch.backend
    if backend != "local" and world == 1:
        raise ValueError(f"dispatch={backend}: expert parallelism needs several processes (torchrun "
                         f"--nproc_per_node N -m moefp8.train ...); use dispatch=local on one process")
    if world % ep:
        raise ValueError(f"dispatch.ep_size={ep}: does not divide the {world} processes")


def dispatch_capacity(cfg: Config) -> int:
    """The most tokens a rank passes to one dispatch (the all_to_all capacity mode's blocks):
    dispatch.capacity, else micro_batch x seq_len; under the overlap its larger micro-batch: half
    the sequences (rounded up; moefp8.overlap.OverlappedBlock), or half of a lone sequence."""
    if cfg.dispatch.capacity:
        return cfg.dispatch.capacity
    B, S = cfg.train.micro_batch, cfg.train.seq_len
    if not cfg.dispatch.overlap:
        return B * S
    return -(-B // 2) * S if B > 1 else -(-S // 2)


def routing_config(cfg: Config, world: int, env=os.environ):
    """cfg.model with the router's groups set for node-limited routing (dispatch.max_nodes: one
    group per node of the EP group, `dispatch.node_limited_groups`); cfg.model itself when off.
    ValueError naming the value when the topology does not allow it."""
    d = cfg.dispatch
    if not d.max_nodes:
        return cfg.model
    rpn = d.ranks_per_node or int(env.get("LOCAL_WORLD_SIZE", world))
    n_groups, topk_groups = node_limited_groups(d.ep_size, rpn, cfg.model.n_experts, cfg.model.topk, d.max_nodes)
    return replace(cfg.model, n_groups=n_groups, topk_groups=topk_groups)


class Parallel:
    """This process's place in the data x expert parallel layout (all ranks read different data;
    consecutive groups of dispatch.ep_size ranks share one copy of the routed experts).

    world, rank: all processes (torchrun's WORLD_SIZE, RANK); ep_group: this rank's EP group (None
    on one process); ep_rank = rank % ep_size; expert_dp_group: the ranks holding the same expert
    shard (rank % ep_size equal), over which the experts' gradients are summed; None when alone."""

    def __init__(self, cfg: Config, device: torch.device):
        self.world, self.rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
        ep, d = cfg.dispatch.ep_size, cfg.dispatch
        check_parallel(cfg, self.world)
        self.ep_size, self.ep_rank = ep, self.rank % ep
        self.ep_group = self.expert_dp_group = None
        if self.world == 1:
            return
        # Every collective of every group waits at most this long for its peers (a dead or hung
        # rank on another node); gloo then raises, NCCL's watchdog aborts the process.
        timeout = datetime.timedelta(seconds=cfg.train.dist_timeout_s)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timeout)
        # new_group is collective: every rank creates every group, in order, each with the timeout
        # (new_group's default is 30 min for gloo, 10 for NCCL, not the world's).
        if d.backend != "local":
            self.ep_group = build_ep_group(self.world, ep, cfg.model.n_experts, timeout)
        for r in range(ep):
            g = dist.new_group(list(range(r, self.world, ep)), timeout=timeout)
            if r == self.ep_rank:
                self.expert_dp_group = g

    def all_reduce_(self, x: torch.Tensor, group=None) -> torch.Tensor:
        if self.world > 1:
            dist.all_reduce(x, group=group)
        return x


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


def expert_keys(sd: dict, names: list[str], offset: int) -> dict:
    """A state dict with each routed expert tensor [E_l, ...] replaced by one entry per expert,
    keyed by its global index (`layers.1.mlp.w1.expert5`, views sharing the storage): DCP then
    saves each expert once from the rank that holds it, and loads it into whichever rank holds it
    under any EP size."""
    out = dict(sd)
    for n in names:
        t = out.pop(n)
        out.update({f"{n}.expert{offset + e}": t[e] for e in range(t.shape[0])})
    return out


def model_state(model: Transformer, opt: AdamW) -> dict:
    """The checkpointed model and optimizer state: {"model": ..., "optim": {"step", "exp_avg",
    "exp_avg_sq"}} with the routed experts keyed per global expert (`expert_keys`)."""
    names, off = model.routed_expert_names(), model.expert_offset
    optim = opt.state_dict()
    return {"model": expert_keys(model.state_dict(), names, off),
            "optim": {**optim, "exp_avg": expert_keys(optim["exp_avg"], names, off),
                      "exp_avg_sq": expert_keys(optim["exp_avg_sq"], names, off)}}


def locate_nonfinite(model: Transformer, nonfinite_S: torch.Tensor) -> str:
    """Where a step's NaN/Inf came from, for the error message (called only after the loss or the
    gradient norm came out non-finite, so the host syncs here cost nothing in a healthy run):
    the first stage (in forward order) whose output was non-finite, else the parameter whose
    gradient went non-finite first in backward order (the last in forward order)."""
    bad = [name for name, f in zip(model.stages(), nonfinite_S.tolist()) if f]
    if bad:
        return f"first non-finite activation: {bad[0]} output" + (f" (then {len(bad) - 1} later stage(s))"
                                                                   if len(bad) > 1 else "")
    grads = [n for n, p in model.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
    if grads:
        return (f"activations finite; first non-finite gradient (backward order): {grads[-1]}"
                + (f" (and {len(grads) - 1} earlier parameter(s))" if len(grads) > 1 else ""))
    return "activations and gradients of this rank finite"


def memory_mb(device: torch.device) -> dict:
    """This process's resident memory and (CUDA) the caching allocator's allocated / reserved
    bytes, in MB: host counters, no device sync."""
    out = {}
    try:
        with open("/proc/self/statm") as f:
            out["rss_mb"] = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        pass
    if device.type == "cuda":
        out["cuda_alloc_mb"] = torch.cuda.memory_allocated(device) / 2**20
        out["cuda_reserved_mb"] = torch.cuda.memory_reserved(device) / 2**20
    return out


def train(cfg: Config) -> dict:
    """Runs (or resumes) the training described by a validated config, on one process or as one
    rank under torchrun; returns the last step's metrics. Raises Diverged on a non-finite loss
    under nan_policy=stop."""
    t, o = cfg.train, cfg.optim
    if t.deterministic:  # before the first cuBLAS call; GPU runs (and resumes) then repeat bit for bit
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)  # an op without a deterministic kernel warns, naming it
    device = resolve_device(t.device)
    if device.type == "cuda" and "LOCAL_RANK" in os.environ:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    par = Parallel(cfg, device)
    world, rank, is_main = par.world, par.rank, par.rank == 0
    console = Console(soft_wrap=True, quiet=not is_main)
    run_dir = Path(t.out_dir)  # the same path on every rank: computed from the config
    changed = []  # what differs from the config this run dir was last started with (told on resume)
    if is_main:
        from omegaconf import OmegaConf  # only to write the resolved config as YAML

        run_dir.mkdir(parents=True, exist_ok=True)
        new_yaml = OmegaConf.to_yaml(OmegaConf.structured(cfg))
        changed = config_changes(run_dir / "config.yaml", new_yaml)
        (run_dir / "config.yaml").write_text(new_yaml)
        ensure_data(cfg, console)
    if world > 1:
        dist.barrier()  # the run dir and the data exist
    torch.manual_seed(t.seed)
    try:
        loader = Loader(cfg.data.path, t.micro_batch, t.seq_len, rank, world, t.seed, cfg.data.val_windows)
    except (OSError, ValueError) as e:  # missing / empty / truncated shard, index, too little data
        raise DataError(str(e)) from e
    dispatcher = build_dispatcher(cfg.dispatch.backend, cfg.model.n_experts, par.ep_group, cfg.recipe.scale_fmt,
                                  capacity=dispatch_capacity(cfg), mode=cfg.dispatch.mode,
                                  transport=cfg.dispatch.transport, slots=cfg.dispatch.slots)
    model = Transformer(routing_config(cfg, world), cfg.recipe.recipe, cfg.recipe.scale_fmt, dispatcher, par.ep_rank,
                        t.seed, overlap=cfg.dispatch.overlap, bf16_linears=bf16_linears(cfg.recipe)).to(device)
    opt = AdamW(model.named_parameters(), o)
    sharded = set(model.routed_expert_names()) if par.ep_size > 1 else set()
    replicated_params = [p for n, p in opt.params.items() if n not in sharded]
    sharded_params = [p for n, p in opt.params.items() if n in sharded]
    n = param_counts(cfg.model)
    tokens_per_step = t.micro_batch * t.seq_len * t.grad_accum * world
    fpt, peak = flops_per_token(cfg.model, t.seq_len), peak_flops(cfg, device)

    def mfu_at(tokens_per_s: float) -> float:  # only where peak is known (nonzero)
        return fpt * tokens_per_s / (peak * world)

    def state(step: int) -> dict:  # everything a resume needs; tensors are loaded into in place
        rng = {"cpu": torch.get_rng_state()}  # rank 0's (the ranks share the seed; training draws none)
        if device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(device)
        return {**model_state(model, opt), "data": loader.state_dict(), "rng": rng, "step": step}

    start = 0
    ckpt = checkpoint.find_latest(run_dir) if t.resume == "auto" else None if t.resume in ("none", "") else Path(
        t.resume)
    if ckpt is not None:
        st = state(0)
        checkpoint.load(ckpt, st, optional=("data.val_windows",))  # in place: model, moments, expert views
        opt.step_count = st["optim"]["step"]
        try:  # (a checkpoint from before data.val_windows existed: none held out)
            loader.load_state_dict(st["data"])
        except ValueError as e:
            raise DataError(f"checkpoint {ckpt}: {e}") from None
        torch.set_rng_state(st["rng"]["cpu"])
        if "cuda" in st["rng"]:
            torch.cuda.set_rng_state(st["rng"]["cuda"], device)
        start = st["step"]
        console.print(f"resumed from {ckpt} at step {start}")
        if changed:  # e.g. train.steps raised on purpose, or a default that changed between versions
            console.print(f"config changes since this run dir was last started: {'; '.join(changed)}")
    metrics_path = run_dir / "metrics.jsonl"
    if is_main:  # keep the history up to the resumed step: drop steps a killed run logged past it
        kept = []  # and a line it was killed while writing; rewritten atomically
        for line in (metrics_path.read_text().splitlines() if metrics_path.exists() and start else []):
            try:
                if json.loads(line)["step"] <= start:
                    kept.append(line)
            except (json.JSONDecodeError, KeyError, TypeError):
                pass
        tmp = metrics_path.with_name(metrics_path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, metrics_path)
        with open(run_dir / "starts.jsonl", "a") as f:  # where and from what each start of this run ran
            now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
            gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
            f.write(json.dumps({"step": start, "date": now, "commit": git_commit(), "device": gpu, "world": world,
                                "ep": par.ep_size, "host": socket.gethostname(), "boot": boot_id(),
                                "torch": torch.__version__}) + "\n")
    if start >= t.steps:
        console.print(f"{run_dir}: already at step {start} >= train.steps={t.steps}; nothing to do "
                      f"(raise train.steps, or pick a new train.out_dir)")
        return {"step": start}
    console.print(f"model {cfg.model.name}: {n['total'] / 1e6:.2f}M parameters, {n['active'] / 1e6:.2f}M active; "
                  f"recipe {cfg.recipe.recipe}; {device} x {world} (EP {par.ep_size}); {tokens_per_step} "
                  f"tokens/step; run dir {run_dir}")
    epoch = loader.steps_per_epoch(t.grad_accum)
    held = f" (+{len(loader.val_ids)} held out)" if len(loader.val_ids) else ""
    console.print(f"data: {loader.n_windows} training windows of {t.seq_len + 1} tokens{held}: an epoch is {epoch} "
                  f"steps" + (f"; train.steps={t.steps} reads it {t.steps / epoch:.2f} times" if t.steps > epoch else ""))
    run = start_wandb(cfg, run_dir, is_main)
    progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                        TextColumn("{task.fields[info]}"), console=console,
                        disable=not (t.progress and is_main and console.is_terminal))
    task = progress.add_task("train", total=t.steps, completed=start, info="")
    began = time.monotonic()  # for train.time_limit_s
    last_saved, m = None, {}
    span_steps, span_s = 0, 0.0  # training time (no eval, no saves) of the steps since the last console line
    watchdog = StepWatchdog(rank, t.dist_timeout_s, enabled=world > 1)
    with progress, watchdog, open(metrics_path, "a") if is_main else open(os.devnull, "w") as mf:
        for step in range(start, t.steps):
            t0 = time.perf_counter()
            lr = lr_at(step, o, t.steps)
            loss_sum = torch.zeros((), device=device)
            aux_sum = torch.zeros((), device=device)
            load_LE = nonfinite_S = None
            SCALE_STATS.on = (cfg.recipe.recipe == "fp8" and t.fp8_stats_every > 0
                              and ((step + 1) % t.fp8_stats_every == 0 or step == start))
            for _ in range(t.grad_accum):
                x, y = loader.next()
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                out = model(x, y)
                ((out.out + out.aux_loss) / t.grad_accum).backward()
                loss_sum += out.out.detach()
                aux_sum += out.aux_loss.detach()
                load_LE = out.load_LE if load_LE is None else load_LE + out.load_LE
                nonfinite_S = out.nonfinite if nonfinite_S is None else nonfinite_S | out.nonfinite
            if world > 1:  # gradients of the mean loss over all ranks' tokens
                for name, p in opt.params.items():  # one collective per tensor: bucketing is for later
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    par.all_reduce_(p.grad, par.expert_dp_group if name in sharded else None).div_(world)
                par.all_reduce_(loss_sum).div_(world)
                par.all_reduce_(aux_sum).div_(world)
                par.all_reduce_(load_LE)  # tokens per expert over all ranks: the same bias update everywhere
            SCALE_STATS.on = False
            gnorm = clip_grad_norm(replicated_params, o.grad_clip, sharded_params, par.ep_group)
            loss, aux, gn = (loss_sum / t.grad_accum).item(), (aux_sum / t.grad_accum).item(), gnorm.item()
            if not (math.isfinite(loss) and math.isfinite(gn)):  # the same values on every rank
                where = locate_nonfinite(model, par.all_reduce_(nonfinite_S.int()))  # any rank's stages
                msg = (f"step {step + 1}: non-finite loss {loss} or grad norm {gn} (lr {lr:.3g}); {where}; "
                       f"last good checkpoint: {last_saved or checkpoint.find_latest(run_dir) or 'none'}")
                if t.nan_policy == "stop":
                    raise Diverged(msg + ". Stopped (train.nan_policy=stop).")
                console.print(f"[yellow]{msg}; step skipped (train.nan_policy=skip)")
                SCALE_STATS.report()  # dropped with the step
                opt.zero_grad()
                watchdog.beat()
                continue
            opt.step(lr)
            opt.zero_grad()
            for router, load_E in zip(model.routers(), load_LE):  # the step's summed load per layer
                router.update_bias(load_E)
            dt = time.perf_counter() - t0
            watchdog.beat(dt)
            span_steps, span_s = span_steps + 1, span_s + dt
            stats = [load_stats(l) for l in load_LE]
            m = {"step": step + 1, "loss": loss, "aux_loss": aux, "lr": lr, "grad_norm": gn,
                 "tokens_per_s": tokens_per_step / dt, "step_time_s": dt,
                 "load_max_over_mean": max((s["load_max_over_mean"] for s in stats), default=0.0),
                 "experts_empty": sum(s["experts_empty"] for s in stats), **memory_mb(device),
                 **SCALE_STATS.report()}  # this rank's FP8 tile scales, on stats steps (train.fp8_stats_every)
            if peak:
                m["mfu"] = mfu_at(m["tokens_per_s"])
            if t.eval_every and ((step + 1) % t.eval_every == 0 or step + 1 == t.steps):
                watchdog.allow(t.dist_timeout_s)  # not a step: its own collectives, its own time
                m["val_loss"] = evaluate(model, loader, device, par)
                watchdog.beat()
            mf.write(json.dumps(m) + "\n")
            mf.flush()
            if run is not None:
                run.log({**m, **{f"load/max_over_mean/layer{i}": s["load_max_over_mean"]
                                 for i, s in enumerate(stats)}}, step=step + 1)
            val = f" val {m['val_loss']:.4f}" if "val_loss" in m else ""
            # throughput of the steps since the last console line, not of this step alone: on the FP8 recipe the
            # logged step is also the scale-statistics step (train.fp8_stats_every), ~1.3x slower
            tps = tokens_per_step * span_steps / span_s
            info = f"loss {loss:.4f}{val} lr {lr:.2e} {tps:,.0f} tok/s"
            progress.update(task, completed=step + 1, info=info)
            if (step + 1) % t.log_every == 0 or step + 1 == t.steps or step == start:
                mfu = f" mfu {mfu_at(tps):.1%}" if peak else ""
                console.print(f"step {step + 1:>6}/{t.steps} loss {loss:.4f}{val} aux {aux:.2e} lr {lr:.2e} "
                              f"gnorm {gn:.3f} {tps:,.0f} tok/s{mfu} "
                              f"load max/mean {m['load_max_over_mean']:.2f} empty {m['experts_empty']}{fp8_line(m)}")
                span_steps, span_s = 0, 0.0
            stop = step + 1 < t.steps and time_is_up(t.time_limit_s, began, par, device)
            if (t.ckpt_every and (step + 1) % t.ckpt_every == 0) or step + 1 == t.steps or stop:
                watchdog.allow(t.dist_timeout_s)  # a save's collectives wait at most that long each
                last_saved = checkpoint.save(run_dir, step + 1, state(step + 1),
                                             {"loss": loss, "tokens": (step + 1) * tokens_per_step,
                                              "world": world, "ep_size": par.ep_size}, is_writer=is_main)
                console.print(f"checkpoint {last_saved}")
                watchdog.beat()
            if stop:
                console.print(f"train.time_limit_s={t.time_limit_s:g} reached after step {step + 1} of {t.steps}; "
                              f"the same command resumes from {last_saved}")
                break
    if run is not None:
        run.finish()
    if world > 1:
        dist.destroy_process_group()
    return m


def time_is_up(limit_s: float, began: float, par: Parallel, device: torch.device) -> bool:
    """Whether this start's wall-clock budget is spent, the same answer on every rank (any rank's
    clock past it counts: one small all-reduce per step, only with a limit)."""
    if not limit_s:
        return False
    up = torch.tensor(float(time.monotonic() - began > limit_s), device=device)
    if par.world > 1:
        par.all_reduce_(up)
    return bool(up.item())


@torch.no_grad()
def evaluate(model: Transformer, loader: Loader, device: torch.device, par: Parallel) -> float:
    """Mean loss over the held-out windows (data.val_windows; every rank its share, the same
    number of batches on each, so the EP exchanges pair up), averaged over all ranks."""
    total, n = torch.zeros((), device=device), 0
    for x, y in loader.val_batches():
        total += model(x.to(device, non_blocking=True), y.to(device, non_blocking=True)).out
        n += 1
    if par.world > 1:
        par.all_reduce_(total).div_(par.world)
    return (total / n).item()


def fp8_line(m: dict) -> str:
    """The console's summary of a stats step's FP8 scales: typical log2 scale of activation and
    gradient tiles, and the share of gradient tiles at the amax-clamp floor."""
    if "fp8/grad_tiles" not in m or "fp8/act_log2_scale_mean" not in m:
        return ""
    return (f" | fp8 log2 scale act {m['fp8/act_log2_scale_mean']:.1f} grad {m.get('fp8/grad_log2_scale_mean', 0):.1f},"
            f" grad tiles at floor {m['fp8/grad_at_floor']:.1%}")


def _comm_failure(e: BaseException) -> bool:
    """A collective that failed because a peer died, hung past train.dist_timeout_s or closed its
    connection (gloo raises a plain RuntimeError naming its transport; NCCL a DistError)."""
    while e is not None:
        if isinstance(e, dist.DistError) or (isinstance(e, RuntimeError) and any(
                s in str(e) for s in ("gloo/transport", "Connection reset by peer", "Connection closed by peer",
                                      "Timed out waiting"))):
            return True
        e = e.__cause__ or e.__context__
    return False


def _main() -> None:
    import hydra
    from hydra._internal.utils import get_args_parser
    from omegaconf import OmegaConf

    args = get_args_parser().parse_args()  # what @hydra.main parses (exits with usage on a bad flag)
    env, pre = os.environ, None
    if not (args.help or args.hydra_help or args.cfg or args.info or args.shell_completion or args.multirun):
        try:  # compose once here: any config problem is one line, before Hydra's own (multi-line) report
            pre = load_config(args.overrides, auto_model=True)
            check_launch(pre, env)
        except ValueError as e:
            sys.exit(f"config error: {e}")
    register_schema()

    @hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="config")
    def entry(dcfg) -> None:  # --cfg/--help/--info are answered by Hydra before this runs
        rank, world = int(env.get("RANK", "0")), int(env.get("WORLD_SIZE", "1"))
        cfg = pre
        try:
            if cfg is None:  # --multirun: one job per composed config
                cfg = OmegaConf.to_object(dcfg)
                validate(cfg)
                check_launch(cfg, env)
        except ValueError as e:
            sys.exit(f"config error: {e}")
        try:
            train(cfg)
        except (Diverged, checkpoint.CheckpointError, DataError) as e:
            sys.exit(f"error: {e}")
        except Exception as e:
            if world == 1 or not _comm_failure(e):
                raise
            # a peer is gone: no clean shutdown of the process group is possible (it could hang)
            print(f"error: rank {rank}: a collective failed, a peer rank died or hangs (collectives wait "
                  f"at most train.dist_timeout_s={cfg.train.dist_timeout_s:g} s): {first_line(e)}",
                  file=sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(1)

    entry()


if __name__ == "__main__":
    _main()
