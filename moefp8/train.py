"""MoE pretraining entry point: `python -m moefp8.train [hydra overrides]` (README "Training").

    python -m moefp8.train                                  # tiny model on CPU (small on a GPU)
    python -m moefp8.train model=small recipe=bf16 train.steps=1000
    python -m moefp8.train train.out_dir=outputs/runs/a train.resume=none

Hydra composes `configs/config.yaml` onto the `moefp8.config.Config` schema; the result is
converted once into dataclasses (`OmegaConf.to_object`) and checked by `validate`; nothing below
this file sees Hydra. Everything a run writes lives in its run dir `train.out_dir` (identical on
every rank, computed from the config): config.yaml, metrics.jsonl (one JSON line per step),
step_N/ checkpoints + `latest`, wandb/ (offline by default). `train.resume=auto` continues from
the newest complete checkpoint there.

One loop (`train`): per step, grad_accum micro-batches (loss + the routers' balance losses,
backward), non-finite check, global-norm clipping, AdamW on the fp32 masters, then the routers'
aux-loss-free bias update from the load summed over the step, logging, checkpointing.
Single process for now: data parallelism x expert parallelism under torchrun is the next slice.
"""

import json
import math
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from moefp8 import checkpoint
from moefp8.config import Config, validate
from moefp8.data import Loader, prepare
from moefp8.dispatch import build_dispatcher
from moefp8.model import Transformer, flops_per_token, param_counts
from moefp8.optim import AdamW, clip_grad_norm, lr_at
from moefp8.router import load_stats

# configs/ sits beside the package in the repository (installed editable); MOEFP8_CONFIG_DIR
# points elsewhere (e.g. a non-editable install).
CONFIG_DIR = os.environ.get("MOEFP8_CONFIG_DIR", str(Path(__file__).resolve().parent.parent / "configs"))
# Dense BF16 peak of the GPU (SXM), TFLOP/s: MFU is reported against it for both recipes.
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "B200": 2250.0, "A100": 312.0}


class Diverged(RuntimeError):
    """A non-finite loss or gradient norm under nan_policy=stop."""


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("train.device='cuda': no CUDA device is available (use train.device=auto or cpu)")
    return torch.device(name)


def peak_flops(cfg: Config, device: torch.device) -> float | None:
    if cfg.train.peak_tflops > 0:
        return cfg.train.peak_tflops * 1e12
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, tf in PEAK_BF16_TFLOPS.items():
            if key in name:
                return tf * 1e12
    return None  # CPU or an unknown GPU: no MFU


def ensure_data(cfg: Config, is_main: bool, console: Console) -> None:
    """Prepares data.path from data.prepare_from on first use (rank 0; the others would wait at a
    barrier once multi-process training lands)."""
    if os.path.exists(os.path.join(cfg.data.path, "index.json")) or not is_main:
        return
    console.print(f"data: preparing {cfg.data.path} from {cfg.data.prepare_from!r} ({cfg.data.glob}, "
                  f"<= {cfg.data.max_bytes / 1e6:.0f} MB)")
    idx = prepare(cfg.data.prepare_from, cfg.data.path, cfg.data.glob, cfg.data.max_bytes)
    console.print(f"data: {idx['files']} files, {idx['bytes'] / 1e6:.1f} MB, {len(idx['shards'])} shard(s)")


def start_wandb(cfg: Config, run_dir: Path, is_main: bool):
    if not is_main or cfg.logger.mode == "disabled":
        return None
    import wandb

    os.environ.setdefault("WANDB_SILENT", "true")
    return wandb.init(project=cfg.logger.project, name=cfg.logger.name or run_dir.name, dir=str(run_dir),
                      mode=cfg.logger.mode, config=asdict(cfg))


def train(cfg: Config) -> dict:
    """Runs (or resumes) the training described by a validated config; returns the last step's
    metrics. Raises Diverged on a non-finite loss under nan_policy=stop."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        raise NotImplementedError("multi-process training (DP x EP under torchrun) is not wired into "
                                  "moefp8.train yet; run one process")
    rank, is_main = 0, True
    t, o = cfg.train, cfg.optim
    console = Console(soft_wrap=True)
    device = resolve_device(t.device)
    run_dir = Path(t.out_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if is_main:
        from omegaconf import OmegaConf  # only to write the resolved config as YAML

        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    torch.manual_seed(t.seed)
    ensure_data(cfg, is_main, console)
    loader = Loader(cfg.data.path, t.micro_batch, t.seq_len, rank, world, t.seed)
    dispatcher = build_dispatcher(cfg.dispatch.backend, cfg.model.n_experts, None, cfg.recipe.scale_fmt)
    model = Transformer(cfg.model, cfg.recipe.recipe, cfg.recipe.scale_fmt, dispatcher).to(device)
    opt = AdamW(model.named_parameters(), o)
    n = param_counts(cfg.model)
    tokens_per_step = t.micro_batch * t.seq_len * t.grad_accum * world
    fpt, peak = flops_per_token(cfg.model, t.seq_len), peak_flops(cfg, device)

    def state(step: int) -> dict:  # everything a resume needs; tensors are loaded into in place
        rng = {"cpu": torch.get_rng_state()}
        if device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(device)
        return {"model": model.state_dict(), "optim": opt.state_dict(), "data": loader.state_dict(),
                "rng": rng, "step": step}

    start = 0
    ckpt = checkpoint.find_latest(run_dir) if t.resume == "auto" else None if t.resume in ("none", "") else Path(
        t.resume)
    if ckpt is not None:
        st = state(0)
        checkpoint.load(ckpt, st)
        opt.load_state_dict(st["optim"])
        loader.load_state_dict(st["data"])
        torch.set_rng_state(st["rng"]["cpu"])
        if "cuda" in st["rng"]:
            torch.cuda.set_rng_state(st["rng"]["cuda"], device)
        start = st["step"]
        console.print(f"resumed from {ckpt} at step {start}")
    metrics_path = run_dir / "metrics.jsonl"
    if is_main:  # keep the history up to the resumed step (drop steps a killed run logged past it)
        old = metrics_path.read_text().splitlines() if metrics_path.exists() and start else []
        metrics_path.write_text("".join(l + "\n" for l in old if json.loads(l)["step"] <= start))
    if start >= t.steps:
        console.print(f"{run_dir}: already at step {start} >= train.steps={t.steps}; nothing to do "
                      f"(raise train.steps, or pick a new train.out_dir)")
        return {"step": start}
    console.print(f"model {cfg.model.name}: {n['total'] / 1e6:.2f}M parameters, {n['active'] / 1e6:.2f}M active; "
                  f"recipe {cfg.recipe.recipe}; {device}; {tokens_per_step} tokens/step; run dir {run_dir}")
    run = start_wandb(cfg, run_dir, is_main)
    progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                        TextColumn("{task.fields[info]}"), console=console,
                        disable=not (t.progress and console.is_terminal))
    task = progress.add_task("train", total=t.steps, completed=start, info="")
    params = list(opt.params.values())
    last_saved, m = None, {}
    with progress, open(metrics_path, "a") as mf:
        for step in range(start, t.steps):
            t0 = time.perf_counter()
            lr = lr_at(step, o, t.steps)
            loss_sum = torch.zeros((), device=device)
            aux_sum = torch.zeros((), device=device)
            load_LE = None
            for _ in range(t.grad_accum):
                x, y = loader.next()
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                out = model(x, y)
                ((out.out + out.aux_loss) / t.grad_accum).backward()
                loss_sum += out.out.detach()
                aux_sum += out.aux_loss.detach()
                load_LE = out.load_LE if load_LE is None else load_LE + out.load_LE
            gnorm = clip_grad_norm(params, o.grad_clip)
            loss, aux, gn = (loss_sum / t.grad_accum).item(), (aux_sum / t.grad_accum).item(), gnorm.item()
            if not (math.isfinite(loss) and math.isfinite(gn)):
                msg = (f"step {step + 1}: non-finite loss {loss} or grad norm {gn} (lr {lr:.3g}); "
                       f"last good checkpoint: {last_saved or checkpoint.find_latest(run_dir) or 'none'}")
                if t.nan_policy == "stop":
                    raise Diverged(msg + ". Stopped (train.nan_policy=stop).")
                console.print(f"[yellow]{msg}; step skipped (train.nan_policy=skip)")
                opt.zero_grad()
                continue
            opt.step(lr)
            opt.zero_grad()
            for router, load_E in zip(model.routers(), load_LE):  # the step's summed load per layer
                router.update_bias(load_E)
            dt = time.perf_counter() - t0
            stats = [load_stats(l) for l in load_LE]
            m = {"step": step + 1, "loss": loss, "aux_loss": aux, "lr": lr, "grad_norm": gn,
                 "tokens_per_s": tokens_per_step / dt, "step_time_s": dt,
                 "load_max_over_mean": max((s["load_max_over_mean"] for s in stats), default=0.0),
                 "experts_empty": sum(s["experts_empty"] for s in stats)}
            if peak:
                m["mfu"] = fpt * m["tokens_per_s"] / peak
            if is_main:
                mf.write(json.dumps(m) + "\n")
                mf.flush()
            if run is not None:
                run.log({**m, **{f"load/max_over_mean/layer{i}": s["load_max_over_mean"]
                                 for i, s in enumerate(stats)}}, step=step + 1)
            info = f"loss {loss:.4f} lr {lr:.2e} {m['tokens_per_s']:,.0f} tok/s"
            progress.update(task, completed=step + 1, info=info)
            if is_main and ((step + 1) % t.log_every == 0 or step + 1 == t.steps or step == start):
                mfu = f" mfu {m['mfu']:.1%}" if "mfu" in m else ""
                console.print(f"step {step + 1:>6}/{t.steps} loss {loss:.4f} aux {aux:.2e} lr {lr:.2e} "
                              f"gnorm {gn:.3f} {m['tokens_per_s']:,.0f} tok/s{mfu} "
                              f"load max/mean {m['load_max_over_mean']:.2f} empty {m['experts_empty']}")
            if (t.ckpt_every and (step + 1) % t.ckpt_every == 0) or step + 1 == t.steps:
                last_saved = checkpoint.save(run_dir, step + 1, state(step + 1),
                                             {"loss": loss, "tokens": (step + 1) * tokens_per_step},
                                             is_writer=is_main)
                console.print(f"checkpoint {last_saved}")
    if run is not None:
        run.finish()
    return m


def _auto_model(dcfg):
    """train.device=auto on a GPU machine with no model= (nor experiment=) on the command line:
    compose again with model=small (the tiny default is for CPUs)."""
    from hydra import compose
    from hydra.core.hydra_config import HydraConfig

    if dcfg.train.device != "auto" or not torch.cuda.is_available():
        return dcfg
    overrides = list(HydraConfig.get().overrides.task)
    if any(ov.lstrip("+~").split("=")[0] in ("model", "experiment") for ov in overrides):
        return dcfg
    print("train: a GPU and train.device=auto: using model=small (pass model=tiny to override)")
    return compose(config_name="config", overrides=overrides + ["model=small"])


def _register_schema() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="config_schema", node=Config)


def compose_config(overrides: list[str] = ()) -> Config:
    """The validated Config that `python -m moefp8.train *overrides` would run (Hydra's compose
    API; for tests and tools). No device-dependent model pick here."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    _register_schema()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = OmegaConf.to_object(compose(config_name="config", overrides=list(overrides)))
    validate(cfg)
    return cfg


def _main() -> None:
    import hydra
    from omegaconf import OmegaConf

    _register_schema()

    @hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="config")
    def entry(dcfg) -> None:
        cfg: Config = OmegaConf.to_object(_auto_model(dcfg))
        try:
            validate(cfg)
            resolve_device(cfg.train.device)
        except ValueError as e:
            sys.exit(f"config error: {e}")
        try:
            train(cfg)
        except (Diverged, NotImplementedError) as e:
            sys.exit(f"error: {e}")

    entry()


if __name__ == "__main__":
    _main()
