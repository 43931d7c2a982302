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

import contextlib
import datetime
import hashlib
import json
import math
import os
import secrets
import socket
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
import torch.distributed as dist
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from moefp8 import checkpoint
from moefp8.config import Config, bf16_linears, validate
from moefp8.data import DataError, Loader, ensure
from moefp8.dispatch import DEEPEP_INSTALL, build_dispatcher, node_limited_groups
from moefp8.errors import EXIT_INTERRUPTED, EXIT_STOPPED, UserError, first_line, report
from moefp8.fp8 import SCALE_STATS
from moefp8.hydra_config import CONFIG_DIR, config_help, load_config, register_schema
from moefp8.model import Transformer, flops_per_token, param_counts
from moefp8.optim import AdamW, clip_grad_norm, lr_at
from moefp8.parallel import Parallel, StepWatchdog, check_parallel  # noqa: F401 (StepWatchdog: tests)
from moefp8.router import load_stats
from moefp8.rundir import RunLock, open_run_dir
from moefp8.stop import StopSignals
from moefp8.testing import boot_id, git_commit

# Dense BF16 peak of the GPU (SXM), TFLOP/s: MFU is reported against it for both recipes.
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "B200": 2250.0, "A100": 312.0}


class Diverged(UserError):
    """A non-finite loss or gradient norm under nan_policy=stop, or more than
    train.max_skipped_steps skipped steps in a row under skip (the message names the stage and the
    last good checkpoint)."""


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
    installed if asked for, the process count, a dispatch capacity that holds a micro-batch, GPUs
    for the copy-engine transport, a wandb key for logger.mode=online (ValueError naming the value)."""
    device = resolve_device(cfg.train.device)
    if device.type == "cuda":
        check_gpus(device, int(env.get("LOCAL_RANK", "0")), torch.cuda.device_count(),
                   int(env.get("LOCAL_WORLD_SIZE", "1")))
    d = cfg.dispatch
    if d.backend == "deepep":
        try:
            import deep_ep  # noqa: F401
        except ImportError as e:
            raise ValueError(f"dispatch=deepep: `import deep_ep` failed ({e}). {DEEPEP_INSTALL}") from None
    if d.transport == "copy_engine" and device.type != "cuda":
        raise ValueError(f"dispatch.transport=copy_engine: copies between GPUs, but this run is on the {device.type} "
                         f"(train.device={cfg.train.device}); use dispatch.transport=collective")
    need = dispatch_capacity(replace(cfg, dispatch=replace(d, capacity=0)))
    if d.capacity and d.capacity < need and d.backend != "local":
        t = cfg.train
        raise ValueError(f"dispatch.capacity={d.capacity}: smaller than the {need} tokens a rank passes to one dispatch "
                         f"(train.micro_batch x train.seq_len = {t.micro_batch} x {t.seq_len}"
                         f"{', halved by dispatch.overlap' if d.overlap else ''}); set dispatch.capacity >= {need}, "
                         f"or 0 to size it from the batch")
    if cfg.logger.mode == "online" and not wandb_key(env):
        raise ValueError("logger.mode=online: no wandb API key found (WANDB_API_KEY, or `wandb login`); log in, or "
                         "use logger.mode=offline and upload later with `wandb sync <run dir>/wandb/offline-run-*`")
    check_parallel(cfg, int(env.get("WORLD_SIZE", "1")))
    routing_config(cfg, int(env.get("WORLD_SIZE", "1")), env)  # node-limited routing fits the topology


def wandb_key(env=os.environ) -> bool:
    """Whether wandb will find an API key: WANDB_API_KEY, or the netrc entry `wandb login` writes
    for its host (WANDB_BASE_URL's, api.wandb.ai by default). Read without network or wandb."""
    if env.get("WANDB_API_KEY"):
        return True
    import netrc
    from urllib.parse import urlparse

    host = urlparse(env.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return netrc.netrc(env.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def peak_flops(cfg: Config, device: torch.device) -> float | None:
    if cfg.train.peak_tflops > 0:
        return cfg.train.peak_tflops * 1e12
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, tf in PEAK_BF16_TFLOPS.items():
            if key in name:
                return tf * 1e12
    return None  # CPU or an unknown GPU: no MFU


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


def start_wandb(cfg: Config, run_dir: Path):
    """The wandb run of this run dir (rank 0; None with logger.mode=disabled). One wandb run per run
    dir: its id is kept in `wandb_run_id`, so a resumed training continues the same wandb run
    (resume="allow"). Offline records reach the run's .wandb file every 2 s (wandb's default, 15 s,
    lost up to 15 s of records, all of a short run, to a SIGKILL). A wandb that cannot start is one
    line (UserError)."""
    if cfg.logger.mode == "disabled":
        return None
    import wandb

    os.environ.setdefault("WANDB_SILENT", "true")
    id_file = run_dir / "wandb_run_id"
    run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(4)  # wandb: [a-z0-9]
    if not id_file.is_file():
        tmp = id_file.with_suffix(".tmp")
        tmp.write_text(run_id + "\n")
        os.replace(tmp, id_file)
    flush = {"x_transaction_log_flush_interval": 2.0}  # wandb >= 0.2x; older versions flush at exit only
    settings = wandb.Settings(**{k: v for k, v in flush.items() if k in getattr(wandb.Settings, "model_fields", {})})
    try:
        return wandb.init(project=cfg.logger.project, name=cfg.logger.name or run_dir.name, dir=str(run_dir),
                          mode=cfg.logger.mode, config=asdict(cfg), id=run_id, resume="allow", settings=settings)
    except wandb.errors.Error as e:
        raise UserError(f"logger.mode={cfg.logger.mode}: wandb could not start ({first_line(e)}); fix that, or use "
                        f"logger.mode=offline (or disabled)") from None


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


def find_resume(resume: str, run_dir: Path, say) -> Path | None:
    """The checkpoint this start continues from (train.resume): "auto" the one `latest` names
    (verified; a damaged one stops the run, named), "last_good" the newest one that verifies (each
    newer one passed over is said, with why), "none" nothing, else that step dir. Every rank calls
    this (the verification is shared among them) and gets the same answer or error."""
    if resume == "none":
        return None
    if resume == "auto":
        return checkpoint.find_latest(run_dir, verified=False)  # load() verifies it
    if resume == "last_good":
        path, passed = checkpoint.find_last_good(run_dir)
        for why in passed:
            say(f"[yellow]resume: passed over {why}")
        return path
    return Path(resume)


def record_start(cfg: Config, run_dir: Path, start: int, device: torch.device, par: Parallel, say) -> None:
    """Rank 0, once the checkpoint (if any) has loaded: the run dir's config.yaml (what changed
    since its last start is said), metrics.jsonl cut back to the resumed step (dropping the steps a
    killed run logged past it and a torn last line; rewritten atomically) and a line in starts.jsonl."""
    from omegaconf import OmegaConf  # only to write the resolved config as YAML

    new_yaml = OmegaConf.to_yaml(OmegaConf.structured(cfg))
    changed = config_changes(run_dir / "config.yaml", new_yaml) if start else []
    if changed:  # e.g. train.steps raised on purpose, or a default that changed between versions
        say(f"config changes since this run dir was last started: {'; '.join(changed)}")
    checkpoint.write_atomic(run_dir / "config.yaml", new_yaml)
    metrics_path, kept = run_dir / "metrics.jsonl", []
    for line in (metrics_path.read_text().splitlines() if metrics_path.exists() and start else []):
        try:
            if json.loads(line)["step"] <= start:
                kept.append(line)
        except (json.JSONDecodeError, KeyError, TypeError):
            pass
    checkpoint.write_atomic(metrics_path, "".join(line + "\n" for line in kept))
    with open(run_dir / "starts.jsonl", "a") as f:  # where and from what each start of this run ran
        now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        f.write(json.dumps({"step": start, "date": now, "commit": git_commit(), "device": gpu, "world": par.world,
                            "ep": par.ep_size, "host": socket.gethostname(), "boot": boot_id(),
                            "torch": torch.__version__}) + "\n")


def latest_name(run_dir: Path) -> str:
    """What `latest` names (unverified: for messages), or "none"."""
    try:
        return str(run_dir / (run_dir / "latest").read_text().strip())
    except OSError:
        return "none"


def own_run_dir(t, say) -> RunLock:
    """Rank 0: the run dir created or checked, locked for this run, leftovers of killed saves removed."""
    run_dir = open_run_dir(t.out_dir, t.resume)
    lock = RunLock(run_dir, say)
    lock.acquire()
    for p in checkpoint.remove_partial(run_dir):
        say(f"run dir: removed {p.name}, a checkpoint save that did not finish")
    return lock


@contextlib.contextmanager
def same_on_every_rank(rank: int):
    """Around code whose UserErrors every rank meets alike (a config, a broadcast decision, the
    shared checkpoint verification, the same files): rank 0 reports them, the others stay quiet."""
    try:
        yield
    except UserError as e:
        e.quiet = e.quiet or rank != 0
        raise


def train(cfg: Config) -> dict:
    """Runs (or resumes) the training described by a validated config, on one process or as one
    rank under torchrun; returns the last step's metrics, with "stopped": the signal's name when a
    SIGTERM/SIGINT stopped it (after its checkpoint). Raises a UserError (one line) for what the
    user can fix: a run dir that is unusable or owned by another run, data, a checkpoint, divergence."""
    t = cfg.train
    if t.deterministic:  # before the first cuBLAS call; GPU runs (and resumes) then repeat bit for bit
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)  # an op without a deterministic kernel warns, naming it
    device = resolve_device(t.device)
    if device.type == "cuda" and "LOCAL_RANK" in os.environ:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    par = Parallel(cfg, device)
    console = Console(soft_wrap=True, quiet=par.rank != 0)
    lock = None
    try:
        with StopSignals(quiet=par.rank != 0) as stop:
            with same_on_every_rank(par.rank):
                lock = par.on_main(lambda: own_run_dir(t, console.print))
            out = _train(cfg, par, device, console, stop)
    except UserError:
        if par.world > 1:
            dist.destroy_process_group()
        raise
    finally:
        if lock is not None:
            lock.release()
    if par.world > 1:
        dist.destroy_process_group()
    return out


def _train(cfg: Config, par: Parallel, device: torch.device, console: Console, stop: StopSignals) -> dict:
    """train() inside an owned run dir: set-up, resume, then the loop (module docstring)."""
    t, o = cfg.train, cfg.optim
    world, rank = par.world, par.rank
    run_dir = Path(t.out_dir)  # the same path on every rank: computed from the config
    with same_on_every_rank(rank):
        d = cfg.data
        par.on_main(lambda: ensure(d.path, d.prepare_from, d.glob, d.max_bytes, console.print))
        torch.manual_seed(t.seed)
        try:
            loader = Loader(d.path, t.micro_batch, t.seq_len, rank, world, t.seed, d.val_windows,
                            vocab_size=cfg.model.vocab_size)
        except OSError as e:  # an unreadable shard
            raise DataError(f"data.path={d.path}: {e}") from None
        dispatcher = build_dispatcher(cfg.dispatch.backend, cfg.model.n_experts, par.ep_group, cfg.recipe.scale_fmt,
                                      capacity=dispatch_capacity(cfg), mode=cfg.dispatch.mode,
                                      transport=cfg.dispatch.transport, slots=cfg.dispatch.slots)
        model = Transformer(routing_config(cfg, world), cfg.recipe.recipe, cfg.recipe.scale_fmt, dispatcher,
                            par.ep_rank, t.seed, overlap=cfg.dispatch.overlap,
                            bf16_linears=bf16_linears(cfg.recipe)).to(device)
        opt = AdamW(model.named_parameters(), o)

        def state(step: int) -> dict:  # everything a resume needs; tensors are loaded into in place
            rng = {"cpu": torch.get_rng_state()}  # rank 0's (the ranks share the seed; training draws none)
            if device.type == "cuda":
                rng["cuda"] = torch.cuda.get_rng_state(device)
            return {**model_state(model, opt), "data": loader.state_dict(), "rng": rng, "step": step}

        start, ckpt = 0, find_resume(t.resume, run_dir, console.print)
        if ckpt is not None:
            st = state(0)
            checkpoint.load(ckpt, st, optional=("data.val_windows", "data.data_id"))  # verified; in place: model, moments, experts
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
        if start >= t.steps:  # nothing changes in the run dir
            console.print(f"{run_dir}: already at step {start} >= train.steps={t.steps}; nothing to do "
                          f"(raise train.steps, or pick a new train.out_dir)")
            return {"step": start}
        # the checkpoint has loaded: from here on the run dir changes
        par.on_main(lambda: record_start(cfg, run_dir, start, device, par, console.print))
        wb = par.on_main(lambda: start_wandb(cfg, run_dir))
    return _loop(cfg, par, device, console, stop, model, opt, loader, state, start, wb)


def _loop(cfg, par, device, console, stop, model, opt, loader, state, start, wb) -> dict:
    """The training steps from `start` to train.steps (module docstring)."""
    t, o = cfg.train, cfg.optim
    world, rank, is_main = par.world, par.rank, par.rank == 0
    run_dir = Path(t.out_dir)
    sharded = set(model.routed_expert_names()) if par.ep_size > 1 else set()
    replicated_params = [p for n, p in opt.params.items() if n not in sharded]
    sharded_params = [p for n, p in opt.params.items() if n in sharded]
    n = param_counts(cfg.model)
    tokens_per_step = t.micro_batch * t.seq_len * t.grad_accum * world
    fpt, peak = flops_per_token(cfg.model, t.seq_len), peak_flops(cfg, device)

    def mfu_at(tokens_per_s: float) -> float:  # only where peak is known (nonzero)
        return fpt * tokens_per_s / (peak * world)

    console.print(f"model {cfg.model.name}: {n['total'] / 1e6:.2f}M parameters, {n['active'] / 1e6:.2f}M active; "
                  f"recipe {cfg.recipe.recipe}; {device} x {world} (EP {par.ep_size}); {tokens_per_step} "
                  f"tokens/step; run dir {run_dir}")
    epoch = loader.steps_per_epoch(t.grad_accum)
    held = f" (+{len(loader.val_ids)} held out)" if len(loader.val_ids) else ""
    console.print(f"data: {loader.n_windows} training windows of {t.seq_len + 1} tokens{held}: an epoch is {epoch} "
                  f"steps" + (f"; train.steps={t.steps} reads it {t.steps / epoch:.2f} times" if t.steps > epoch else ""))
    progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                        TextColumn("{task.fields[info]}"), console=console,
                        disable=not (t.progress and is_main and console.is_terminal))
    task = progress.add_task("train", total=t.steps, completed=start, info="")
    began = time.monotonic()  # for train.time_limit_s
    last_saved, m, skipped = None, {}, 0  # skipped: steps skipped in a row (nan_policy=skip)
    span_steps, span_s = 0, 0.0  # training time (no eval, no saves) of the steps since the last console line
    watchdog = StepWatchdog(rank, t.dist_timeout_s, enabled=world > 1)
    with progress, watchdog, open(run_dir / "metrics.jsonl", "a") if is_main else open(os.devnull, "w") as mf:
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
            # stop requests, agreed by every rank in the loss's all-reduce: a signal to any rank, any
            # rank's clock past train.time_limit_s
            flags = [float(stop.requested is not None), float(bool(t.time_limit_s) and
                                                              time.monotonic() - began > t.time_limit_s)]
            sums = torch.cat([torch.stack([loss_sum, aux_sum]), torch.tensor(flags, device=device)])
            if world > 1:  # gradients of the mean loss over all ranks' tokens
                for name, p in opt.params.items():  # one collective per tensor: bucketing is for later
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    par.all_reduce_(p.grad, par.expert_dp_group if name in sharded else None).div_(world)
                par.all_reduce_(sums)
                par.all_reduce_(load_LE)  # tokens per expert over all ranks: the same bias update everywhere
            SCALE_STATS.on = False
            gnorm = clip_grad_norm(replicated_params, o.grad_clip, sharded_params, par.ep_group)
            loss_s, aux_s, signalled, time_up, gn = torch.cat([sums, gnorm.view(1)]).tolist()  # one host sync
            loss, aux = loss_s / world / t.grad_accum, aux_s / world / t.grad_accum
            stopping = stop.requested or ("a signal to another rank" if signalled else None)
            stop_now = bool(signalled) or (bool(time_up) and step + 1 < t.steps)
            if not (math.isfinite(loss) and math.isfinite(gn)):  # the same values on every rank
                where = locate_nonfinite(model, par.all_reduce_(nonfinite_S.int()))  # any rank's stages
                good = last_saved or latest_name(run_dir)
                msg = f"step {step + 1}: non-finite loss {loss} or grad norm {gn} (lr {lr:.3g}); {where}"
                if t.nan_policy == "stop":
                    raise Diverged(f"{msg}; last good checkpoint: {good}. Stopped (train.nan_policy=stop).",
                                   quiet=not is_main)
                skipped += 1
                if skipped > t.max_skipped_steps:
                    raise Diverged(f"{msg}; {skipped} steps skipped in a row, more than train.max_skipped_steps="
                                   f"{t.max_skipped_steps}; last good checkpoint: {good}", quiet=not is_main)
                console.print(f"[yellow]{msg}; step skipped (train.nan_policy=skip), {skipped} in a row")
                SCALE_STATS.report()  # dropped with the step
                opt.zero_grad()
                watchdog.beat()
                if stop_now:  # no checkpoint of weights that just gave a non-finite step
                    console.print(f"stopping after a skipped step: nothing saved; the last checkpoint is {good}")
                    m = {"step": step + 1, "stopped": stopping or "time limit"}
                    break
                continue
            skipped = 0
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
                 "load_max_over_mean_by_layer": [s["load_max_over_mean"] for s in stats],
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
            printed = (step + 1) % t.log_every == 0 or step + 1 == t.steps or step == start
            if wb is not None:
                wb.log({**m, **wandb_panels(load_LE, stats, printed)}, step=step + 1)
            val = f" val {m['val_loss']:.4f}" if "val_loss" in m else ""
            # throughput of the steps since the last console line, not of this step alone: on the FP8 recipe the
            # logged step is also the scale-statistics step (train.fp8_stats_every), ~1.3x slower
            tps = tokens_per_step * span_steps / span_s
            info = f"loss {loss:.4f}{val} lr {lr:.2e} {tps:,.0f} tok/s"
            progress.update(task, completed=step + 1, info=info)
            if printed:
                mfu = f" mfu {mfu_at(tps):.1%}" if peak else ""
                console.print(f"step {step + 1:>6}/{t.steps} loss {loss:.4f}{val} aux {aux:.2e} lr {lr:.2e} "
                              f"gnorm {gn:.3f} {tps:,.0f} tok/s{mfu} "
                              f"load max/mean {m['load_max_over_mean']:.2f} empty {m['experts_empty']}{fp8_line(m)}")
                span_steps, span_s = 0, 0.0
            if (t.ckpt_every and (step + 1) % t.ckpt_every == 0) or step + 1 == t.steps or stop_now:
                watchdog.allow(t.dist_timeout_s)  # a save's collectives wait at most that long each
                last_saved = checkpoint.save(run_dir, step + 1, state(step + 1),
                                             {"loss": loss, "tokens": (step + 1) * tokens_per_step,
                                              "world": world, "ep_size": par.ep_size}, is_writer=is_main,
                                             keep_last=t.keep_last)
                console.print(f"checkpoint {last_saved}")
                watchdog.beat()
            if stop_now and stopping:
                console.print(f"stopped by {stopping} after step {step + 1} of {t.steps}; the same command resumes "
                              f"from {last_saved}")
                m["stopped"] = stopping
                break
            if stop_now:
                console.print(f"train.time_limit_s={t.time_limit_s:g} reached after step {step + 1} of {t.steps}; "
                              f"the same command resumes from {last_saved}")
                break
    if wb is not None:
        wb.finish()
    return m


def wandb_panels(load_LE: torch.Tensor, stats: list[dict], histograms: bool) -> dict:
    """wandb's per-layer panels: expert-load imbalance each step, and on console-line steps the
    histogram of tokens per expert of each MoE layer."""
    out = {f"load/max_over_mean/layer{i}": s["load_max_over_mean"] for i, s in enumerate(stats)}
    if histograms:
        import wandb

        for i, load_E in enumerate(load_LE.float().cpu().numpy()):
            out[f"load/tokens_per_expert/layer{i}"] = wandb.Histogram(load_E)
    return out


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


def job_dir_name(overrides: str) -> str:
    """A multirun job's run dir name under the sweep dir (hydra.sweep.subdir): its overrides
    (`optim.lr=1e-3,model=tiny`) with "/" made "_" so that a path value does not nest folders;
    long ones are cut and given a hash of the whole. The same overrides give the same name, so a
    sweep run again resumes each job in its own dir."""
    name = overrides.replace(os.sep, "_") or "defaults"
    if len(name) > 120:
        name = name[:100] + "-" + hashlib.sha1(overrides.encode()).hexdigest()[:10]
    return name


def _main() -> None:
    import hydra
    from hydra._internal.utils import get_args_parser
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from omegaconf import OmegaConf

    args = get_args_parser().parse_args()  # what @hydra.main parses (exits with usage on a bad flag)
    env, pre = os.environ, None
    rank, world = int(env.get("RANK", "0")), int(env.get("WORLD_SIZE", "1"))
    quiet = rank != 0  # what every rank finds alike (the config, the run dir) is reported by rank 0
    if args.help:
        try:
            print(config_help(), flush=True)
        except BrokenPipeError:  # `--help | head`
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return
    if not (args.hydra_help or args.cfg or args.info or args.shell_completion or args.multirun):
        try:  # compose once here: any config problem is one line, before Hydra's own (multi-line) report
            pre = load_config(args.overrides, auto_model=True)
            check_launch(pre, env)
        except ValueError as e:
            report(f"config error: {e}", quiet=quiet)
        try:  # before Hydra creates it (hydra.run.dir): a file, a folder that cannot be written, ...
            open_run_dir(pre.train.out_dir, pre.train.resume)
        except UserError as e:
            report(f"error: {e}", quiet=quiet)
    register_schema()
    OmegaConf.register_new_resolver("moefp8_job_dir", job_dir_name, replace=True)

    @hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="config")
    def entry(dcfg) -> None:  # --cfg/--info are answered by Hydra before this runs
        cfg = pre
        try:
            if cfg is None:  # --multirun: one job per composed config, each in its own run dir
                cfg = OmegaConf.to_object(dcfg)
                validate(cfg)
                check_launch(cfg, env)
                hc = HydraConfig.get()
                if hc.mode == RunMode.MULTIRUN:
                    cfg.train.out_dir = hc.runtime.output_dir
                    print(f"multirun job {hc.job.num}: run dir {cfg.train.out_dir}")
        except ValueError as e:
            report(f"config error: {e}", quiet=quiet)
        try:
            out = train(cfg)
        except UserError as e:
            report(f"error: {e}", quiet=e.quiet)
        except Exception as e:
            if world == 1 or not _comm_failure(e):
                raise
            # a peer is gone: no clean shutdown of the process group is possible (it could hang)
            print(f"error: rank {rank}: a collective failed, a peer rank died or hangs (collectives wait "
                  f"at most train.dist_timeout_s={cfg.train.dist_timeout_s:g} s): {first_line(e)}",
                  file=sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(1)
        if out.get("stopped"):
            sys.stdout.flush()
            sys.exit(EXIT_STOPPED)

    entry()


def main() -> None:
    """`python -m moefp8.train`: _main, with a Ctrl-C before training began (no handler yet) as one line."""
    try:
        _main()
    except KeyboardInterrupt:
        report("interrupted before training began; nothing was written", EXIT_INTERRUPTED,
               quiet=os.environ.get("RANK", "0") != "0")


if __name__ == "__main__":
    main()
