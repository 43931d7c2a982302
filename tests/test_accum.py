"""moefp8/accum.py: the routed experts' gradients summed over micro-batches inside their wgrad GEMMs give
autograd's sums bit for bit, in both recipes; where the fusion applies; the training loop with it."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moefp8 import accum
from moefp8.config import Config, ModelConfig
from moefp8.hydra_config import compose_config
from moefp8.model import Transformer
from moefp8.overlap import OverlapPolicy
from moefp8.recipe import Recipe

CFG = ModelConfig()  # the tiny preset: 3 blocks, the first dense, then MoE
REPO = Path(__file__).resolve().parent.parent


def _grads(model, batches):
    """One step of len(batches) micro-batches, the training loop's way -> every parameter's gradient."""
    main = accum.armed(model)
    accum.zero(main)
    for x in batches:
        out = model(x[:, :-1], x[:, 1:])
        ((out.out + out.aux_loss) / len(batches)).backward()
    assert all(p.grad is None for p in main)  # autograd gave the armed weights nothing: summed in the GEMMs
    accum.to_grad(main)
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _tokens(seed, B=2, S=32):
    return torch.randint(0, CFG.vocab_size, (B, S + 1), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("recipe", ["fp8", "bf16"])
def test_summed_in_the_gemms_equals_autograds_sums(recipe):
    """Three micro-batches, two steps (the buffers zeroed between): every gradient, the experts' among them,
    is autograd's bit for bit; the expert weights' `.grad` is their main_grad, and autograd gave them none."""
    want = Transformer(CFG, Recipe(recipe), seed=0)
    got = Transformer(CFG, Recipe(recipe), seed=0)
    assert accum.arm(got, grad_accum=3, experts_alone=True) == 2 * (CFG.n_layers - CFG.n_dense_layers)
    for step in range(2):
        batches = [_tokens(10 * step + i) for i in range(3)]
        w, g = _grads(want, batches), _grads(got, batches)
        assert w.keys() == g.keys()
        for n in w:
            assert torch.equal(w[n], g[n]), (n, (w[n] - g[n]).abs().max().item())
        for b in got.layers[CFG.n_dense_layers:]:
            assert b.mlp.w1.grad is b.mlp.w1.main_grad and b.mlp.w2.grad is b.mlp.w2.main_grad
        for m in (want, got):
            for p in m.parameters():
                p.grad = None


def test_where_it_applies():
    """grad_accum > 1 where no other rank sums the experts' gradients, the plain schedule's routed experts only."""
    assert accum.arm(Transformer(CFG, Recipe("fp8"), seed=0), grad_accum=1, experts_alone=True) == 0
    assert accum.arm(Transformer(CFG, Recipe("fp8"), seed=0), grad_accum=2, experts_alone=False) == 0
    m = Transformer(CFG, Recipe("fp8"), seed=0, overlap=OverlapPolicy())
    assert accum.arm(m, grad_accum=2, experts_alone=True) == 0
    m = Transformer(CFG, Recipe("bf16"), seed=0)
    assert accum.arm(m, grad_accum=2, experts_alone=True) == 4 and accum.arm(m, 2, experts_alone=True) == 0  # once
    assert {id(p) for p in accum.armed(m)} == {id(w) for b in m.layers if b.is_moe for w in (b.mlp.w1, b.mlp.w2)}
    assert all(p.main_grad.dtype == torch.float32 and p.main_grad.shape == p.shape for p in accum.armed(m))


def test_a_gradient_autograd_gave_anyway_is_added_not_lost():
    p = torch.nn.Parameter(torch.zeros(3))
    p.main_grad = torch.ones(3)
    p.grad = torch.full((3,), 2.0)
    accum.to_grad([p])
    assert p.grad is p.main_grad and torch.equal(p.grad, torch.full((3,), 3.0))


def _run_args(data_dir, out, *extra, device: str = "cpu", micro_batch: int = 2, seq_len: int = 32) -> list:
    return ["model=tiny", f"train.device={device}", f"train.micro_batch={micro_batch}", f"train.seq_len={seq_len}",
            "train.grad_accum=2", "train.steps=3", "train.log_every=1", "train.ckpt_every=0", "train.eval_every=0",
            "train.progress=false", "logger.mode=disabled", "optim.lr=1e-3", f"data.path={data_dir}",
            "data.prepare_from=", f"train.out_dir={out}", *extra]


def _metrics(out) -> list:
    return [(r["loss"], r["grad_norm"]) for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())]


def test_training_loop_with_it_is_the_loop_without_it(data_dir, tmp_path):
    """train.grad_accum=2 on one process through the training loop: the same losses and
    gradient norms, step for step, as with train.grad_accum_fusion=false (autograd summing the experts' gradients)."""
    from moefp8.train import train

    def run(out, fused):
        train(compose_config(_run_args(data_dir, out, f"train.grad_accum_fusion={fused}")))
        return _metrics(out)

    fused, plain = run(tmp_path / "fused", "true"), run(tmp_path / "plain", "false")
    assert len(fused) == 3 and fused == plain
    assert Config().train.grad_accum == 1  # (the presets' default: nothing armed)


def _ep_runs(data_dir, tmp_path, *extra, **size) -> dict:
    """EP2 over 2 processes, micro-batch 1 each, 2 micro-batches a step, fused and not -> {fused: metrics}."""
    runs = {}
    for fused in ("true", "false"):
        out = tmp_path / fused
        r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                            "-m", "moefp8.train", "dispatch=all_to_all", "dispatch.ep_size=2",
                            *_run_args(data_dir, out, f"train.grad_accum_fusion={fused}", *extra, **size)],
                           cwd=REPO, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        said = "train.grad_accum=2: 4 routed expert weights sum their micro-batches' gradients inside their wgrad GEMMs"
        assert (said in r.stdout) == (fused == "true"), r.stdout[-2000:]
        runs[fused] = _metrics(out)
    return runs


def test_expert_parallel_over_every_rank_takes_it_too(data_dir, tmp_path):
    """2 gloo processes, EP2 (= world: no rank shares an expert's gradient), micro-batch 1 each, 2 micro-batches a
    step: said at start, and the same losses and gradient norms, bit for bit, as with train.grad_accum_fusion=false."""
    runs = _ep_runs(data_dir, tmp_path, micro_batch=1)
    assert len(runs["true"]) == 3 and runs["true"] == runs["false"], runs


@pytest.mark.gpu
def test_gpu_expert_parallel_over_nccl_takes_it_too(data_dir, tmp_path):
    """The same on 2 GPUs (NCCL, the k-grouped kernel's TMA-fed accumulation, FP8 and BF16), deterministic kernels."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    for recipe in ("fp8", "bf16"):
        runs = _ep_runs(data_dir, tmp_path / recipe, f"recipe={recipe}", "train.deterministic=true", device="cuda",
                        seq_len=128)
        assert len(runs["true"]) == 3 and runs["true"] == runs["false"], (recipe, runs)
