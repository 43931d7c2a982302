"""tools/profile_step.py end to end on CPU (tiny model, one step each): both recipes timed, a
kernel table per recipe, the JSON written; under torchrun a variant sweep over rounds with its
medians and ratios."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent


def test_profile_step_smoke(tmp_path):
    out = tmp_path / "profile.json"
    r = subprocess.run([sys.executable, "tools/profile_step.py", "model=tiny", "train.device=cpu", "train.micro_batch=2",
                        "train.seq_len=32", "--warmup", "1", "--steps", "1", "--profile-steps", "1", "--top", "5",
                        "--host-profile", "--soak", "1", "--json", str(out)], cwd=REPO, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(out.read_text())
    fp8 = doc["summary"][1]  # (the soak's run of bf16 first: not a row)
    assert doc["complete"] and fp8["recipe"] == "fp8" and fp8["rounds"] == 1 and f"over_bf16 {fp8['over_bf16']:.3f}" in r.stdout
    assert [row["recipe"] for row in doc["rows"]] == ["bf16", "fp8"]
    assert all(row["step_ms"] > 0 and 0 < len(row["top"]) <= 5 for row in doc["rows"])
    assert all(0 < row["host_ms"] <= row["step_ms"] * 1.5 and row["gpu_ops_per_step"] == 0 for row in doc["rows"])
    assert all(row["gemm_lib"] == "moefp8" for row in doc["rows"])  # the m-grouped GEMMs' library, as built
    ours = ("moefp8/", "kernels/", "dispatch/")
    for row in doc["rows"]:  # the host's time by function and file: the project's own code among them
        h = row["host_top"]  # (which of its functions makes the top 5 varies from run to run)
        assert h["host_ms"] > 0 and len(h["functions"]) == 5 and 0 < len(h["files"]) <= 5
        assert any(f["function"].startswith(ours) for f in h["functions"]) or any(
            f["file"].startswith(ours) for f in h["files"]), h


def test_profile_step_under_torchrun_with_ep(tmp_path):
    """Two gloo ranks, EP2 over all_to_all, gradients through moefp8.grad_sync: figures per GPU and
    for both, one report (rank 0); the overlap off and on, two rounds interleaved, medians and the
    ratios in the summary, the kernel table from the first round only; dispatch.overlap=auto runs
    its trial steps and reports its choice."""
    out = tmp_path / "profile.json"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        "tools/profile_step.py", "model=tiny", "train.device=cpu", "train.micro_batch=2",
                        "train.seq_len=32", "dispatch=all_to_all", "dispatch.ep_size=2", "--warmup", "1", "--steps", "1",
                        "--vary", "dispatch.overlap=false,true,auto", "--rounds", "2",
                        "--profile-steps", "1", "--top", "3", "--json", str(out)], cwd=REPO, capture_output=True,
                       text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("fp8 dispatch.overlap=true: ") == 1 and "on 2 (EP 2)" in r.stdout
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    assert [(row["round"], row["variant"], row["recipe"]) for row in rows] == [
        (i, f"dispatch.overlap={v}", recipe) for i, order in ((0, ("false", "true", "auto")), (1, ("auto", "true", "false")))
        for v in order for recipe in ("bf16", "fp8")]  # every other round in reverse: no variant always last
    for row in rows:  # the chooser's decision beside the figures it timed afterwards
        auto = row["overlap_auto"]
        assert (auto is None) == (row["variant"] != "dispatch.overlap=auto"), row["variant"]
        assert auto is None or (auto["choice"] in ("on", "off") and set(auto["median_ms"]) == {"on", "off"})
    said = [line for line in r.stdout.splitlines() if line.startswith("dispatch.overlap=auto: ")]
    assert len(said) == 4  # once per auto measure, rank 0 alone
    assert all(bool(row["top"]) == (row["round"] == 0) for row in rows)
    on = {row["recipe"]: row for row in doc["summary"] if row["variant"] == "dispatch.overlap=true"}
    assert on["bf16"]["rounds"] == 2 and "over_bf16" in on["fp8"] and on["fp8"]["over_dispatch.overlap=false"] > 0
    assert all(row["world"] == 2 and row["ep_size"] == 2 for row in rows)
    assert all(row["tokens_per_s_all"] == 2 * row["tokens_per_s"] for row in rows)
    assert all(row["plan_gib"] > 0 and row["peak_mem_gib"] is None for row in rows)  # (CPU: no CUDA peak)
    assert all(row["routing"]["load_max_over_mean"] >= 1 for row in rows)


def test_profile_step_counts_capped_overflows_of_the_timed_steps_apart(tmp_path):
    """dispatch.rows_factor at EP2 (gloo, capacity mode) with a factor a fresh router overflows: the warm-up's
    overflows are reported apart from the timed steps' (which the figures are of)."""
    out = tmp_path / "profile.json"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        "tools/profile_step.py", "model=tiny", "train.device=cpu", "train.micro_batch=4",
                        "train.seq_len=256", "dispatch=all_to_all", "dispatch.ep_size=2", "dispatch.mode=capacity",
                        "dispatch.rows_factor=1.0", "--recipes", "fp8", "--warmup", "2", "--steps", "1",
                        "--profile-steps", "0", "--json", str(out)], cwd=REPO, capture_output=True, text=True,
                       timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    (row,) = json.loads(out.read_text())["rows"]
    routing = row["routing"]
    assert routing["rows_overflowed_warmup"] >= 1 and 0 <= routing["rows_overflowed"] <= routing["rows_overflowed_warmup"]
    assert f"; {routing['rows_overflowed_warmup']} in the warm-up" in r.stdout


def test_live_at_peak_replays_the_allocator_trace():
    """--memory's replay: the peak of the step's own live bytes and who allocated what was live
    there (a block freed before the peak does not count; one freed after it does)."""
    sys.path.insert(0, str(REPO / "tools"))
    from profile_step import live_at_peak

    def frames(fn):
        return [{"filename": "/usr/lib/torch/x.py", "line": 1, "name": "empty"},
                {"filename": f"/r/moefp8/{fn}.py", "line": 7, "name": fn}]

    trace = [{"action": "alloc", "addr": 1, "size": 100, "frames": frames("a")},
             {"action": "free_requested", "addr": 1, "size": 100},
             {"action": "free_completed", "addr": 1, "size": 100},
             {"action": "alloc", "addr": 2, "size": 60, "frames": frames("b")},
             {"action": "alloc", "addr": 3, "size": 70, "frames": frames("b")},
             {"action": "alloc", "addr": 4, "size": 5, "frames": []},
             {"action": "free_completed", "addr": 3, "size": 70},
             {"action": "alloc", "addr": 5, "size": 50, "frames": frames("c")}]
    peak, sites = live_at_peak(trace)
    assert peak == 135 and sites == {"moefp8/b.py:7 b": [130, 2], "(outside moefp8)": [5, 1]}


def test_measure_frees_its_model_before_the_next_one():
    """Each (recipe, variant) builds its own model: the one measured before must be gone when the
    next is built (a leaked model and its gradient buckets once made the second recipe's CUDA peak
    look ~8 bytes per parameter over the memory plan)."""
    import gc
    import weakref

    sys.path.insert(0, str(REPO / "tools"))
    import profile_step
    from argparse import Namespace

    built = []
    real = profile_step.build

    def spy(*a, **k):
        out = real(*a, **k)
        built.append(weakref.ref(out[0]))
        return out

    profile_step.build = spy
    try:
        args = Namespace(warmup=1, steps=1, top=3, host_profile=False, memory=False, data=False)
        profile_step.measure(["model=tiny", "train.device=cpu", "train.micro_batch=1", "train.seq_len=16"], "fp8",
                             args, [], profile_steps=0)
    finally:
        profile_step.build = real
    gc.disable()  # what measure() freed it freed itself, not a collection run here
    try:
        assert len(built) == 1 and built[0]() is None
    finally:
        gc.enable()


def test_a_step_with_non_finite_numerics_is_flagged(capsys):
    """A measure whose step computes a NaN loss (here a NaN in the embedding) says so in its row and its report:
    broken math can run faster (collapsed routing: an A/B once read such a run as a 6% gain), so its speed must
    not pass for a measurement; a sound step's row holds its finite loss and gradient norm."""
    sys.path.insert(0, str(REPO / "tools"))
    import profile_step
    from argparse import Namespace

    real = profile_step.build

    def poisoned(*a, **k):
        out = real(*a, **k)
        next(out[0].parameters()).data.fill_(float("nan"))
        return out

    args = Namespace(warmup=1, steps=1, top=3, host_profile=False, memory=False, data=False)
    over = ["model=tiny", "train.device=cpu", "train.micro_batch=1", "train.seq_len=16"]
    good = profile_step.measure(over, "bf16", args, [], profile_steps=0)
    assert good["numerics_ok"] and 0 < good["loss"] < 20 and good["grad_norm"] > 0
    profile_step.build = poisoned
    try:
        bad = profile_step.measure(over, "bf16", args, [], profile_steps=0)
    finally:
        profile_step.build = real
    assert not bad["numerics_ok"] and not math.isfinite(bad["loss"])
    profile_step.report({**bad, "variant": "", "round": 0})
    assert "NUMERICS BROKEN" in capsys.readouterr().out


def test_data_gives_every_step_a_new_batch_the_same_for_both_recipes(data_dir):
    """--data: the steps read the config's data as training does (a new batch each step), and the
    two recipes' measures read the same batches; the row says which tokens it timed."""
    sys.path.insert(0, str(REPO / "tools"))
    import profile_step
    from argparse import Namespace

    seen = {}
    real = profile_step.open_data

    def spy(cfg, par, say=print):
        loader = real(cfg, par, say)
        batches, nxt = seen.setdefault(cfg.recipe.recipe, []), loader.next
        loader.next = lambda: batches.append(nxt()) or batches[-1]
        return loader

    profile_step.open_data = spy
    try:
        args = Namespace(warmup=1, steps=2, top=3, host_profile=False, memory=False, data=True)
        over = ["model=tiny", "train.device=cpu", "train.micro_batch=1", "train.seq_len=16", f"data.path={data_dir}",
                "data.prepare_from="]
        rows = [profile_step.measure(over, r, args, [], profile_steps=0) for r in ("bf16", "fp8")]
    finally:
        profile_step.open_data = real
    assert [r["tokens"] for r in rows] == ["data", "data"]
    b, f = seen["bf16"], seen["fp8"]
    assert len(b) == len(f) == 3  # warm-up + timed steps, one batch each
    assert all(torch.equal(u[0], v[0]) for u, v in zip(b, f))  # the same tokens for both recipes
    assert not torch.equal(b[0][0], b[1][0])  # and another batch every step


def test_a_step_runs_grad_accum_micro_batches_as_the_loop_does(data_dir):
    """train.grad_accum=3: every step reads three batches (forward and backward each, as the training loop
    runs them) before its one update, and its tokens/s counts the three."""
    sys.path.insert(0, str(REPO / "tools"))
    import profile_step
    from argparse import Namespace

    seen = []
    real = profile_step.open_data

    def spy(cfg, par, say=print):
        loader = real(cfg, par, say)
        nxt = loader.next
        loader.next = lambda: seen.append(nxt()) or seen[-1]
        return loader

    profile_step.open_data = spy
    try:
        args = Namespace(warmup=1, steps=2, top=3, host_profile=False, memory=False, data=True)
        over = ["model=tiny", "train.device=cpu", "train.micro_batch=1", "train.seq_len=16", "train.grad_accum=3",
                f"data.path={data_dir}", "data.prepare_from="]
        row = profile_step.measure(over, "bf16", args, [], profile_steps=0)
    finally:
        profile_step.open_data = real
    assert len(seen) == 3 * 3  # (warm-up + timed steps) x micro-batches
    assert row["numerics_ok"] and 0 < row["loss"] < 20
    assert math.isclose(row["tokens_per_s"] * row["step_ms"] / 1e3, 3 * 16, rel_tol=1e-6)


def test_kernels_by_kind_from_their_names():
    """The per-kind breakdown (the JSON's `by_kind` and `kinds`): kernel names as torch.profiler
    reported them on 4 H200s (session 41's 16B tables) fall in their kind; every row is counted once."""
    sys.path.insert(0, str(REPO / "tools"))
    from profile_step import by_kind, kernel_kind, kinds_side_by_side

    want = {
        "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)": "all-to-all",
        "Memcpy PtoP (Device -> Device)": "all-to-all",
        "_pack_capacity_kernel": "all-to-all",
        "void deep_ep::intranode::dispatch<8, 768, 6144>(int4*, float*, int*)": "all-to-all",
        "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "all-reduce",
        "_mgrouped_ws_kernel": "gemm", "_kgrouped_ws_kernel": "gemm",
        "nvjet_sm90_qqsss_128x128_128x6_4x2_h_bz_coopA_algo2_Avec128_Bvec128_TNT": "gemm",
        "_ZN7cutlass13device_kernelIN2at4cuda6detail25enable_3x_kernel_for_sm9xINS_4gemm6kernel13GemmUniversal": "gemm",
        "sm80_xmma_gemm_f32f32_f32f32_f32_nn_n_tilesize64x64x8_stage3_warpsize1x4x1_ffma_aligna4": "gemm",
        "void cutlass::Kernel2<cutlass_80_simt_sgemm_128x64_8x5_nt_align1>(cutlass_80_simt_sgemm_128x64": "gemm",
        "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x128_1x4x1_cga1x1x1_kernel0_0": "attention",
        "_rope_kernel": "attention",
        "_swiglu_bwd_quant_kernel": "fp8 quant + swiglu", "_swiglu_bf16_kernel": "fp8 quant + swiglu",
        "_dequant_swiglu_quant_colwise_strips_kernel": "fp8 quant + swiglu", "_quant_weight_kernel": "fp8 quant + swiglu",
        "_requant_colwise_words_kernel": "fp8 quant + swiglu", "_transpose_kernel": "fp8 quant + swiglu",
        "_permute_kernel": "permute + combine", "_combine_bwd_kernel": "permute + combine",
        "_adamw_kernel": "optimizer", "_adamw_quant_kernel": "optimizer",
        "void at::native::(anonymous namespace)::GammaBetaBackwardCUDAKernelTemplate<c10::BFloat16, float": "norm",
        "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, float, true>": "norm",
        "_rms_fwd_kernel": "norm", "_rms_bwd_kernel": "norm", "_rms_dw_kernel": "norm",  # kernels/norm.py
        "_xent_grad_kernel": "loss",
        "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, std::array<char*": "elementwise + copies",
        "Memcpy DtoD (Device -> Device)": "elementwise + copies",
        "aten::mm": "gemm", "aten::copy_": "elementwise + copies",
        "some_new_kernel": "other",
    }
    assert {n: kernel_kind(n) for n in want} == want
    rows = [{"kernel": n, "ms_per_step": float(i + 1)} for i, n in enumerate(want)]
    kinds = by_kind(rows)
    assert sum(kinds.values()) == sum(r["ms_per_step"] for r in rows) and list(kinds.values()) == sorted(kinds.values(), reverse=True)
    res = [{"recipe": rc, "variant": "", "round": 0, "by_kind": by_kind(rows[:k]), "kernels_ms_per_step": 9.0,
            "step_ms": 10.0 + k} for rc, k in (("bf16", 30), ("fp8", 20))]
    table = kinds_side_by_side(res)
    assert [r["kind"] for r in table][-2:] == ["all kernels", "step"] and table[-1]["fp8"] == 30.0
    assert all(set(r) == {"variant", "kind", "bf16", "fp8"} for r in table)
    for k, r in enumerate(res):  # with the GPU timeline: its busy and idle lines before the step's
        r["timeline"] = {"span_ms": 9.0, "busy_ms": 8.0 - k, "compute_busy_ms": 7.0, "idle_ms": 1.0 + k}
    table = kinds_side_by_side(res)
    assert [r["kind"] for r in table][-4:] == ["all kernels", "GPU busy (any kernel)", "GPU idle (waits for host)", "step"]
    assert (table[-3]["bf16"], table[-3]["fp8"], table[-2]["bf16"], table[-2]["fp8"]) == (8.0, 7.0, 1.0, 2.0)


def test_gpu_timeline_counts_overlapping_kernels_once_and_the_gaps_as_idle():
    """The JSON's `timeline`: kernels on two streams overlap (counted once in busy), communication is
    left out of compute_busy, and the gaps between kernels are the GPU's idle time; per step."""
    sys.path.insert(0, str(REPO / "tools"))
    from profile_step import busy_ms, idle_before, timeline

    assert busy_ms([]) == 0.0
    assert busy_ms([(0, 10), (5, 15), (20, 30), (22, 25), (30, 31)]) == 26.0  # nested, touching, unsorted below
    assert busy_ms([(20, 30), (0, 10), (5, 15)]) == 25.0
    assert timeline([], 2) is None
    ks = [("_mgrouped_ws_kernel", 0.0, 4000.0),  # us; two steps of 5 ms spans, say
          ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", 3000.0, 6000.0),  # overlaps the GEMM
          ("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 7000.0, 9000.0),
          ("_adamw_kernel", 8000.0, 10000.0)]
    t = timeline(ks, 2)
    assert t == {"span_ms": 5.0, "busy_ms": 4.5, "compute_busy_ms": 3.0, "idle_ms": 0.5,
                 "idle_before": [{"kernel": ks[2][0], "idle_ms": 0.5, "gaps_per_step": 0.5}]}
    # gaps charged to the kernel that ends them, summed per name, largest first
    waits = idle_before([("a", 0, 10), ("b", 12, 20), ("a", 19, 25), ("b", 30, 31), ("c", 40, 41), ("b", 45, 50)])
    assert waits == {"b": [2 + 5 + 4, 3], "c": [9, 1]}
    assert [w["kernel"] for w in timeline([("a", 0, 10), ("b", 12, 20), ("c", 40, 41)], 1, top=1)["idle_before"]] == ["c"]


def test_host_profile_counts_the_waits_at_syncs():
    """--host-profile splits the step's host time into its waits at syncs (the self time of `.tolist()`,
    `.item()`, synchronizations: on a GPU the host blocks there) and the host's own work."""
    sys.path.insert(0, str(REPO / "tools"))
    from profile_step import SYNCS, host_profile

    x = torch.randn(3000, 1000)

    def step():
        x.tolist()  # ~100 ms of C time, as a blocking read-back would take
        sum(i * i for i in range(200_000))  # the host's own Python work

    h = host_profile(step, torch.device("cpu"), top=5)
    assert 0 < h["sync_wait_ms"] < h["host_ms"] and abs(h["host_busy_ms"] + h["sync_wait_ms"] - h["host_ms"]) < 1e-6
    assert h["sync_wait_ms"] > 0.3 * h["host_ms"]
    names = ["<method 'tolist' of 'torch._C.TensorBase' objects>", "<method 'item' of 'torch._C.TensorBase' objects>",
             "<built-in method _cuda_synchronize>", "<built-in method torch._C._cuda_synchronize>",
             "<method 'synchronize' of 'torch._C._CudaEventBase' objects>"]
    assert all(SYNCS.search(n) for n in names)
    assert not any(SYNCS.search(n) for n in ["<method 'add_' of 'torch._C.TensorBase' objects>", "<built-in method cat>",
                                             "<method 'itemsize' of 'x' objects>", "<built-in method cpu_count>"])


def test_kernels_by_scope_name_the_range_the_autograd_node_and_the_op_that_launched_them():
    """`scopes`: an ATen op's kernels charged to its innermost record_function range, the autograd node
    it ran for (backward) and the outermost ATen call around it; summed per (scope, node, op, kind)."""
    from types import SimpleNamespace as E

    sys.path.insert(0, str(REPO / "tools"))
    from profile_step import by_scope, scope_of

    def ev(name, parent=None, kernels=()):
        return E(name=name, cpu_parent=parent, kernels=[E(name=k, duration=d) for k, d in kernels])

    node = ev("autograd::engine::evaluate_function: _MoEBackward", ev("outer"))
    rng = ev("bwd_fc1", node)
    contig = ev("aten::contiguous", rng)
    copy = ev("aten::copy_", ev("aten::clone", contig), [("elementwise_kernel<direct_copy>", 500.0)])
    mul = ev("aten::mul", ev("fc1"), [("vectorized_elementwise_kernel<MulFunctor<float>>", 100.0)])
    mul2 = ev("aten::mul", ev("fc1"), [("vectorized_elementwise_kernel<MulFunctor<float>>", 300.0),
                                       ("Memset (Device)", 2.0)])
    bare = ev("aten::add_", None, [("vectorized_elementwise_kernel<CUDAFunctor_add<float>>", 40.0)])
    assert scope_of(copy) == ("bwd_fc1", "_MoEBackward", "aten::contiguous > aten::copy_")
    assert scope_of(mul) == ("fc1", "forward", "aten::mul")
    assert scope_of(bare) == ("-", "forward", "aten::add_")
    rows = by_scope([node, rng, contig, copy, mul, mul2, bare, ev("aten::empty")], steps=2, top=3)
    assert [(r["scope"], r["op"], r["kind"], round(r["ms_per_step"], 6), r["calls_per_step"]) for r in rows] == [
        ("bwd_fc1", "aten::contiguous > aten::copy_", "elementwise + copies", 0.25, 0.5),
        ("fc1", "aten::mul", "elementwise + copies", 0.201, 1.5),  # the memset is a copy too: one row
        ("-", "aten::add_", "elementwise + copies", 0.02, 0.5)]


def test_the_gpus_clocks_and_power_over_the_timed_steps_are_in_the_row(tmp_path, monkeypatch, capsys):
    """The row holds what nvidia-smi sampled while the timed steps ran (SM clock, power, clock reasons: a recipe at
    the power cap runs its tensor work at a lower clock) and the report says it; a fake nvidia-smi on PATH here.
    Without nvidia-smi the row holds {} and the report no GPU line."""
    sys.path.insert(0, str(REPO / "tools"))
    import shutil

    import profile_step
    from argparse import Namespace

    args = Namespace(warmup=1, steps=2, top=3, host_profile=False, memory=False, data=False)
    over = ["model=tiny", "train.device=cpu", "train.micro_batch=1", "train.seq_len=16"]
    fake = tmp_path / "nvidia-smi"
    fake.write_text('#!/bin/sh\ncase "$*" in *--loop-ms=*) while true; do echo "0, 1755, 3201, 699, 64, 0x4"; '
                    'sleep 0.01; done;; esac\necho "0, 1980, 3201, 650, 60, 0x0"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    row = profile_step.measure(over, "bf16", args, [], profile_steps=0)
    g = row["gpu_state"][0]
    assert g["samples"] >= 1 and g["sm_mhz_median"] == 1755 and g["power_w_max"] == 699
    assert g["clock_reasons"] == ["sw power cap"]
    profile_step.report({**row, "variant": "", "round": 0})
    out = capsys.readouterr().out
    assert "GPU 0 over the timed steps: SM clock 1755 MHz median" in out and "sw power cap" in out
    two = [{**row, "variant": "", "round": 0}, {**row, "variant": "", "round": 1, "gpu_state": {
        0: {**g, "sm_mhz_median": 1600.0, "power_w_median": 650.0}}}, {**row, "variant": "", "round": 2}]
    (summary,) = profile_step.summarize(two)  # the medians over the rounds beside the tokens/s
    assert summary["sm_mhz"] == 1755 and summary["power_w"] == 699 and summary["rounds"] == 3
    monkeypatch.setattr(shutil, "which", lambda name: None)
    row = profile_step.measure(over, "bf16", args, [], profile_steps=0)
    assert row["gpu_state"] == {}
    assert "sm_mhz" not in profile_step.summarize([{**row, "variant": "", "round": 0}])[0]
    profile_step.report({**row, "variant": "", "round": 0})
    assert "over the timed steps" not in capsys.readouterr().out
