"""What a run reports (rank 0 writes; the other ranks' RunLog prints and writes nothing): the
console (one line every train.log_every steps, a progress bar on a terminal), metrics.jsonl (one
JSON line per step, flushed), wandb (offline by default: panels of per-layer expert load and the
FP8 scale statistics), and the run dir's record of each start (config.yaml, starts.jsonl).

    with RunLog(cfg, run_dir, console, wb, start, tokens_per_step, flops_per_token, peak, device) as log:
        for step ...:
            metrics = log.step(step + 1, seconds, load_LE, {"loss": ..., "lr": ...})
"""

import datetime
import json
import os
import secrets
import socket
from dataclasses import asdict
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from moefp8 import checkpoint
from moefp8.config import Config
from moefp8.data import Loader
from moefp8.errors import UserError, first_line
from moefp8.model import param_counts
from moefp8.parallel import Parallel
from moefp8.router import load_stats
from moefp8.testing import boot_id, git_commit


class RunLog:
    """The console line, the progress bar, metrics.jsonl and wandb, for the steps of one start.
    `step(...)` after each optimizer step; the console's tok/s covers every step since its previous line (their training time, no
    eval or saves), not the printed step alone: on the FP8 recipe that step also gathers the scale
    statistics and is ~1.3x slower. peak: the GPUs' summed BF16 peak FLOP/s for MFU (None: none)."""

    def __init__(self, cfg: Config, run_dir: Path, console: Console, wb, start: int, tokens_per_step: int,
                 flops_per_token: float, peak: float | None, device: torch.device):
        self.t, self.run_dir, self.console, self.wb, self.start = cfg.train, run_dir, console, wb, start
        self.device = device
        self.tokens_per_step, self.fpt, self.peak = tokens_per_step, flops_per_token, peak
        self.progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                                 TextColumn("{task.fields[info]}"), console=console,
                                 disable=not (self.t.progress and not console.quiet and console.is_terminal))
        self.task = self.progress.add_task("train", total=self.t.steps, completed=start, info="")
        self.span_steps, self.span_s, self.file = 0, 0.0, None
        self.last_load = None  # the MoE layers' max/mean expert load at the last logged step

    def mfu(self, tokens_per_s: float) -> float | None:
        return self.fpt * tokens_per_s / self.peak if self.peak else None

    def __enter__(self) -> "RunLog":
        self.progress.__enter__()
        if not self.console.quiet:  # rank 0
            self.file = open(self.run_dir / "metrics.jsonl", "a")
        return self

    def __exit__(self, *exc) -> None:
        self.progress.__exit__(*exc)
        if self.file is not None:
            self.file.close()
        if self.wb is not None:
            self.wb.finish()

    def step(self, step: int, dt: float, load_LE: torch.Tensor, values: dict) -> dict:
        """Logs optimizer step `step` (1-based) that took dt s of training, load_LE its tokens per
        expert of each MoE layer (on the host), values the step's own figures (loss, lr, ...);
        returns the metrics as written."""
        t, stats = self.t, [load_stats(load_E) for load_E in load_LE]
        m = {"step": step, **values, "tokens_per_s": self.tokens_per_step / dt, "step_time_s": dt,
             "load_max_over_mean": max((s["load_max_over_mean"] for s in stats), default=0.0),
             "load_max_over_mean_by_layer": [s["load_max_over_mean"] for s in stats],
             "experts_empty": sum(s["experts_empty"] for s in stats), **memory_mb(self.device)}
        self.last_load = m["load_max_over_mean"]  # (out_of_memory's hint)
        if self.peak:
            m["mfu"] = self.mfu(m["tokens_per_s"])
        printed = step % t.log_every == 0 or step == t.steps or step == self.start + 1
        self.span_steps, self.span_s = self.span_steps + 1, self.span_s + m["step_time_s"]
        if self.file is not None:
            self.file.write(json.dumps(m) + "\n")
            self.file.flush()
        if self.wb is not None:
            self.wb.log({**m, **wandb_panels(load_LE, stats, printed)}, step=step)
        val = f" val {m['val_loss']:.4f}" if "val_loss" in m else ""
        tps = self.tokens_per_step * self.span_steps / self.span_s
        self.progress.update(self.task, completed=step, info=f"loss {m['loss']:.4f}{val} lr {m['lr']:.2e} {tps:,.0f} tok/s")
        if printed:
            mfu = f" mfu {self.mfu(tps):.1%}" if self.peak else ""
            self.console.print(f"step {step:>6}/{t.steps} loss {m['loss']:.4f}{val} aux {m['aux_loss']:.2e} "
                               f"lr {m['lr']:.2e} gnorm {m['grad_norm']:.3f} {tps:,.0f} tok/s{mfu} "
                               f"load max/mean {m['load_max_over_mean']:.2f} empty {m['experts_empty']}{fp8_line(m)}")
            self.span_steps, self.span_s = 0, 0.0
        return m


def describe_run(cfg: Config, par: Parallel, device: torch.device, loader: Loader, tokens_per_step: int,
                 say) -> None:
    """The run's opening lines: the model, recipe and parallel layout, and what an epoch of the data is."""
    t, n = cfg.train, param_counts(cfg.model)
    impls = (" (m-grouped GEMMs: DeepGEMM)" if cfg.recipe.gemm == "deepgemm" else "") + (
        " (routed experts: megablocks dMoE)" if cfg.recipe.moe_impl == "megablocks" else "")
    say(f"model {cfg.model.name}: {n['total'] / 1e6:.2f}M parameters, {n['active'] / 1e6:.2f}M active; recipe "
        f"{cfg.recipe.recipe}{impls}; {device} x {par.world} (EP {par.ep_size}); {tokens_per_step} tokens/step; "
        f"run dir {Path(t.out_dir)}")
    if cfg.model.force_balanced_routing:
        say("model.force_balanced_routing=true: the routers pick experts at random (a benchmark's balanced load); "
            "the model does not learn to route, so its loss is not a trained MoE's")
    if par.node_groups is not None:
        say(f"dispatch: hierarchical, {par.ep_size // par.ranks_per_node} nodes x {par.ranks_per_node} ranks per EP "
            f"group")
    epoch = loader.steps_per_epoch(t.grad_accum)
    held = f" (+{len(loader.val_ids)} held out)" if len(loader.val_ids) else ""
    say(f"data: {loader.n_windows} training windows of {t.seq_len + 1} tokens{held}: an epoch is {epoch} steps"
        + (f"; train.steps={t.steps} reads it {t.steps / epoch:.2f} times" if t.steps > epoch else ""))


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

def wandb_panels(load_LE: torch.Tensor, stats: list[dict], histograms: bool) -> dict:
    """wandb's per-layer panels: expert-load imbalance each step, and on console-line steps the
    histogram of tokens per expert of each MoE layer."""
    out = {f"load/max_over_mean/layer{i}": s["load_max_over_mean"] for i, s in enumerate(stats)}
    if histograms:
        import wandb

        for i, load_E in enumerate(load_LE.float().cpu().numpy()):
            out[f"load/tokens_per_expert/layer{i}"] = wandb.Histogram(load_E)
    return out

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
        out["cuda_max_alloc_mb"] = torch.cuda.max_memory_allocated(device) / 2**20  # to hold against moefp8.memory's plan
    return out

def fp8_line(m: dict) -> str:
    """The console's summary of a stats step's FP8 scales: typical log2 scale of activation and
    gradient tiles, and the share of gradient tiles at the amax-clamp floor."""
    if "fp8/grad_tiles" not in m or "fp8/act_log2_scale_mean" not in m:
        return ""
    return (f" | fp8 log2 scale act {m['fp8/act_log2_scale_mean']:.1f} grad {m.get('fp8/grad_log2_scale_mean', 0):.1f},"
            f" grad tiles at floor {m['fp8/grad_at_floor']:.1%}")
