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


def test_capture_plan_and_the_halves_replay_check():
    """Which graphs are captured, in the step's order (the overlap: A then B per MoE block), and when a
    block replays its whole or half graph (shape, autograd, an input that requires grad, statistics)."""
    from moefp8.graphs import capture_plan

    m = Transformer(CFG, Recipe("bf16"))
    d, e1, e2 = blocks = list(m.layers)  # the tiny preset: one dense block, then two MoE blocks
    plan = [(blocks.index(b), w, n) for b, w, n in capture_plan(blocks, 5, None, False)]
    assert plan == [(0, None, 5), (1, None, 5), (2, None, 5)]
    plan = [(blocks.index(b), w, n) for b, w, n in capture_plan(blocks, 5, (3, 2), False)]  # auto: both
    assert plan == [(0, None, 5), (1, None, 5), (1, 0, 3), (1, 1, 2), (2, None, 5), (2, 0, 3), (2, 1, 2)]
    plan = [(blocks.index(b), w, n) for b, w, n in capture_plan(blocks, 4, (2, 2), True)]  # always split
    assert plan == [(0, None, 4), (1, 0, 2), (1, 1, 2), (2, 0, 2), (2, 1, 2)]
    assert capture_plan(blocks, 1, (1, 0), True) == [(d, None, 1), (e1, None, 1), (e2, None, 1)]
    H = CFG.hidden
    e1.graphed_halves = ((None, (3, 8, H)), (None, (2, 8, H)))
    xa = torch.zeros(3, 8, H, dtype=torch.bfloat16, requires_grad=True)
    xb = torch.zeros(2, 8, H, dtype=torch.bfloat16, requires_grad=True)
    assert replays(e1, xa, half=0) and replays(e1, xb, half=1) and not replays(e1, xb, half=0)
    with torch.no_grad():
        assert not replays(e1, xa, half=0)
    assert not replays(e1, xa.detach(), half=0)  # captured for an input that requires grad
    assert not replays(e1, xa) and not replays(e2, xa, half=0)  # no whole graph; e2 captured none
    m.scale_stats.on = True
    assert not replays(e1, xa, half=0)
    m.scale_stats.on = False
    e2.graphed_whole = (None, (3, 8, H))  # train.cuda_graphs_mlp: the whole block's graph
    assert replays(e2, xa, whole=True) and not replays(e2, xa) and not replays(e1, xa, whole=True)


def test_stackable_where_every_block_is_whole_capturable():
    """train.cuda_graphs_mlp captures the blocks as one graph at EP = 1 with every block whole-capturable; not
    with the overlap's halves, a block that recomputes its attention, or a MoE layer that is not capturable."""
    from moefp8.graphs import stackable
    from moefp8.overlap import OverlapPolicy

    assert stackable(Transformer(CFG, Recipe("fp8"), seed=0), None)
    assert not stackable(Transformer(CFG, Recipe("fp8"), seed=0), (1, 1))
    assert not stackable(Transformer(CFG, Recipe("fp8"), seed=0, overlap=OverlapPolicy()), None)
    assert not stackable(Transformer(CFG, Recipe("fp8"), seed=0, recompute=("attention",)), None)
    m = Transformer(CFG, Recipe("fp8"), seed=0)
    assert m.graphed_stack is None


def test_whole_capturable_blocks():
    """train.cuda_graphs_mlp captures a block whole where its MLP's shapes are static: dense MLPs, and MoE
    layers in the plain schedule with moefp8's experts that exchange no rows, or whose exchanges have fixed
    sizes and whose layouts are capped (dispatch.rows_factor); such a block under EP replays only while the
    cap is on (exact layouts run eagerly)."""
    from moefp8.graphs import whole_capturable
    from moefp8.moe_stages import RowCap
    from moefp8.overlap import OverlapPolicy

    assert all(whole_capturable(b) for b in Transformer(CFG, Recipe("bf16")).layers)
    ov = Transformer(CFG, Recipe("bf16"), overlap=OverlapPolicy()).layers
    assert [whole_capturable(b) for b in ov] == [not b.is_moe for b in ov]

    class Exchanging:
        communicates = True

        def __init__(self, static):
            self.static = static

        def static_exchange(self, topk):
            return self.static

    e = Transformer(CFG, Recipe("bf16")).layers[1]
    e.mlp.dispatcher = Exchanging(False)
    assert not whole_capturable(e)
    e.mlp.dispatcher = Exchanging(True)
    assert not whole_capturable(e)  # no cap: the layout reads its counts back
    e.mlp.row_cap = RowCap(1.5)
    assert whole_capturable(e)
    e.mlp.shared_overlap = True  # the side stream's exchange is captured with the block
    assert whole_capturable(e)
    e.mlp.shared_overlap = False
    x = torch.randn(3, 8, CFG.hidden, dtype=torch.bfloat16, requires_grad=True)
    e.graphed_whole = (None, (3, 8, CFG.hidden))
    assert not replays(e, x, whole=True)
    e.mlp.row_cap.on = True
    assert replays(e, x, whole=True)


def test_release_frees_the_graphs_held_in_cycles():
    """`graphs.release` (the training loop's, before the process group ends): the blocks' graphs, which hold
    their blocks (a reference cycle), are freed then, not at some later collection."""
    import gc
    import weakref

    from moefp8.graphs import release

    class Graphed:  # as make_graphed_callables' result holds the module that holds the block
        def __init__(self, block):
            self.block = block

    m = Transformer(CFG, Recipe("bf16"))
    gc.disable()
    try:
        refs = []
        for b in m.layers:
            b.graphed_attend, b.graphed_whole = (Graphed(b), None), (Graphed(b), None)
            b.graphed_halves = ((Graphed(b), None), (Graphed(b), None))
            refs += [weakref.ref(b.graphed_attend[0]), weakref.ref(b.graphed_whole[0]),
                     *(weakref.ref(h[0]) for h in b.graphed_halves)]
        release(m)
        assert all(r() is None for r in refs)
        assert all(b.graphed_whole is None and b.graphed_halves == (None, None) for b in m.layers)
    finally:
        gc.enable()


def test_row_cap_swap_returns_a_scope_of_flags():
    """`RowCap.swap`: a whole block's own layouts' flags (its graph's output), the running sum around it kept."""
    from moefp8.moe_stages import RowCap

    cap = RowCap(1.0)
    cap.note(torch.tensor([1], dtype=torch.int32))
    prior = cap.swap(None)
    cap.note(torch.tensor([2], dtype=torch.int32))
    mine = cap.swap(prior)
    assert mine.tolist() == [2] and cap.take().tolist() == [1] and cap.take() is None


def _failure(stderr: str) -> str:
    """A failed run's stderr for the assertion: its first error lines (a rank's own report, before the
    launcher's summary pushes it out of a plain tail) and its end."""
    first = [line for line in stderr.splitlines() if "Error" in line or "error" in line][:12]
    return "\n".join(first) + "\n...\n" + stderr[-2000:]


def _tokens(B, S, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, CFG.vocab_size, (B, S + 1), generator=g).cuda()


def _steps(model, batches, accum=1, graphed=False, bias=False):
    """Two optimizer steps; per step the loss and every gradient (cloned before zero_grad). bias: the
    routers' bias update after each step too (the training loop's, from the step's load)."""
    from moefp8.graphs import prepare_grads

    from moefp8 import accum as fused

    opt, got, main = AdamW(model.named_parameters(), Config().optim), [], fused.armed(model)
    for step in batches:
        if graphed and accum > 1:
            prepare_grads(model)
        fused.zero(main)  # (moefp8.accum's weights, where armed: the loop's order)
        losses = []
        for x in step[:accum]:
            out = model(x[:, :-1], x[:, 1:])
            ((out.out + out.aux_loss) / accum).backward()
            losses.append(out.out.detach())
        assert all(p.grad is None for p in main)  # summed inside the experts' GEMMs, replayed or not
        fused.to_grad(main)
        got.append((losses, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
                    out.nonfinite.clone()))
        opt.step(1e-3)
        opt.zero_grad()
        if bias:
            for router, load_E in zip(model.routers(), out.load_LE):
                router.update_bias(load_E)
    return got


def assert_same_steps(want, got):
    """`_steps` of two models: the same losses, gradients and non-finite flags, bit for bit."""
    for (lw, gw, nw), (lg, gg, ng) in zip(want, got):
        assert all(torch.equal(a, b) for a, b in zip(lw, lg)), (lw, lg)
        assert gw.keys() == gg.keys() and torch.equal(nw, ng)
        for n in gw:
            assert torch.equal(gw[n], gg[n]), (n, (gw[n] - gg[n]).abs().max().item())


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
    assert_same_steps(want, got)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe, accum, fused, stack", [("fp8", 1, False, True), ("bf16", 1, False, True),
                                                         ("fp8", 2, False, True), ("fp8", 3, True, True),
                                                         ("bf16", 3, True, True), ("fp8", 1, False, False),
                                                         ("fp8", 3, True, False)])
def test_gpu_replayed_whole_blocks_equal_eager(recipe, accum, fused, stack, monkeypatch):
    """train.cuda_graphs_mlp at EP = 1: every block, dense and MoE, replays whole (attention, MLP or MoE
    layer: its rows at their static bound), the stack of them as one graph (stack; else one graph a block).
    Two optimizer steps with the routers' bias update between: the eager model's losses and gradients bit for
    bit, so the replays quantize the updated weights (the FP8 copies are made inside the captured forward)
    and read the updated bias; no eager block code runs. fused: the replayed model's experts sum their
    micro-batches' gradients inside the captured GEMMs (moefp8.accum, armed before the capture), the eager
    one's through autograd."""
    from moefp8 import graphs
    from moefp8.accum import arm

    torch.backends.cuda.enable_flash_sdp(False)
    B, S = 2, 128
    batches = [[_tokens(B, S, 10 * s + i) for i in range(accum)] for s in range(2)]
    want = _steps(Transformer(CFG, Recipe(recipe), seed=0).cuda(), batches, accum, bias=True)
    m = Transformer(CFG, Recipe(recipe), seed=0).cuda()
    if fused:
        assert arm(m, accum, experts_alone=True) == 4  # the two MoE blocks' w1 and w2
    if not stack:
        monkeypatch.setattr(graphs, "stackable", lambda *a: False)
    assert graph_attention(m, B, S, mlp=True) == CFG.n_layers
    assert (m.graphed_stack is not None) == stack
    assert all((b.graphed_whole is None) == stack and b.graphed_attend is None for b in m.layers)
    for b in m.layers:  # a replay calls none of the block's eager code
        b.attend = b.whole_checked = None
    got = _steps(m, batches, accum, graphed=True, bias=True)
    assert_same_steps(want, got)


@pytest.mark.gpu
def test_gpu_whole_blocks_only_where_the_mlp_is_static():
    """With the overlap (the MoE layer's schedule splits and exchanges) the MoE blocks keep their attention
    graphs; the dense block is captured whole."""
    from moefp8.overlap import OverlapPolicy

    m = Transformer(CFG, Recipe("bf16"), seed=0, overlap=OverlapPolicy()).cuda()
    assert graph_attention(m, 2, 128, mlp=True) == CFG.n_layers
    assert [b.graphed_whole is not None for b in m.layers] == [not b.is_moe for b in m.layers]
    assert all(b.graphed_attend is not None for b in m.layers if b.is_moe)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe, overlap_only", [("fp8", True), ("bf16", True), ("fp8", False)])
def test_gpu_overlap_replays_the_halves_graphs(recipe, overlap_only):
    """The two micro-batch overlap (moefp8.overlap, here at EP=1) with its MoE blocks' attention
    replayed from one graph per half: the overlapped eager model's losses and gradients bit for bit,
    over two optimizer steps; evaluation (no autograd) stays eager."""
    from moefp8.overlap import OverlapPolicy

    torch.backends.cuda.enable_flash_sdp(False)
    B, S = 4, 128
    batches = [[_tokens(B, S, 10 * s)] for s in range(2)]
    want = _steps(Transformer(CFG, Recipe(recipe), seed=0, overlap=OverlapPolicy()).cuda(), batches)
    m = Transformer(CFG, Recipe(recipe), seed=0, overlap=OverlapPolicy()).cuda()
    assert graph_attention(m, B, S, halves=(2, 2), overlap_only=overlap_only) == CFG.n_layers
    moe = [b for b in m.layers if b.is_moe]
    assert moe and all(b.graphed_halves[0] is not None and b.graphed_halves[1] is not None for b in moe)
    assert all((b.graphed_attend is None) == (overlap_only and b.is_moe) for b in m.layers)
    eager = {b: b.attend for b in m.layers}
    for b in m.layers:  # the eager attention must not run: a replay does not call it
        b.attend = None
    got = _steps(m, batches, graphed=True)
    assert_same_steps(want, got)
    for b, f in eager.items():
        b.attend = f
    def boom(*_):
        raise AssertionError("a half's graph replayed without autograd")

    for b in moe:
        b.graphed_halves = tuple((boom, g[1]) for g in b.graphed_halves)
    x = _tokens(B, S, 99)
    with torch.no_grad():  # evaluation: the overlapped blocks' attention runs eagerly
        m(x[:, :-1], x[:, 1:])


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
@pytest.mark.parametrize("gpus, overlap", [(1, "false"), (2, "false"), (2, "true")])
def test_gpu_training_with_cuda_graphs_repeats_the_eager_losses(data_dir, tmp_path, gpus, overlap):
    """`train.cuda_graphs=true` through the Hydra entry point: said at start, and with deterministic
    kernels the same losses and gradient norms as the eager run, step for step; on 2 GPUs (EP2: the replicated weights'
    gradients in the data-parallel buckets, whose `.grad` views the replayed backward adds into) too, and
    with the two micro-batch overlap (the MoE blocks replay one graph per half). On one GPU also with
    `train.cuda_graphs_mlp=true` (every block replayed whole; evaluation eager between)."""
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} GPUs")
    launch = [sys.executable] + (["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
                                  "moefp8.train", "dispatch=all_to_all", "dispatch.ep_size=2",
                                  f"dispatch.overlap={overlap}"] if gpus == 2 else ["-m", "moefp8.train"])
    runs = {}
    for graphs in ("false", "true") + (("mlp",) if gpus == 1 else ()):
        stdout, runs[graphs] = _hydra_run(launch, data_dir, tmp_path / graphs, f"train.cuda_graphs={graphs != 'false'}",
                                          f"train.cuda_graphs_mlp={graphs == 'mlp'}")
        said = "train.cuda_graphs: the attention of 3 of 3 blocks replays CUDA graphs" + {
            "mlp": "; 3 of them whole, with their MLP (train.cuda_graphs_mlp), as one graph\n",
            "true": "; the MoE blocks' for the overlap's halves of 2 and 2 sequences" if overlap == "true" else "\n",
            "false": "\n"}[graphs]
        assert (said in stdout) == (graphs != "false"), stdout[-2000:]
    assert len(runs["true"]) == 4 and all(runs[g] == runs["false"] for g in runs)


def _hydra_run(launch: list, data_dir, out, *overrides) -> tuple[str, list]:
    """4 steps of the tiny model through the Hydra entry point (deterministic kernels, the held-out loss every
    2) -> (its stdout, [(loss, grad norm, held-out loss)] per step)."""
    r = subprocess.run([*launch, "model=tiny", "train.device=cuda",
                        "train.micro_batch=4", "train.seq_len=128", "train.steps=4", "train.log_every=1",
                        "train.ckpt_every=0", "train.progress=false", "logger.mode=disabled",
                        "train.deterministic=true", "train.eval_every=2", "data.val_windows=8",
                        f"data.path={data_dir}", "data.max_bytes=2000000", f"train.out_dir={out}", *overrides],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, _failure(r.stderr)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return r.stdout, [(x["loss"], x["grad_norm"], x.get("val_loss")) for x in rows]


@pytest.mark.gpu
def test_gpu_whole_blocks_under_ep_repeat_the_eager_losses(data_dir, tmp_path):
    """EP2 on 2 GPUs (the all_to_all capacity mode over NCCL): with dispatch.rows_factor the MoE blocks replay
    whole graphs that hold the exchanges (train.cuda_graphs_mlp), said at start, and give the eager run's losses,
    gradient norms and held-out losses bit for bit; at a factor the fresh router overflows, the steps run again
    eagerly with exact layouts, the same figures; without a factor the MoE blocks stay eager, said why."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
              "moefp8.train", "dispatch=all_to_all", "dispatch.ep_size=2", "dispatch.mode=capacity"]
    graphs = ("train.cuda_graphs=true", "train.cuda_graphs_mlp=true")
    _, want = _hydra_run(launch, data_dir, tmp_path / "eager", "dispatch.rows_factor=2.0")
    said, whole = _hydra_run(launch, data_dir, tmp_path / "whole", "dispatch.rows_factor=2.0", *graphs)
    assert "blocks replays CUDA graphs; 3 of them whole, with their MLP (train.cuda_graphs_mlp)\n" in said, said
    _, tight = _hydra_run(launch, data_dir, tmp_path / "tight", "dispatch.rows_factor=1.0", *graphs)
    said0, uncapped = _hydra_run(launch, data_dir, tmp_path / "uncapped", *graphs)
    assert "; the MoE blocks under EP whole only with dispatch.rows_factor > 0, dispatch.overlap=false" in said0, said0
    assert len(want) == 4 and whole == want and tight == want and uncapped == want


@pytest.mark.gpu
def test_gpu_whole_blocks_with_shared_overlap_repeat_the_eager_losses(data_dir, tmp_path):
    """EP2 on 2 GPUs: whole MoE blocks (dispatch.rows_factor) with dispatch.shared_overlap capture the
    exchanges on the side stream with the block; their replays give the eager run's losses, gradient norms
    and held-out losses bit for bit (the shared overlap runs the same operations on the same values)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
              "moefp8.train", "dispatch=all_to_all", "dispatch.ep_size=2", "dispatch.mode=capacity",
              "dispatch.rows_factor=2.0"]
    _, want = _hydra_run(launch, data_dir, tmp_path / "eager")
    said, whole = _hydra_run(launch, data_dir, tmp_path / "whole", "dispatch.shared_overlap=true",
                             "train.cuda_graphs=true", "train.cuda_graphs_mlp=true")
    assert "blocks replays CUDA graphs; 3 of them whole, with their MLP (train.cuda_graphs_mlp)\n" in said, said
    assert len(want) == 4 and whole == want
