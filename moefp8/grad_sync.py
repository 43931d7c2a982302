"""Data-parallel gradient reduction in buckets, launched during the backward (DDP's scheme).

Every rank computes gradients of its own tokens; the optimizer needs their mean over the ranks
that share a parameter: all ranks for the replicated parameters, the ranks holding the same
expert shard (`Parallel.expert_dp_group`) for the routed experts.

`GradBuckets` lays the gradients of consecutive parameters of one reduction group (in reverse
registration order: roughly the order the backward produces them) into flat buffers of about
`bucket_mb` each, and every `p.grad` ends a backward as a view of its buffer (DDP's
gradient_as_bucket_view). As DDP's reducer does with `zero_grad(set_to_none=True)`: `zero_grad`
sets the gradients to None instead of zeroing the buffers, autograd takes a parameter's first
gradient of the step as it was made (the wgrad GEMM's output, or a replayed graph's buffer), and
the hook after its accumulation copies it into the view and makes the view its `.grad`; further
micro-batches add into the view (autograd's accumulation). One copy per gradient instead of a
zeroing pass plus autograd's add (8 bytes a parameter less: ~11 GB a step on the 16B preset's
1.4B replicated parameters). On the last micro-batch of a step (`arm(last=True)`), the same hook
counts the bucket's arrivals; a full bucket starts its all-reduce (async) at once, so the
reductions run under the rest of the backward. Buckets start strictly in index
order (a bucket that fills early waits for the ones before it): every rank issues the same
collectives in the same order, whatever order its backward produced the gradients in.
`finish()` starts what is left (parameters that got no gradient on this step reduce zeros, written
into their views then; their bucket, and every one after it, starts only then) and waits. The
gradients then hold the SUMS over the ranks: the mean's 1 / world is applied by the optimizer as it reads them (`optim.clip_scale`,
`AdamW.step(grad_scale=...)`), not by a pass over every gradient here (at the 16B preset's EP4 that
pass took 10.8 ms of a 680 ms step, on the critical path after the backward). Sums are in fp32;
with two ranks each element is the same a + b as the per-tensor reduction's, bit for bit.

Parameters whose group is this rank alone (the routed experts when dispatch.ep_size is the world:
no other rank holds them) get no bucket: there is nothing to sum, and a bucket view would cost a
copy of each gradient into it (with the former zeroing and add, ~22 ms of a 660 ms step on the 16B
preset at EP4, both recipes). Their `.grad` is autograd's as on one process: the wgrad GEMM's
output, taken without a copy; `zero_grad` sets it to None.

Replaces one blocking all-reduce per tensor after the backward (issue 47, GPU-bound steps).
"""

import torch
import torch.distributed as dist
from torch import Tensor

from moefp8.optim import grad_norm, grad_sq

BUCKET_MB = 25  # DDP's default bucket_cap_mb


class _Bucket:
    def __init__(self, params: list[tuple[str, Tensor]], group):
        self.params, self.group = params, group
        p0 = params[0][1]
        # never read before written: a backward copies each gradient in first, finish() zeros the rest
        self.buffer = torch.empty(sum(p.numel() for _, p in params), dtype=p0.dtype, device=p0.device)
        self.views, off = [], 0
        for _, p in params:
            self.views.append(self.buffer[off: off + p.numel()].view_as(p))
            off += p.numel()
        self.ready, self.work = 0, None


class GradBuckets:
    """named_params: {name: parameter} (the optimizer's, in registration order); group_of(name):
    the process group that parameter's gradient is summed over (None: all ranks; a group of this
    rank alone: no bucket, see the module docstring); world: the divisor (all ranks' tokens make
    the mean loss); overlap: False starts every bucket in
    `finish()`, after the backward (train.deterministic: 4 H100s, FP8, EP2, capacity-mode dispatch,
    25 MB buckets started inside the backward made two runs of one commit part at step 2 or 3,
    while one bucket started at the end, the exact-mode dispatch or BF16 repeated bit for bit;
    bench/notes/renovation.md)."""

    def __init__(self, named_params: dict[str, Tensor], group_of, world: int, bucket_mb: float = BUCKET_MB,
                 overlap: bool = True):
        self.world, self.armed, self.overlap = world, False, overlap
        cap = int(bucket_mb * 2**20)
        self.buckets: list[_Bucket] = []
        self.local: list[Tensor] = []  # in a group of one rank: autograd's own .grad, no bucket
        run, size, key = [], 0, object()
        for name, p in reversed(list(named_params.items())):
            g = group_of(name)
            if g is not None and dist.get_world_size(g) == 1:
                self.local.append(p)
                continue
            if run and (g is not key or size + p.numel() * p.element_size() > cap
                        or p.dtype != run[0][1].dtype or p.device != run[0][1].device):
                self.buckets.append(_Bucket(run, key))
                run, size = [], 0
            run.append((name, p))
            size, key = size + p.numel() * p.element_size(), g
        if run:
            self.buckets.append(_Bucket(run, key))
        self.next = 0  # the first bucket not yet started
        self._handles = []
        for i, b in enumerate(self.buckets):
            for (_, p), v in zip(b.params, b.views):
                p.grad = None  # as after zero_grad: the first backward's gradients are copied into the views
                self._handles.append(p.register_post_accumulate_grad_hook(lambda p, i=i, v=v: self._arrived(i, p, v)))

    def arm(self, last: bool) -> None:
        """Before a micro-batch's backward: last=True on the step's last one (its gradients complete
        the sums, and the buckets start as they fill); False accumulates only."""
        self.armed = last
        if last:
            for b in self.buckets:
                b.ready = 0

    def _arrived(self, i: int, p: Tensor, view: Tensor) -> None:
        if p.grad.data_ptr() != view.data_ptr():  # the step's first gradient, as autograd took it: into the bucket
            view.copy_(p.grad)
            p.grad = view
        if not (self.armed and self.overlap):
            return
        self.buckets[i].ready += 1
        while self.next < len(self.buckets) and self.buckets[self.next].ready == len(self.buckets[self.next].params):
            self._start(self.next)

    def _start(self, i: int) -> None:
        b = self.buckets[i]
        b.work = dist.all_reduce(b.buffer, group=b.group, async_op=True)
        self.next = i + 1

    def finish(self) -> None:
        """Starts the buckets still waiting, in order; waits for all. The gradients (p.grad) then hold
        the sum over the ranks; `grad_scale` (1 / world) makes it their mean."""
        self.start_rest()
        self.wait()

    def start_rest(self) -> None:
        """finish()'s first half: every bucket started, and every gradient in place (zeros where a
        parameter got none); the unbucketed ones (`local`) are final from here on."""
        for b in self.buckets[self.next:]:  # (a bucket with such a parameter cannot have started)
            for (_, p), v in zip(b.params, b.views):
                if p.grad is None:  # no gradient on this step: zeros (the view holds an earlier step's)
                    v.zero_()
                    p.grad = v
        while self.next < len(self.buckets):
            self._start(self.next)
        for p in self.local:  # no gradient on this step: zeros, as a bucket would have held
            if p.grad is None:
                p.grad = torch.zeros_like(p)

    def wait(self) -> None:
        """finish()'s second half: the current stream waits for every bucket's reduction."""
        for b in self.buckets:
            b.work.wait()
            b.work = None
        self.next, self.armed = 0, False

    @property
    def grad_scale(self) -> float:
        """What turns the reduced gradients into the mean over the ranks' tokens."""
        return 1.0 / self.world

    def zero_grad(self) -> None:
        """Every gradient None: the bucketed ones become their views again as the next backward
        makes them (the hook copies the first one in) or in `finish()` (zeros); the buffers are not
        zeroed."""
        for p in self.local:
            p.grad = None
        for b in self.buckets:
            for _, p in b.params:
                p.grad = None

    def remove(self) -> None:
        """Removes the hooks and leaves the gradients as plain tensors (None)."""
        for h in self._handles:
            h.remove()
        self.zero_grad()


def reduced_grad_norm(grads: GradBuckets | None, replicated: list[Tensor], sharded: list[Tensor], group) -> Tensor:
    """`grads.finish()`, then the global norm of the mean gradient (`optim.grad_norm`: replicated
    parameters once, the sharded ones' squares summed over `group`; grads None, one process: the
    norm of the gradients as they are). Where every sharded parameter
    is this rank's alone (`grads.local`: the routed experts at EP = world), their squared norm is
    enqueued after the last bucket has started and before the waits, so it runs beside the last
    reductions instead of after them (at the 16B preset's EP4, ~3.6B expert gradients: ~4 ms of
    reading). The same kernels on the same gradients: the same bits."""
    if grads is None:
        return grad_norm(replicated, sharded, group)
    grads.start_rest()
    local = {id(p) for p in grads.local}
    early = grad_sq(sharded) if sharded and all(id(p) in local for p in sharded) else None
    grads.wait()
    return grad_norm(replicated, sharded, group, grads.grad_scale, sharded_sq=early)
