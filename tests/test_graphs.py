"""moefp8/graphs.py: the blocks' attention replayed from CUDA graphs gives the eager step's loss and
gradients bit for bit (two optimizer steps: the replay reads the updated weights), also with two
micro-batches per step on one process; evaluation, FP8 statistics and recomputed blocks run eagerly;
the training loop's switch. On CPU: the switch says it is off."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moefp8.config import Config, ModelConfig
from moefp8.graphs import graph_attention, replays
from moefp8.model import Transformer
from moefp8.optim import AdamW
from moefp8.recipe import Recipe

REPO = Path(__file__).resolve().parent.parent
CFG = ModelConfig()  # the tiny preset: 3 blocks, the first dense, then MoE


def test_switch_is_off_on_cpu():
    from moefp8.build import cuda_graphs

    c, said = Config(), []
    c.train.cuda_graphs = True
    m = Transformer(c.model, Recipe("bf16"))
    assert cuda_graphs(c, m, torch.device("cpu"), said.append) == 0
    assert said == ["train.cuda_graphs: off (not a CUDA device (cpu))"]
    assert all(b.graphed_attend is None for b in m.layers)
    c.train.cuda_graphs, said = False, []
    assert cuda_graphs(c, m, torch.device("cpu"), said.append) == 0 and said == []


def _tokens(B, S, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, CFG.vocab_size, (B, S + 1), generator=g).cuda()


def _steps(model, batches, accum=1, graphed=False):
    """Two optimizer steps; per step the loss and every gradient (cloned before zero_grad)."""
    from moefp8.graphs import prepare_grads

    opt, got = AdamW(model.named_parameters(), Config().optim), []
    for step in batches:
        if graphed and accum > 1:
            prepare_grads(model)
        losses = []
        for x in step[:accum]:
            out = model(x[:, :-1], x[:, 1:])
            ((out.out + out.aux_loss) / accum).backward()
            losses.append(out.out.detach())
        got.append((losses, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
                    out.nonfinite.clone()))
        opt.step(1e-3)
        opt.zero_grad()
    return got


@pytest.mark.gpu
@pytest.mark.parametrize("recipe, accum", [("fp8", 1), ("bf16", 1), ("fp8", 2)])
def test_gpu_replayed_attention_equals_eager(recipe, accum):
    torch.backends.cuda.enable_flash_sdp(False)  # a deterministic attention backward for the comparison
    B, S = 2, 128
    batches = [[_tokens(B, S, 10 * s + i) for i in range(accum)] for s in range(2)]
    want = _steps(Transformer(CFG, Recipe(recipe), seed=0).cuda(), batches, accum)
    m = Transformer(CFG, Recipe(recipe), seed=0).cuda()
    assert graph_attention(m, B, S) == CFG.n_layers
    for b in m.layers:  # the eager attention must not run: a replay does not call it
        b.attend = None
    got = _steps(m, batches, accum, graphed=True)
    for (lw, gw, nw), (lg, gg, ng) in zip(want, got):
        assert all(torch.equal(a, b) for a, b in zip(lw, lg)), (lw, lg)
        assert gw.keys() == gg.keys() and torch.equal(nw, ng)
        for n in gw:
            assert torch.equal(gw[n], gg[n]), (n, (gw[n] - gg[n]).abs().max().item())


@pytest.mark.gpu
def test_gpu_eager_where_a_replay_does_not_apply():
    """No autograd (evaluation), another shape, FP8 statistics on: the eager attention, the same
    outputs as a model that never captured; blocks that recompute their attention are not captured."""
    torch.backends.cuda.enable_flash_sdp(False)
    ref, m = Transformer(CFG, Recipe("fp8"), seed=0).cuda(), Transformer(CFG, Recipe("fp8"), seed=0).cuda()
    graph_attention(m, 2, 128)
    x = _tokens(2, 128, 0)
    h = torch.zeros(2, 128, CFG.hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with torch.no_grad():
        assert not replays(m.layers[0], h)
        assert torch.equal(m(x[:, :-1], x[:, 1:]).out, ref(x[:, :-1], x[:, 1:]).out)
    assert replays(m.layers[0], h) and not replays(m.layers[0], h[:1])
    y = _tokens(1, 128, 1)
    assert torch.equal(m(y[:, :-1], y[:, 1:]).out, ref(y[:, :-1], y[:, 1:]).out)  # half the batch: eager
    m.scale_stats.on = ref.scale_stats.on = True
    assert not replays(m.layers[0], h)
    assert torch.equal(m(x[:, :-1], x[:, 1:]).out, ref(x[:, :-1], x[:, 1:]).out)
    assert m.scale_stats.report() == ref.scale_stats.report()
    r = Transformer(CFG, Recipe("fp8"), seed=0, recompute=("attention",)).cuda()
    assert graph_attention(r, 2, 128) == 0 and all(b.graphed_attend is None for b in r.layers)


@pytest.mark.gpu
@pytest.mark.parametrize("gpus", [1, 2])
def test_gpu_training_with_cuda_graphs_repeats_the_eager_losses(data_dir, tmp_path, gpus):
    """`train.cuda_graphs=true` through the Hydra entry point: said at start, and with deterministic
    kernels the same losses and gradient norms as the eager run, step for step; on 2 GPUs (EP2: the replicated weights'
    gradients in the data-parallel buckets, whose `.grad` views the replayed backward adds into) too."""
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} GPUs")
    launch = [sys.executable] + (["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
                                  "moefp8.train", "dispatch=all_to_all", "dispatch.ep_size=2"] if gpus == 2
                                 else ["-m", "moefp8.train"])
    runs = {}
    for graphs in ("false", "true"):
        out = tmp_path / graphs
        r = subprocess.run([*launch, "model=tiny", "train.device=cuda",
                            "train.micro_batch=4", "train.seq_len=128", "train.steps=4", "train.log_every=1",
                            "train.ckpt_every=0", "train.progress=false", "logger.mode=disabled",
                            "train.deterministic=true", "train.eval_every=2", "data.val_windows=8",
                            f"data.path={data_dir}", "data.max_bytes=2000000", f"train.out_dir={out}",
                            f"train.cuda_graphs={graphs}"],
                           cwd=REPO, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        said = "train.cuda_graphs: the attention of 3 of 3 blocks replays CUDA graphs"
        assert (said in r.stdout) == (graphs == "true"), r.stdout[-2000:]
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        runs[graphs] = [(x["loss"], x["grad_norm"], x.get("val_loss")) for x in rows]
    assert len(runs["true"]) == 4 and runs["true"] == runs["false"]
