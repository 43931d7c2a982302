"""AdamW on FP32 master weights with BF16 (default) or FP32 moments, the LR schedule, the gradient
norm and the clipping factor the update applies as it reads the gradients (`clip_scale`)
(docs/design.md §1: Adam moments BF16 by default, FP32 optional).

Hand-written because torch.optim.AdamW keeps its moments in the parameters' dtype (fp32 here).
The moments are stored in `moment_dtype`; each update reads them in fp32, updates in fp32 and
stores them back rounded (DeepSeek-V3 keeps BF16 moments the same way). Each parameter's update is
one fused Triton kernel on CUDA (`moefp8.kernels.adamw`; its pure-PyTorch twin on CPU). Parameters
are updated in place and their version counters bumped; a weight that keeps a low-precision copy for
its GEMMs (moefp8.weight_copy) gets the new copy from the same pass (FP8: `adamw_quant_step_`, the
matrices of one shape together in one launch, `adamw_quant_multi_step_`; BF16: `adamw_step_(low=)`).
The state is keyed by parameter name, so it checkpoints as plain nested dicts of tensors.
"""

import math

import torch
from torch import Tensor

from moefp8.config import OptimConfig
from moefp8.kernels.adamw import adamw_quant_multi_step_, adamw_quant_step_, adamw_step_
from moefp8.weight_copy import BF16

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def decays(name: str, p: Tensor) -> bool:
    """Weight decay on matrices and expert weights; not on norms, biases or the embedding (the
    router's bias is a buffer, not a parameter, and never decays)."""
    return p.dim() >= 2 and not name.startswith("embed.")


class AdamW:
    def __init__(self, named_params, cfg: OptimConfig):
        self.params = {n: p for n, p in named_params if p.requires_grad}
        self.cfg = cfg
        dt = DTYPES[cfg.moment_dtype]
        self.exp_avg = {n: torch.zeros_like(p, dtype=dt) for n, p in self.params.items()}
        self.exp_avg_sq = {n: torch.zeros_like(p, dtype=dt) for n, p in self.params.items()}
        self.step_count = 0
        self.impl = None  # the update's implementation: None (by device), "triton" or "ref"

    @torch.no_grad()
    def step(self, lr: float, grad_scale: Tensor | None = None) -> None:
        """One update of every parameter that has a gradient. grad_scale: a float32 scalar tensor the
        gradients are multiplied by as the update reads them (`clip_scale`: the mean over ranks and
        the clipping, no pass of their own); None: the gradients as they are."""
        c = self.cfg
        self.step_count += 1
        bc1, bc2 = 1 - c.beta1 ** self.step_count, 1 - c.beta2 ** self.step_count
        batches = {}  # the FP8-copy matrices of one shape and update: one launch (adamw_quant_multi_step_)
        for n, p in self.params.items():
            if p.grad is None:
                continue
            hp = dict(lr=lr, beta1=c.beta1, beta2=c.beta2, eps=c.eps, weight_decay=c.weight_decay if decays(n, p)
                      else 0.0, bc1=bc1, bc2=bc2, grad_scale=grad_scale, impl=self.impl)
            copy = getattr(p, "low_copy", None)  # the GEMMs' copy (moefp8.weight_copy): refreshed in the pass
            if copy is None:
                adamw_step_(p, p.grad, self.exp_avg[n], self.exp_avg_sq[n], **hp)
                continue
            if copy.fmt == BF16:
                adamw_step_(p, p.grad, self.exp_avg[n], self.exp_avg_sq[n], low=copy.low, **hp)
                copy.version = p._version
            elif p.dim() == 2:
                key = (tuple(p.shape), p.grad.dtype, hp["weight_decay"], copy.fmt, copy.low_t is not None)
                batches.setdefault(key, (hp, []))[1].append(n)
            else:
                adamw_quant_step_(p, p.grad, self.exp_avg[n], self.exp_avg_sq[n], copy.low, copy.low_t,
                                  scale_fmt=copy.fmt, **hp)
                copy.version = p._version
        for hp, names in batches.values():
            ps = [self.params[n] for n in names]
            copies = [p.low_copy for p in ps]
            adamw_quant_multi_step_(ps, [p.grad for p in ps], [self.exp_avg[n] for n in names],
                                    [self.exp_avg_sq[n] for n in names], [(c.low, c.low_t) for c in copies],
                                    scale_fmt=copies[0].fmt, **hp)
            for p in ps:
                p.low_copy.version = p._version

    def zero_grad(self) -> None:
        for p in self.params.values():
            p.grad = None

    def state_dict(self) -> dict:
        return {"step": self.step_count, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}

    def load_state_dict(self, sd: dict) -> None:
        for key in ("exp_avg", "exp_avg_sq"):
            mine = getattr(self, key)
            if set(sd[key]) != set(mine):
                raise ValueError(f"optimizer state: {key} names differ from the model's parameters "
                                 f"(missing {sorted(set(mine) - set(sd[key]))[:3]}, "
                                 f"extra {sorted(set(sd[key]) - set(mine))[:3]})")
            for n, t in sd[key].items():
                if t is not mine[n]:
                    mine[n].copy_(t)
        self.step_count = int(sd["step"])


def lr_at(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Linear warm-up over warmup_steps (step 0 gets lr/warmup), then cosine from lr to
    lr * min_lr_ratio at total_steps. `step` counts optimizer steps from 0; warmup_steps is clamped
    to total_steps (a run shorter than the warm-up warms up over the whole run)."""
    warmup = min(cfg.warmup_steps, total_steps)
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def grad_sq(params, device=None) -> Tensor:
    """The sum of the squares of the parameters' gradients (fp32 scalar tensor; those without a
    gradient count 0; no gradient at all: a zero on `device`, else the first parameter's): torch's
    multi-tensor norm, one kernel for all of them, not three per gradient."""
    params = list(params)
    gs = [p.grad if p.grad.dtype == torch.float32 else p.grad.float() for p in params if p.grad is not None]
    if not gs:
        return torch.zeros((), device=device or (params[0].device if params else None))
    return torch.stack(torch._foreach_norm(gs)).square().sum()


def grad_norm(params, sharded=(), group=None, scale: float = 1.0, sharded_sq: Tensor | None = None) -> Tensor:
    """Global L2 norm of scale x all gradients (fp32 scalar tensor; the gradients are not changed).
    `params` are replicated on every rank (counted once); `sharded` hold a different slice on each
    rank of `group` (the routed experts over the EP group): their squared norms are summed over the
    group. scale: 1 / world where the gradients hold sums over the ranks (moefp8.grad_sync).
    sharded_sq: `grad_sq(sharded)` already made (`grad_sync.reduced_grad_norm`)."""
    params, sharded = list(params), list(sharded)
    dev = (params + sharded)[0].device if params or sharded else None
    total = grad_sq(params, dev)
    if sharded:
        shard_sq = grad_sq(sharded, dev) if sharded_sq is None else sharded_sq
        if group is not None:
            torch.distributed.all_reduce(shard_sq, group=group)
        total = total + shard_sq
    return torch.sqrt(total) * scale


def clip_scale(norm: Tensor, max_norm: float, scale: float = 1.0) -> Tensor:
    """What `AdamW.step` multiplies the gradients by (grad_scale): scale, times max_norm / norm
    where the norm (of the scaled gradients, `grad_norm`) exceeds max_norm (0: no clipping). A
    non-finite norm leaves scale alone."""
    s = torch.full_like(norm, scale)
    if max_norm > 0:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        s = torch.where(torch.isfinite(norm), coef * scale, s)
    return s
