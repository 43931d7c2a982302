"""The chunked cross-entropy's kernel (moefp8.kernels.xent): the Triton kernel (interpreter on CPU,
compiled on GPU) and its reference twin against fp64 ground truth -- each row's loss and the
gradient written over the logits -- with outlier rows, odd vocabularies (a partial last block),
NaN and inf, an empty chunk, bad input."""

import pytest
import torch

from moefp8.kernels import xent as X
from moefp8.testing import rel_err


def logits(c, V, seed=0, device="cpu"):
    """BF16 logits [c, V] with every 5th row scaled by 40 (peaked softmax: log-sum-exp ~ 100s,
    p - 1 at the target cancels), targets [c] with the first at the last column."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(c, V, generator=g) * 2
    x[::5] *= 40
    t = torch.randint(0, V, (c,), generator=g)
    t[0] = V - 1
    if c > 1:
        x[1, t[1]] = x[1].max() + 5  # a row whose target is its argmax
    return x.to(torch.bfloat16).to(device), t.to(device)


def truth(x, t, n):
    x64 = x.double()
    lse = torch.logsumexp(x64, -1)
    g = torch.softmax(x64, -1)
    g[torch.arange(len(t)), t] -= 1
    return lse - x64.gather(1, t[:, None]).squeeze(1), g / n


def check(impl, c, V, device):
    x, t = logits(c, V, seed=c + V, device=device)
    n = 3 * c + 1  # the mean over more tokens than this chunk's
    loss64, g64 = truth(x.cpu(), t.cpu(), n)
    got_x, ref_x = x.clone(), x.clone()
    got, ref = X.xent_grad_(got_x, t, n, impl=impl), X.xent_grad_(ref_x, t, n, impl="ref")
    assert got.dtype == torch.float32 and got_x.dtype == torch.bfloat16 and torch.isfinite(got).all()
    # the loss: lse - x_t in fp32 from sums in two orders, each a few hundred ulp of lse (~100 here) from exact
    assert (got.cpu().double() - loss64).abs().max() <= 2 * (ref.cpu().double() - loss64).abs().max() + 1e-4
    # the gradient: BF16 of the same fp32 values up to the log-sum-exp's ulps (~1e-6 relative). The GPU rounds
    # to nearest: no worse than twice the reference's own error against fp64. The interpreter truncates
    # fp32 -> BF16 (at -0.0625 + 2e-8: a whole ulp off): within one BF16 ulp of the reference, element by element
    a, b = got_x.cpu().float(), ref_x.cpu().float()
    if impl == "triton" and device == "cpu":
        # (and 2**-126: subnormal probabilities, flushed to zero by one side or not)
        assert ((a - b).abs() <= 2.0**-7 * torch.maximum(a.abs(), b.abs()) + 2.0**-126).all()
    else:
        err, err_ref = rel_err(a.double(), g64), rel_err(b.double(), g64)
        assert err <= 2 * err_ref + 1e-6, (err, err_ref)
    assert (got_x.float().sum(-1).abs() < 1e-3).all()  # each row of softmax - onehot sums to ~0


@pytest.mark.interp
@pytest.mark.parametrize("c, V", [(1, 1), (7, 1000), (5, 2 * X.BLOCK_V + 3)])
def test_interpreter_vs_ref(c, V):
    check("triton", c, V, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("c, V", [(1, 1), (300, 1000), (512, 32768), (256, 102400)])
def test_gpu_vs_ref(c, V):
    check(None, c, V, "cuda")


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy on the NaN/Inf fed in
@pytest.mark.parametrize("impl", ["ref", pytest.param("triton", marks=pytest.mark.interp),
                                  pytest.param(None, marks=pytest.mark.gpu)])
def test_nan_and_inf_never_pass(impl):
    device = "cuda" if impl is None else "cpu"
    x, t = logits(4, 300, device=device)
    x[1, 17] = float("nan")
    x[2, 5] = float("inf")
    x[3, 9] = float("-inf")  # a logit of -inf is a probability of 0: row 3 stays finite
    loss = X.xent_grad_(x, t, 4, impl=impl)
    assert torch.isnan(loss[1]) and not torch.isfinite(loss[2])
    assert torch.isfinite(loss[0]) and torch.isfinite(loss[3])


def test_empty_chunk_and_bad_input():
    x, t = logits(3, 64)
    assert X.xent_grad_(x[:0], t[:0], 1, impl="ref").shape == (0,)
    with pytest.raises(ValueError, match="BF16 logits"):
        X.xent_grad_(x.float(), t, 3)
    with pytest.raises(ValueError, match="contiguous rows"):
        X.xent_grad_(x.t(), t, 3)
    with pytest.raises(ValueError, match="do not match"):
        X.xent_grad_(x, t[:2], 3)
