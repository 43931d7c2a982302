"""Two micro-batch overlap (moefp8.overlap): the overlapped MoE layer and the overlapped
transformer block equal their serialized schedules (the same two micro-batches, one after the
other) bit for bit, forward and backward, at EP=1 and on real process groups (gloo on CPU; NCCL
on GPUs, marker `gpu`), and the unsplit MoE layer up to the fp32 order of dW_A + dW_B."""

import pytest
import torch
import torch.distributed as dist

from moefp8.config import ModelConfig
from moefp8.dispatch import build_dispatcher
from moefp8.kernels.rope import rope_tables
from moefp8.model import Block
from moefp8.moe import MoELayer
from moefp8.overlap import Handoff, OverlapPolicy, mean_over_halves, serialized, serialized_block
from moefp8.recipe import Recipe
from moefp8.testing import rel_err, spawn_group

H, I, E, K = 256, 128, 8, 2


def run(layer, x, dout, fn):
    layer.zero_grad()
    x = x.clone().requires_grad_()
    out = fn(x)
    out.backward(dout)
    return [out, x.grad] + [p.grad.clone() for p in layer.parameters()]


def assert_overlapped_equal(names, got, want):
    """The overlapped run's tensors (got) == the serialized run's (want), bit for bit, finite."""
    for n, g, w in zip(names, got, want):
        assert torch.isfinite(g.float()).all(), f"{n}: overlapped has non-finite values"
        assert torch.equal(g, w), f"{n}: overlapped != serialized, rel. err {rel_err(g.float(), w.float()):.2e}"


def check(layer, x, dout, device):
    names = ["out", "dx"] + [n for n, _ in layer.named_parameters()]
    layer.overlap = OverlapPolicy()
    got = run(layer, x, dout, lambda x: layer(x).out)
    layer.overlap = None
    want = run(layer, x, dout, lambda x: serialized(layer, x))
    assert_overlapped_equal(names, got, want)
    unsplit = run(layer, x, dout, lambda x: layer(x).out)
    # vs. the unsplit layer: the weight gradients' col-wise FP8 tiles (128 tokens of one expert)
    # hold other tokens once the batch is split, so their scales and codes can differ (measured on
    # 4x H200: dW1 2.4e-3), and dW_A + dW_B adds in another fp32 order; the rest is row-local
    tol = 1e-2
    for n, g, w in zip(names, got, unsplit):
        assert rel_err(g.float(), w.float()) < tol, f"{n}: overlapped vs unsplit {rel_err(g.float(), w.float()):.2e}"


@pytest.mark.parametrize("recipe,n_shared,T", [("fp8", 1, 100), ("bf16", 1, 37), ("fp8", 0, 1)])
def test_overlap_equals_serialized_ep1(recipe, n_shared, T):
    torch.manual_seed(0)
    layer = MoELayer(H, I, E, K, n_shared=n_shared, recipe=Recipe(recipe))
    x, dout = torch.randn(T, H).bfloat16(), torch.randn(T, H).bfloat16()
    check(layer, x, dout, "cpu")


def make_block(recipe, dispatcher, dev, seq_aux_alpha=1e-2):
    """A transformer block with a MoE layer at test sizes, every weight drawn from seed 0."""
    torch.manual_seed(0)
    cfg = ModelConfig(hidden=H, n_heads=2, head_dim=128, moe_inter=I, n_experts=E, topk=K, n_dense_layers=0,
                      seq_aux_alpha=seq_aux_alpha)
    block = Block(cfg, 0, Recipe(recipe), dispatcher, overlap=OverlapPolicy())
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape) * 0.05 if p.dim() > 1 else 1 + 0.1 * torch.randn(p.shape))
    return block.to(dev)


def check_block(block, x, dout):
    """Overlapped (`Block.forward` with overlap on) == serialized_block bit for bit: the output,
    the balance loss, the load, dx and every parameter's gradient."""
    cos, sin = rope_tables(x.shape[1], 128, 1e4, x.device)
    names = ["out", "aux", "load", "dx"] + [n for n, _ in block.named_parameters()]

    def run(fn):
        block.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        out, aux, load = fn(xi)
        torch.autograd.backward([out, aux], [dout, torch.tensor(3.0, device=x.device)])
        return [out, aux, load, xi.grad] + [p.grad.clone() for p in block.parameters()]

    got = run(lambda xi: block(xi, cos, sin, []))
    ref = serialized_block  # the two halves through the plain block, one after the other
    want = run(lambda xi: (lambda o: (o[0], mean_over_halves(o[1], x.shape[0]), o[2]))(ref(block, xi, cos, sin)))
    assert_overlapped_equal(names, got, want)


def check_chain(blocks, x, dout):
    """Consecutive overlapped blocks passing a `Handoff` (each block's output half B finished
    behind its combine, read by the next block after the handoff's event, as the model's loop
    runs them) == the blocks' serialized schedules one after the other, bit for bit: the output,
    dx and every parameter's gradient."""
    cos, sin = rope_tables(x.shape[1], 128, 1e4, x.device)
    params = [p for b in blocks for p in b.parameters()]

    def run(step):
        for b in blocks:
            b.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        out = xi
        handoff = Handoff()
        for b in blocks:
            out = step(b, out, handoff)
        handoff.wait()
        out.backward(dout)
        return [out, xi.grad] + [p.grad.clone() for p in params]

    got = run(lambda b, xi, h: b(xi, cos, sin, [], h)[0])
    want = run(lambda b, xi, h: serialized_block(b, xi, cos, sin)[0])
    names = ["out", "dx"] + [f"{i}.{n}" for i, b in enumerate(blocks) for n, _ in b.named_parameters()]
    assert_overlapped_equal(names, got, want)


@pytest.mark.parametrize("recipe,B", [("fp8", 2), ("fp8", 3), ("bf16", 2)])
def test_block_overlap_equals_serialized_ep1(recipe, B):
    block = make_block(recipe, None, "cpu")
    g = torch.Generator().manual_seed(1)
    x, dout = torch.randn(B, 24, H, generator=g).bfloat16(), torch.randn(B, 24, H, generator=g).bfloat16()
    check_block(block, x, dout)


def _two_blocks(recipe, dispatcher, dev):
    blocks = [make_block(recipe, dispatcher, dev) for _ in range(2)]
    with torch.no_grad():  # the second block's weights differ from the first's
        for p in blocks[1].parameters():
            p.mul_(0.9)
    return blocks


def test_consecutive_blocks_with_handoff_equal_serialized_ep1():
    g = torch.Generator().manual_seed(2)
    x, dout = torch.randn(2, 24, H, generator=g).bfloat16(), torch.randn(2, 24, H, generator=g).bfloat16()
    check_chain(_two_blocks("fp8", None, "cpu"), x, dout)


@pytest.mark.gpu
def test_gpu_handoff_equals_serialized_and_can_fail():
    """On a GPU the handoff is a real cross-stream dependency: two blocks at EP=1 equal their
    serialized chain; and with `Handoff.wait` disabled and B's combine delayed on the comm
    stream (a sleep kernel), the next block reads its input's B half unwritten and the check fails."""
    import moefp8.overlap as ov

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    g = torch.Generator().manual_seed(3)
    x, dout = (torch.randn(2, 64, H, generator=g).bfloat16().cuda() for _ in range(2))
    blocks = _two_blocks("fp8", None, "cuda")
    check_chain(blocks, x, dout)
    real_wait, real_combine = Handoff.wait, ov._MoEForward.combine

    def slow_combine(self, i):
        with self.st.on_comm():
            torch.cuda._sleep(200_000_000)  # ~0.1 s on the comm stream
        real_combine(self, i)

    Handoff.wait = lambda self: None
    ov._MoEForward.combine = slow_combine
    try:  # other inputs: memory reused from the runs above must not hold the right values by chance
        # (what the unwritten half holds decides how the check fails: wrong values, or NaN bits)
        with pytest.raises(AssertionError, match="overlapped (!= serialized|has non-finite values)"):
            check_chain(blocks, 2 * x, dout)
    finally:
        Handoff.wait, ov._MoEForward.combine = real_wait, real_combine
    torch.cuda.synchronize()


def test_block_overlap_can_fail():
    """The check sees a wrong gradient: micro-batch A's routed input gradient halved on its way
    into A's attention backward (a schedule mixing up what it hands over) fails it."""
    import moefp8.overlap as ov

    block = make_block("fp8", None, "cpu")
    x, dout = torch.randn(2, 16, H).bfloat16(), torch.randn(2, 16, H).bfloat16()
    real = ov._MoEBackward.routed

    def wrong(self, i):
        dx, dw = real(self, i)
        return (dx * 0.5 if i == 0 else dx), dw

    ov._MoEBackward.routed = wrong
    try:
        with pytest.raises(AssertionError, match="overlapped != serialized"):
            check_block(block, x, dout)
    finally:
        ov._MoEBackward.routed = real


def _ep_case(rank, world, dev, cases):
    """cases: (recipe, mode[, transport])."""
    for recipe, mode, *transport in cases:
        torch.manual_seed(0)
        T_max = 64 + 19 * (world - 1)
        layer = MoELayer(H, I, E, K, n_shared=1, recipe=Recipe(recipe),
                         dispatcher=build_dispatcher("all_to_all", E, None, capacity=T_max, mode=mode,
                                                     transport=(transport or ["collective"])[0])).to(dev)
        g = torch.Generator().manual_seed(10 + rank)
        T = 64 + 19 * rank  # ragged across ranks
        x = torch.randn(T, H, generator=g).bfloat16().to(dev)
        dout = torch.randn(T, H, generator=g).bfloat16().to(dev)
        check(layer, x, dout, dev)
        # the schedule repeats without hanging or drifting
        layer.overlap = OverlapPolicy()
        for _ in range(3 if dev == "cpu" else 100):
            layer.zero_grad()
            layer(x).out.backward(dout)
        dist.barrier()
    # the transformer block: two sequences per micro-batch at most, ragged sequence counts are not
    # allowed (every rank splits its batch the same way), ragged contents are
    for recipe, mode, *transport in cases:
        B, S = 3, 32
        block = make_block(recipe, build_dispatcher("all_to_all", E, None, capacity=2 * S, mode=mode,
                                                    transport=(transport or ["collective"])[0]), dev)
        g = torch.Generator().manual_seed(20 + rank)
        x = torch.randn(B, S, H, generator=g).bfloat16().to(dev)
        dout = torch.randn(B, S, H, generator=g).bfloat16().to(dev)
        check_block(block, x, dout)
        check_chain(_two_blocks(recipe, block.mlp.dispatcher, dev), x, dout)
        cos, sin = rope_tables(S, 128, 1e4, x.device)
        for _ in range(3 if dev == "cpu" else 100):
            block.zero_grad()
            block(x, cos, sin, [])[0].backward(dout)
        dist.barrier()


def _shared_overlap_case(rank, world, dev, cases):
    """dispatch.shared_overlap: the plain schedule with the shared experts run while the dispatches
    exchange on the side stream equals it without, bit for bit (the same operations on the same
    values; only the streams differ), and repeats without hanging. On CPU there is no side stream:
    the plumbing only."""
    for recipe, mode in cases:
        torch.manual_seed(0)
        layer = MoELayer(H, I, E, K, n_shared=1, recipe=Recipe(recipe),
                         dispatcher=build_dispatcher("all_to_all", E, None, capacity=64 + 19 * (world - 1),
                                                     mode=mode)).to(dev)
        g = torch.Generator().manual_seed(30 + rank)
        T = 64 + 19 * rank  # ragged across ranks
        x = torch.randn(T, H, generator=g).bfloat16().to(dev)
        dout = torch.randn(T, H, generator=g).bfloat16().to(dev)
        names = ["out", "dx"] + [n for n, _ in layer.named_parameters()]
        want = run(layer, x, dout, lambda x: layer(x).out)
        layer.shared_overlap = True
        assert (layer.shared_overlap_stream(x) is not None) == (dev != "cpu" and mode == "capacity")
        got = run(layer, x, dout, lambda x: layer(x).out)
        assert_overlapped_equal(names, got, want)
        for _ in range(2 if dev == "cpu" else 100):
            layer.zero_grad()
            layer(x).out.backward(dout)
        dist.barrier()


def test_shared_overlap_equals_plain_gloo_ep2():
    spawn_group(_shared_overlap_case, 2, [("fp8", "capacity"), ("bf16", "exact")])


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
def test_gpu_shared_overlap_equals_plain_nccl(world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    spawn_group(_shared_overlap_case, world, [("fp8", "capacity"), ("bf16", "capacity"), ("fp8", "exact")],
                backend="nccl", timeout_s=300)


def test_overlap_equals_serialized_gloo_ep2():
    spawn_group(_ep_case, 2, [("fp8", "exact"), ("bf16", "exact"), ("fp8", "capacity")])


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
def test_gpu_overlap_equals_serialized_nccl(world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    spawn_group(_ep_case, world, [("fp8", "exact"), ("bf16", "exact"), ("fp8", "capacity")], backend="nccl",
                timeout_s=300)


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
def test_gpu_overlap_copy_engine(world):
    """The capacity mode over the copy engines (dispatch/copy_engine.py): the same bit-exact checks
    and 100 iterations of both schedules."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    spawn_group(_ep_case, world, [("fp8", "capacity", "copy_engine"), ("bf16", "capacity", "copy_engine")],
                backend="nccl", timeout_s=300)


def test_training_with_overlap(tmp_path, data_dir):
    """`dispatch.overlap=true` through the real config path: the tiny model trains, and its first
    step's loss equals the run without overlap (the forward is bit-exact; later steps differ by
    the fp32 order of the expert weight gradients)."""
    import json

    from moefp8.hydra_config import compose_config
    from moefp8.train import train

    losses = {}
    for ov in ("false", "true"):
        out = tmp_path / f"run-{ov}"
        train(compose_config([f"dispatch.overlap={ov}", "train.steps=3", "train.log_every=1", "train.micro_batch=2",
                              "train.seq_len=64", "train.progress=false", "logger.mode=disabled", "optim.warmup_steps=1",
                              f"data.path={data_dir}", "data.max_bytes=2000000", f"train.out_dir={out}",
                              "train.ckpt_every=0"]))
        losses[ov] = [json.loads(l)["loss"] for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(losses["true"]) == 3 and all(torch.isfinite(torch.tensor(losses["true"])))
    assert losses["true"][0] == losses["false"][0]


def test_bench_overlap_smoke(tmp_path):
    """tools/bench_overlap.py end to end on 2 gloo ranks (tiny shapes): JSON rows and a trace."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    out = tmp_path / "overlap.json"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        "tools/bench_overlap.py", "--smoke", "--trace-all-ranks", "--timeline", "2", "--clocks", "--aligned",
                        "--rounds", "3", "--blocks", "1,2", "--out", str(out)], cwd=repo,
                       capture_output=True,
                       text=True, timeout=300, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(out.read_text())
    impls = {row["impl"] for row in doc["rows"]}
    assert {"overlap on", "communication alone", "overlap on, compute only (exchanges replayed)",
            "overlap on, compute only + the exchanges' rank synchronization (diagnostic)"} <= impls
    on = [row for row in doc["rows"] if row["impl"] == "overlap on"]
    assert all("hidden_transfer_share_diagnostic" in row for row in on)
    for row in on:  # --aligned: every step started together; --clocks: nvidia-smi samples ({} without it)
        assert row["t_on_aligned_ms"] > 0 and row["t_compute_only_aligned_ms"] > 0 and "hidden_comm_share_aligned" in row
        assert isinstance(row["gpus_on"], dict) and isinstance(row["gpus_compute_only"], dict)
    for row in on:  # --rounds 3: three rounds of (on, compute only, comm); the headline share is their median
        shares = sorted(row["rounds_hidden_comm_share"])
        assert len(row["rounds_on_compute_comm_ms"]) == 3 and abs(row["hidden_comm_share"] - shares[1]) < 2e-3
        assert all(min(rd) > 0 for rd in row["rounds_on_compute_comm_ms"])
        for (on_ms, comp_ms, comm_ms), share in zip(row["rounds_on_compute_comm_ms"], row["rounds_hidden_comm_share"]):
            assert abs(1 - (on_ms - comp_ms) / comm_ms - share) < 2e-3
    blocks = {row["blocks"] for row in on if row["unit_kind"] == "block"}  # --blocks 1,2: two block units
    assert blocks == {1, 2} and all(row["per_block_on_off_serial_ms"][0] > 0 for row in on)
    replay = [row for row in doc["rows"] if row["impl"] == "overlap on, compute only (exchanges replayed)"]
    assert all(len(row["per_rank_ms"]) == 2 for row in replay)
    assert (tmp_path / doc["trace"]).is_file()
    assert (tmp_path / doc["trace"].replace(".trace.json.gz", ".trace.rank1.json.gz")).is_file()
    # --timeline: every unit's overlapped step in stages, per rank, real and replayed exchanges
    assert len(doc["timelines"]) == len(on)
    for tl in doc["timelines"]:
        stages = {t["stage"]: t for t in tl["stages"]}
        assert {"wait A rows", "A experts", "wait B combine", "sum: wait", "sum: host gap", "step"} <= set(stages)
        for t in tl["stages"]:
            if t["stage"].startswith("comm: "):  # when each exchange ended on the comm stream
                assert len(t["on_at_ms"]) == 2
                continue
            assert len(t["on_ms"]) == len(t["compute_ms"]) == 2 and min(t["on_ms"] + t["compute_ms"]) >= 0
            if not t["stage"].startswith(("sum: ", "step")):  # the GPU's lag behind the host (CPU: none)
                assert len(t["on_queue_ms"]) == len(t["compute_queue_ms"]) == 2
        assert {"step 1 of 2", "step 2 of 2"} <= set(stages)  # each back-to-back step's time; the last broken down
        assert all(abs(stages["step 2 of 2"]["on_ms"][r] - stages["step"]["on_ms"][r]) < 1e-2 for r in range(2))
        step = stages["step"]["on_ms"]
        parts = [stages[f"sum: {k}"]["on_ms"] for k in ("wait", "host gap", "work")]
        assert all(abs(sum(p[r] for p in parts) - step[r]) < 1e-2 for r in range(2))
