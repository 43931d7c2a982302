"""A step whose loss or gradient norm came out non-finite: where it came from, and whether the
run skips it (train.nan_policy=skip, at most train.max_skipped_steps in a row) or stops with
`Diverged`, one line naming the stage and the last good checkpoint."""

import torch

from moefp8.config import TrainConfig
from moefp8.errors import UserError
from moefp8.model import Transformer


class Diverged(UserError):
    """A non-finite loss or gradient norm under nan_policy=stop, or more than
    train.max_skipped_steps skipped steps in a row under skip (the message names the stage and the
    last good checkpoint)."""


def skip_or_stop(t: TrainConfig, what: str, model: Transformer, nonfinite_S: torch.Tensor, good, skipped: int,
                 rank: int, say) -> int:
    """-> the skipped steps in a row, this one counted, once `say` has told where the step went
    non-finite (its FP8 scale statistics are dropped with it); raises Diverged under
    nan_policy=stop or past max_skipped_steps. what: "step N: non-finite loss ..."; nonfinite_S:
    every rank's flags per stage (all-reduced); good: the last good checkpoint's name."""
    msg = f"{what}; {locate_nonfinite(model, nonfinite_S)}"
    if t.nan_policy == "stop":
        raise Diverged(f"{msg}; last good checkpoint: {good}. Stopped (train.nan_policy=stop).", quiet=rank != 0)
    skipped += 1
    if skipped > t.max_skipped_steps:
        raise Diverged(f"{msg}; {skipped} steps skipped in a row, more than train.max_skipped_steps="
                       f"{t.max_skipped_steps}; last good checkpoint: {good}", quiet=rank != 0)
    say(f"[yellow]{msg}; step skipped (train.nan_policy=skip), {skipped} in a row")
    model.scale_stats.report()  # dropped with the step
    return skipped


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
