"""moefp8/grad_sync.py: bucketed gradient all-reduce during the backward, on 2 gloo ranks: the same
gradients (sums over the ranks; `grad_scale` makes them the mean) as one all-reduce per tensor after
the backward (bit for bit at 2 ranks), with gradient
accumulation, expert groups (here each rank its own: no bucket), parameters without a gradient
(on any step, or on every other one), buckets whose buffers hold garbage after `zero_grad`, and
buckets that start before the backward ends; `reduced_grad_norm` is finish() then `grad_norm`, bit for
bit, with the local shards' squares made before the waits."""

import pytest
import torch
import torch.distributed as dist

from moefp8.config import ModelConfig
import moefp8.grad_sync as grad_sync
from moefp8.grad_sync import GradBuckets, reduced_grad_norm
from moefp8.model import Transformer
from moefp8.optim import grad_norm
from moefp8.recipe import Recipe
from moefp8.testing import spawn_group


def _batch(rank: int, i: int, dev):
    g = torch.Generator().manual_seed(100 * rank + i)
    t = torch.randint(0, 257, (2, 33), generator=g).to(dev)
    return t[:, :-1], t[:, 1:]


def _grads_after(model, named, accum: int, rank: int, reduce, dev, extra=None) -> dict:
    """Gradients of `accum` micro-batches of this rank's data (plus extra's squared sum in the loss),
    then reduce(named)."""
    for i in range(accum):
        if isinstance(reduce, GradBuckets):
            reduce.arm(last=i == accum - 1)
        x, y = _batch(rank, i, dev)
        out = model(x, y)
        loss = out.out + out.aux_loss + (extra.square().sum() * (rank + 1) if extra is not None else 0)
        (loss / accum).backward()
    started_in_backward = reduce.next if isinstance(reduce, GradBuckets) else None
    reduce.finish() if isinstance(reduce, GradBuckets) else reduce(named)
    return {n: p.grad.clone() for n, p in named.items()}, started_in_backward


def _check(rank, world, dev):
    torch.manual_seed(0)
    if dev == "cuda":  # the two passes must compute the same local gradients (train.deterministic's settings)
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_cudnn_sdp(False)
    solo = {r: dist.new_group([r]) for r in range(world)}  # each rank its own expert shard's group
    both = dist.new_group(list(range(world)))  # the expert shard held by every rank (EP 1 under DP)
    model = Transformer(ModelConfig(), Recipe("bf16"), seed=0).to(dev)
    # no gradient on any step: reduces zeros. First in registration order, so in the last bucket
    # (a bucket with a parameter that gets no gradient starts only in finish(), and so the ones after it)
    named = {"unused": torch.nn.Parameter(torch.ones(3, 5, device=dev)),
             "sometimes": torch.nn.Parameter(torch.full((6,), 2.0, device=dev)),  # a gradient on every other step
             "spare.mlp.w9": torch.nn.Parameter(torch.ones(4, device=dev)),  # an expert weight without gradient
             **dict(model.named_parameters())}

    for experts in (solo[rank], both):
        _check_experts_in(experts, model, named, rank, world, dev)
        _check_norm(experts, both, model, named, rank, world, dev)
    if dev == "cuda":  # train.grad_reduce_ctas: the replicated buckets on a communicator capped at 2 CTAs
        opts = dist.ProcessGroupNCCL.Options()
        opts.config.min_ctas, opts.config.max_ctas = 1, 2
        _check_experts_in(solo[rank], model, named, rank, world, dev,
                          dist.new_group(list(range(world)), pg_options=opts))


def _check_norm(experts, both, model, named, rank, world, dev):
    """reduced_grad_norm against finish() then grad_norm: the same bits; where the experts are this
    rank's alone (EP = world: their squares summed over the EP group, all ranks) their squared norm
    is made between the buckets' start and their waits, else inside grad_norm after the waits."""
    alone = dist.get_world_size(experts) == 1
    replicated = [p for n, p in named.items() if ".mlp.w" not in n]
    sharded = [p for n, p in named.items() if ".mlp.w" in n]
    norms, calls = [], []
    real_sq = grad_sync.grad_sq
    grad_sync.grad_sq = lambda ps: (calls.append("sq"), real_sq(ps))[1]
    try:
        for fused in (False, True):
            grads = GradBuckets(named, lambda n: experts if ".mlp.w" in n else None, world, bucket_mb=0.01)
            real_wait = grads.wait
            grads.wait = lambda real_wait=real_wait: (calls.append("wait"), real_wait())[1]
            for i in range(2):
                grads.arm(last=i == 1)
                x, y = _batch(rank, i, dev)
                out = model(x, y)
                ((out.out + out.aux_loss) / 2).backward()
            if fused:
                norms.append(reduced_grad_norm(grads, replicated, sharded, both if alone else None))
            else:
                grads.finish()
                norms.append(grad_norm(replicated, sharded, both if alone else None, grads.grad_scale))
            grads.remove()
    finally:
        grad_sync.grad_sq = real_sq
    assert torch.isfinite(norms[0]) and norms[0] > 0 and torch.equal(norms[0], norms[1]), norms
    assert calls == ["wait"] + (["sq", "wait"] if alone else ["wait"]), calls


def _check_experts_in(experts, model, named, rank, world, dev, replicated=None):
    """replicated: the group the buckets sum the other parameters over (None: the default group, the
    reference's)."""
    def group_of(n):
        return experts if ".mlp.w" in n else replicated

    def per_tensor(params):  # the loop's former reduction: one blocking all-reduce per tensor (sums)
        for n, p in params.items():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, group=experts if ".mlp.w" in n else None)

    for accum in (1, 2):
        want = []
        for extra in (named["sometimes"], None):  # its gradient on even steps only
            for n, p in named.items():
                p.grad = None
            want.append(_grads_after(model, named, accum, rank, per_tensor, dev, extra)[0])
        assert want[0]["sometimes"].abs().min() > 0 and not want[1]["sometimes"].any()
        for mb, overlap in ((0.01, True), (25, True), (0.01, False)):  # many small buckets; a few large ones
            grads = GradBuckets(named, group_of, world, bucket_mb=mb, overlap=overlap)
            assert grads.grad_scale == 1 / world  # the buckets hold sums; the optimizer applies the mean
            view_of = {id(p): v for b in grads.buckets for (_, p), v in zip(b.params, b.views)}
            for step in range(4):  # and again after zero_grad: the views become the gradients again
                grads.zero_grad()
                assert all(p.grad is None for p in named.values())
                for b in grads.buckets:  # zero_grad leaves the buffers as they were: nothing may read them
                    b.buffer.fill_(float("nan"))
                got, started = _grads_after(model, named, accum, rank, grads, dev,
                                            named["sometimes"] if step % 2 == 0 else None)
                for n, w in want[step % 2].items():
                    assert torch.equal(got[n], w), (n, accum, mb, step)
                assert torch.equal(got["unused"], torch.zeros(3, 5, device=dev))
                assert torch.equal(got["spare.mlp.w9"], torch.zeros(4, device=dev))  # finish() made it, as a bucket
                assert all(p.grad is view_of[id(p)] for p in named.values() if id(p) in view_of)
                if mb < 1:  # reductions began inside the backward, or (overlap=False) all after it
                    assert len(grads.buckets) > 5 and (started > 0 if overlap else started == 0)
            alone = dist.get_world_size(experts) == 1
            # the experts' group is this rank alone: no bucket, autograd's own gradient (no view, no add)
            assert len(grads.local) == (sum(".mlp.w" in n for n in named) if alone else 0)
            assert any(b.group is experts for b in grads.buckets) != alone and any(b.group is replicated for b in grads.buckets)
            views = {v.data_ptr() for b in grads.buckets for v in b.views}
            assert all(p.grad is not None and p.grad.data_ptr() not in views for p in grads.local)
            grads.zero_grad()
            assert all(p.grad is None for p in grads.local)
            grads.remove()
            assert all(p.grad is None for p in named.values())


@pytest.mark.parametrize("backend", ["gloo", pytest.param("nccl", marks=pytest.mark.gpu)])
def test_bucketed_reduction_equals_the_per_tensor_one(backend):
    if backend == "nccl" and torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    spawn_group(_check, 2, backend=backend, timeout_s=300)
