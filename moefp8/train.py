"""MoE pretraining: `python -m moefp8.train [hydra overrides]` (README "Training").

    python -m moefp8.train                                  # tiny model on CPU (small on a GPU)
    python -m moefp8.train model=small recipe=bf16 train.steps=1000 optim.lr=3e-4
    torchrun --nproc_per_node 4 -m moefp8.train dispatch=all_to_all dispatch.ep_size=4

Hydra composes `configs/config.yaml` onto the `moefp8.config.Config` schema; the result is
converted once into dataclasses and checked (`validate`, `launch.check_launch`); nothing below
this file sees Hydra. Everything a run writes lives in its run dir `train.out_dir` (the same on
every rank, computed from the config), which one run owns at a time (`rundir`); how it is
written is `runlog`'s job, what a checkpoint holds `state`'s, the process groups `parallel`'s.

One loop (`train`): per step, grad_accum micro-batches (loss + the routers' balance losses,
backward), the gradients averaged over the ranks, non-finite check, global-norm clipping, AdamW
on the fp32 masters, the routers' aux-loss-free bias update from the load summed over the step
and the ranks, logging, checkpointing. A SIGTERM/SIGINT (`stop`) or train.time_limit_s ends it
after a step, with a checkpoint; the same command resumes the same loss curve.
"""

import math
import time
from pathlib import Path

import torch
from rich.console import Console

from moefp8 import accum, checkpoint, cli
from moefp8.build import build_model, cuda_graphs, grad_buckets, norm_split, open_data, overlap_auto
from moefp8.config import Config
from moefp8.data import Loader
from moefp8.diverge import skip_or_stop
from moefp8.grad_sync import reduced_grad_norm
from moefp8.graphs import keeps_grads, prepare_grads, release
from moefp8.launch import peak_flops, setup_device
from moefp8.memory import describe as describe_memory
from moefp8.memory import fits, out_of_memory, plan
from moefp8.model import Transformer, flops_per_token
from moefp8.optim import AdamW, clip_scale, lr_at
from moefp8.parallel import Parallel, StepWatchdog, same_file, same_on_every_rank
from moefp8.rundir import LOCK, take
from moefp8.runlog import RunLog, describe_run, record_start, start_wandb
from moefp8.state import find_resume, restore, save
from moefp8.stop import StopSignals


def train(cfg: Config) -> dict:
    """Runs (or resumes) the training described by a validated config, on one process or as one
    rank under torchrun; returns the last step's metrics, with "stopped": the signal's name when a
    SIGTERM/SIGINT stopped it (after its checkpoint). Raises a UserError (one line) for what the
    user can fix: a run dir that is unusable or owned by another run, data, a checkpoint, divergence."""
    t = cfg.train
    device = setup_device(t)
    lock = None
    with Parallel(cfg, device) as par:  # the process group ends with the run or a UserError
        console = Console(soft_wrap=True, quiet=par.rank != 0)
        try:
            with StopSignals(quiet=par.rank != 0) as stop:
                with same_on_every_rank(par.rank):
                    lock = par.on_main(lambda: take(t.out_dir, t.resume, console.print))
                    same_file(Path(t.out_dir) / LOCK, f"train.out_dir={t.out_dir}", "put it on a filesystem that "
                              "every node mounts at the same path (every rank writes its checkpoint shards there)",
                              par.rank, par.world)
                return _train(cfg, par, device, console, stop)
        finally:
            if lock is not None:
                lock.release()


def _train(cfg: Config, par: Parallel, device: torch.device, console: Console, stop: StopSignals) -> dict:
    """train() in an owned run dir: the data, the model, the resume, then the loop."""
    t, run_dir = cfg.train, Path(cfg.train.out_dir)
    with same_on_every_rank(par.rank):
        if device.type == "cuda":  # before the data and the model: a preset that cannot fit stops here
            props = torch.cuda.get_device_properties(device)
            pl = fits(cfg, props.total_memory, props.name, par.world) if t.check_memory else plan(cfg, par.world)
            console.print(describe_memory(pl, props.total_memory))
        torch.manual_seed(t.seed)
        loader = open_data(cfg, par, console.print)
        model = build_model(cfg, par, device, console.print)
        opt = AdamW(model.named_parameters(), cfg.optim)
        ckpt = find_resume(t.resume, run_dir, console.print)
        start = restore(ckpt, model, opt, loader, device) if ckpt is not None else 0
        if ckpt is not None:
            console.print(f"resumed from {ckpt} at step {start}")
        if start >= t.steps:  # nothing changes in the run dir
            console.print(f"{run_dir}: already at step {start} >= train.steps={t.steps}; nothing to do "
                          f"(raise train.steps, or pick a new train.out_dir)")
            return {"step": start}
        cuda_graphs(cfg, model, device, console.print)  # train.cuda_graphs: on the restored weights
        # the checkpoint has loaded: from here on the run dir changes
        par.on_main(lambda: record_start(cfg, run_dir, start, device, par, console.print))
        wb = par.on_main(lambda: start_wandb(cfg, run_dir))
    tokens_per_step = t.micro_batch * t.seq_len * t.grad_accum * par.world
    describe_run(cfg, par, device, loader, tokens_per_step, console.print)
    peak = peak_flops(cfg, device)
    log = RunLog(cfg, run_dir, console, wb, start, tokens_per_step, flops_per_token(cfg.model, t.seq_len),
                 peak * par.world if peak else None, device)
    at = [start]  # the step under way (out of memory's line)
    with log, StepWatchdog(par.rank, t.dist_timeout_s, enabled=par.world > 1) as watchdog:
        try:
            return _loop(cfg, par, device, console, stop, log, watchdog, model, opt, loader, start, at)
        except torch.cuda.OutOfMemoryError:  # one line, not the allocator's trace from inside a kernel wrapper
            used = ((torch.cuda.max_memory_allocated(device), torch.cuda.get_device_properties(device).total_memory)
                    if device.type == "cuda" else (None, None))
            raise out_of_memory(cfg, par.world, at[0] + 1, par.rank, *used, log.last_load) from None
        finally:
            release(model)  # the CUDA graphs before the process group: those that hold its collectives


def _loop(cfg, par, device, console, stop, log, watchdog, model, opt, loader, start, at) -> dict:
    """The training steps from `start` to train.steps (module docstring); at[0]: the step under way."""
    t, o, world, run_dir = cfg.train, cfg.optim, par.world, Path(cfg.train.out_dir)
    replicated_params, sharded_params = norm_split(par, model, opt)
    grads = grad_buckets(cfg, par, model, opt)  # the mean gradient over the ranks, reduced during the last backward
    zero_grad = grads.zero_grad if grads else opt.zero_grad
    auto = overlap_auto(cfg, par, model, console.print)  # dispatch.overlap=auto: times both schedules first
    # a replayed attention hands its graph's gradient buffers to a `.grad` that is None: with several
    # micro-batches on one process the gradients must exist before the first backward (moefp8.graphs)
    keep_grads = keeps_grads(model, grads, t.grad_accum)
    main_grads = accum.armed(model)  # grad_accum > 1 on one process: the experts' sums inside their GEMMs
    began, last_saved, m, skipped = time.monotonic(), None, {}, 0  # skipped: in a row (nan_policy=skip)
    flags_host = torch.zeros(2, pin_memory=device.type == "cuda")  # [signalled, past the time limit]
    mean = grads.grad_scale if grads else 1.0  # (the gradients hold sums over the ranks: this makes them the mean)
    retried = 0  # steps run again (dispatch.rows_factor)

    def forward_backward(batches, stats_on: bool, capped: bool):
        """The step's micro-batches forward and backward, the gradients reduced over the ranks, and the
        one host sync: -> (loss sum, aux sum, signalled, past the time limit, capped layouts that overflowed
        on any rank, grad norm), load_LE, nonfinite_S, gnorm, load_host. capped: the MoE layouts under EP
        sized by dispatch.rows_factor (model.row_cap), or exact."""
        sums = torch.zeros(5, device=device)  # [loss, aux loss, signalled, past the time limit, overflowed]
        load_LE = nonfinite_S = None
        model.scale_stats.on, model.row_cap.on = stats_on, capped
        if keep_grads:
            prepare_grads(model)
        accum.zero(main_grads)
        for i, (x, y) in enumerate(batches):
            if grads:
                grads.arm(last=i == t.grad_accum - 1)
            out = model(x.to(device, non_blocking=True), y.to(device, non_blocking=True))
            ((out.out + out.aux_loss) / t.grad_accum).backward()
            sums[:2] += torch.stack([out.out, out.aux_loss]).detach()
            load_LE = out.load_LE if load_LE is None else load_LE + out.load_LE
            nonfinite_S = out.nonfinite if nonfinite_S is None else nonfinite_S | out.nonfinite
            # the loss's autograd graph, gone before the next forward: its nodes (the parameters' AccumulateGrad
            # among them) would live on into the next micro-batch's graph, made there on another stream
            del out
        accum.to_grad(main_grads)
        # stop requests ride on the loss's all-reduce: a signal to any rank, any rank's clock past the limit
        flags_host[0] = float(stop.requested is not None)
        flags_host[1] = float(bool(t.time_limit_s) and time.monotonic() - began > t.time_limit_s)
        # (pinned, copied without a host sync; the previous step's read below has finished its last copy)
        sums[2:4] = flags_host.to(device, non_blocking=True)
        overflowed = model.row_cap.take()  # dispatch.rows_factor: the capped layouts that were too small
        if overflowed is not None:
            sums[4:] = overflowed
        # the norm is the mean's, and the update applies the mean and the clipping as it reads them (clip_scale)
        gnorm = reduced_grad_norm(grads, replicated_params, sharded_params, par.ep_group)
        if grads:  # gradients of the mean loss over all ranks' tokens
            par.all_reduce_(sums)
            par.all_reduce_(load_LE)  # tokens per expert over all ranks: the same bias update everywhere
        model.scale_stats.on = model.row_cap.on = False
        # the expert loads ride on the same sync (a pinned copy queued before it): per-layer statistics
        # read on the host, not five device syncs per MoE layer
        load_host = load_LE.to("cpu", non_blocking=True) if load_LE.is_cuda else load_LE
        return torch.cat([sums, gnorm.view(1)]).tolist(), load_LE, nonfinite_S, gnorm, load_host  # one host sync

    for step in range(start, t.steps):
        at[0] = step
        t0 = time.perf_counter()
        lr = lr_at(step, o, t.steps)
        if auto:
            auto.begin_step()
        stats_on = (model.recipe.fp8 and t.fp8_stats_every > 0
                    and ((step + 1) % t.fp8_stats_every == 0 or step == start))
        batches = [loader.next() for _ in range(t.grad_accum)]
        capped = model.row_cap.ready()  # dispatch.rows_factor, unless backing off after an overflow
        got = forward_backward(batches, stats_on, capped=capped)
        skip = model.row_cap.fit(bool(got[0][4])) if capped else 0  # (factor 0: never overflows, skips 0)
        if got[0][4]:  # a capped layout overflowed on some rank (the same figure everywhere): the step again, exact
            retried += 1
            if retried & (retried - 1) == 0:  # the 1st, 2nd, 4th, 8th, ... time
                console.print(f"step {step + 1}: {int(got[0][4])} MoE layout(s) or send block(s) needed more rows "
                              f"than dispatch.rows_factor={cfg.dispatch.rows_factor:g}"
                              f"{f' / send_factor={cfg.dispatch.send_factor:g}' if cfg.dispatch.send_factor else ''} "
                              f"give; the step ran again with exact "
                              f"layouts, and the next {skip} run exact ones at once ({retried} step(s) run again so "
                              f"far; raise the factor if this is frequent)")
            zero_grad()
            model.scale_stats.report()  # the first run's statistics: dropped
            got = forward_backward(batches, stats_on, capped=False)
        (loss_s, aux_s, signalled, time_up, _, gn), load_LE, nonfinite_S, gnorm, load_host = got
        model.dispatcher.flush_checks()  # the dispatches' input checks that did not wait (all done by now)
        loss, aux = loss_s / world / t.grad_accum, aux_s / world / t.grad_accum
        stopping = stop.requested or ("a signal to another rank" if signalled else None)
        stop_now = bool(signalled) or (bool(time_up) and step + 1 < t.steps)
        if not (math.isfinite(loss) and math.isfinite(gn)):  # the same values on every rank
            good = last_saved or checkpoint.latest_name(run_dir)
            skipped = skip_or_stop(t, f"step {step + 1}: non-finite loss {loss} or grad norm {gn} (lr {lr:.3g})",
                                   model, par.all_reduce_(nonfinite_S.int()), good, skipped, par.rank, console.print)
            zero_grad()
            watchdog.beat()
            if stop_now:  # no checkpoint of weights that just gave a non-finite step
                console.print(f"stopping after a skipped step: nothing saved; the last checkpoint is {good}")
                return {"step": step + 1, **({"stopped": stopping} if stopping else {})}
            continue
        skipped = 0
        opt.step(lr, grad_scale=clip_scale(gnorm, o.grad_clip, mean))
        zero_grad()
        for router, load_E in zip(model.routers(), load_LE):  # the step's summed load per layer
            router.update_bias(load_E)
        dt = time.perf_counter() - t0
        watchdog.beat(dt)
        if auto:
            auto.end_step(dt)
        val = {}
        if t.eval_every and ((step + 1) % t.eval_every == 0 or step + 1 == t.steps):
            watchdog.allow(t.dist_timeout_s)  # not a step: its own collectives, its own time
            val = {"val_loss": evaluate(model, loader, device, par)}
            watchdog.beat()
        m = log.step(step + 1, dt, load_host, {"loss": loss, "aux_loss": aux, "lr": lr, "grad_norm": gn, **val,
                                               **model.scale_stats.report()})  # this rank's FP8 tile scales
        if (t.ckpt_every and (step + 1) % t.ckpt_every == 0) or step + 1 == t.steps or stop_now:
            watchdog.allow(t.dist_timeout_s)  # a save's collectives wait at most that long each
            last_saved = save(cfg, par, step + 1, model, opt, loader, device, loss, (step + 1) * log.tokens_per_step)
            console.print(f"checkpoint {last_saved}")
            watchdog.beat()
        if stop_now:
            why = f"stopped by {stopping}" if stopping else f"train.time_limit_s={t.time_limit_s:g} reached"
            console.print(f"{why} after step {step + 1} of {t.steps}; the same command resumes from {last_saved}")
            return {**m, "stopped": stopping} if stopping else m
    return m


@torch.no_grad()
def evaluate(model: Transformer, loader: Loader, device: torch.device, par: Parallel) -> float:
    """Mean loss over the held-out windows (data.val_windows; every rank its share, the same
    number of batches on each, so the EP exchanges pair up), averaged over all ranks."""
    total, n = torch.zeros((), device=device), 0
    for x, y in loader.val_batches():
        total += model(x.to(device, non_blocking=True), y.to(device, non_blocking=True)).out
        n += 1
    model.dispatcher.flush_checks()
    if par.world > 1:
        par.all_reduce_(total).div_(par.world)
    return (total / n).item()


def main() -> None:
    """`python -m moefp8.train`: the Hydra command line (moefp8.cli) around `train`."""
    cli.main(train)


if __name__ == "__main__":
    main()
