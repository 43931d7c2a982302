"""moefp8/memory.py: the per-GPU memory plan, the one-line refusal, the presets of real size."""

import itertools
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from moefp8.errors import UserError
from moefp8.hydra_config import load_config
from moefp8.memory import GIB, HEADROOM, activation_bytes_per_token, distinct_ranks, fits, param_split, plan
from moefp8.model import param_counts

REPO = Path(__file__).resolve().parent.parent


def test_distinct_ranks_matches_counting():
    for E, K, R in ((8, 2, 2), (16, 4, 4), (64, 6, 4), (8, 8, 8)):
        per = E // R
        combos = list(itertools.combinations(range(E), K)) if math.comb(E, K) < 200_000 else None
        if combos:
            want = sum(len({e // per for e in c}) for c in combos) / len(combos)
            assert distinct_ranks(E, K, R) == pytest.approx(want, rel=1e-12)
    assert distinct_ranks(64, 6, 1) == 1.0


def test_parameters_per_gpu_are_the_built_models():
    from moefp8.launch import routing_config
    from moefp8.model import Transformer
    from moefp8.recipe import Recipe

    cfg = load_config(["model=tiny"])
    m = Transformer(routing_config(cfg, 1), Recipe.from_config(cfg.recipe), None, 0, 0)
    replicated, experts = param_split(cfg)
    assert replicated + experts == sum(p.numel() for p in m.parameters())
    pl = plan(cfg, world=2)  # several processes: the gradient buckets hold every gradient
    assert pl["masters"] == 4 * (replicated + experts) and pl["grads"] == pl["masters"]
    assert pl["moments"] == pl["masters"]  # BF16 moments: 2 x 2 bytes
    assert plan(load_config(["model=tiny", "optim.moment_dtype=fp32"]), 2)["moments"] == 2 * pl["moments"]
    ep = load_config(["model=tiny", "dispatch=all_to_all", "dispatch.ep_size=2"])
    assert param_split(ep) == (replicated, experts // 2)


def test_one_process_counts_the_gradients_the_freed_activations_do_not_cover():
    """One process: the backward makes the gradients as it frees the activations, and the step frees
    them after AdamW: the peak is the larger of the two (bench/notes/scale.md, session 41: the 3B preset
    measured 43.4 / 57.5 GiB in FP8 at micro-batch 8 / 16 against 43.8 / 56.3 planned so)."""
    for over in (["experiment=moe3b_gpu"], ["experiment=moe3b_gpu", "train.micro_batch=1", "train.seq_len=256"]):
        one, two = plan(load_config(over)), plan(load_config(over), world=2)
        assert one["activations"] == two["activations"] and one["masters"] == two["masters"]
        assert one["grads"] == max(0.0, two["grads"] - two["activations"] - two["logits"])
        assert one["total"] == pytest.approx(two["total"] - two["grads"] + one["grads"])
    assert plan(load_config(over))["grads"] > 0  # a tiny micro-batch: the gradients set the peak
    # EP4: four processes whatever `world` says; at ep_size = world no other rank holds this rank's experts: their
    # gradients have no bucket (moefp8.grad_sync) and are made as the backward frees the activations, the
    # replicated parameters' stay in the buckets all step
    ep = load_config(["experiment=v2_lite_ep4"])
    replicated, experts = param_split(ep)
    pl = plan(ep)
    assert pl["grads"] == plan(ep, world=4)["grads"] == 4 * replicated + max(
        0.0, 4 * experts - pl["activations"] - pl["logits"])
    assert pl["grads"] == 4 * replicated  # v2_lite_ep4: the activations (micro-batch 4) outweigh the experts' 4 bytes
    dp = plan(ep, world=8)  # EP4 x DP2: the expert-data-parallel pairs sum the experts' gradients in buckets
    assert dp["grads"] == dp["masters"] == 4 * (replicated + experts)
    small = plan(load_config(["experiment=v2_lite_ep4", "train.micro_batch=1", "train.seq_len=256"]))
    assert 4 * replicated < small["grads"] < 4 * (replicated + experts)  # few activations: some gradients on top


def test_activations_and_logits_scale_with_the_micro_batch_and_fp8_saves_less():
    a, b = plan(load_config(["model=small", "train.micro_batch=4"])), plan(load_config(["model=small", "train.micro_batch=8"]))
    assert b["activations"] == 2 * a["activations"] and b["logits"] == 2 * a["logits"]
    assert b["masters"] == a["masters"]
    bf16 = plan(load_config(["model=small", "train.micro_batch=4", "recipe=bf16"]))
    assert 0.5 < a["activations"] / bf16["activations"] < 0.9  # FP8 caches: 1 byte (+ scales) for 2


def test_presets_of_real_size():
    v2 = load_config(["experiment=v2_lite_ep4"])
    n = param_counts(v2.model)
    assert 15e9 < n["total"] < 16.5e9 and 2.3e9 < n["active"] < 3e9  # DeepSeek-V2-Lite: 15.7B, 2.4B active
    assert (v2.model.n_layers, v2.model.n_dense_layers, v2.model.hidden, v2.model.n_experts, v2.model.moe_inter,
            v2.model.n_shared, v2.model.topk) == (27, 1, 2048, 64, 1408, 2, 6)
    assert v2.dispatch.ep_size == 4 and v2.model.vocab_size >= 100_000
    with pytest.raises(UserError):  # 80 GB cards: no
        fits(v2, 79.1 * GIB)
    assert fits(v2, 139 * GIB)["total"] < HEADROOM * 139 * GIB  # H200s: yes
    b3 = load_config(["experiment=moe3b_gpu"])
    assert 2.8e9 < param_counts(b3.model)["total"] < 3.5e9
    assert fits(b3, 79.1 * GIB)["total"] < HEADROOM * 79.1 * GIB  # one H100


def test_refusal_is_one_line_naming_the_fix():
    cfg = load_config(["experiment=moe3b_gpu", "train.micro_batch=32"])
    with pytest.raises(UserError) as e:
        fits(cfg, 79.1 * GIB, "NVIDIA H100 80GB HBM3")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("model.name=moe3b: memory per GPU (plan): weights ")
    assert "of the 79.1 GiB of NVIDIA H100 80GB HBM3; lower train.micro_batch=32 to " in msg
    fit = int(msg.split(" to ")[1].split()[0])
    fits(load_config(["experiment=moe3b_gpu", f"train.micro_batch={fit}"]), 79.1 * GIB)  # the advice holds
    assert msg.endswith("(the plan is an estimate: train.check_memory=false runs anyway)")
    # nothing that this config changes fits: the weights and optimizer state alone are ~51 GiB at EP4
    with pytest.raises(UserError, match=r"raise dispatch.ep_size=4 .* or use GPUs with more memory \(the plan"):
        fits(load_config(["experiment=v2_lite_ep4", "train.micro_batch=1"]), 60 * GIB)


def test_refusal_names_the_recompute_that_fits():
    """Where recomputing keeps the micro-batch: the fewest train.recompute entries that make the plan fit
    (expert_out only in the FP8 recipe), and that advice holds."""
    for recipe, mb, want in (("fp8", 22, "[expert_out]"), ("fp8", 32, "[expert_out,attention]"),
                             ("bf16", 20, "[attention]")):
        over = ["experiment=moe3b_gpu", f"train.micro_batch={mb}", f"recipe={recipe}"]
        with pytest.raises(UserError) as e:
            fits(load_config(over), 79.1 * GIB)
        msg = str(e.value)
        assert f"lower train.micro_batch={mb} to " in msg and f", or set train.recompute={want} (the same" in msg
        fits(load_config([*over, f"train.recompute={want}"]), 79.1 * GIB)  # the advice holds
    # with the overlap (true or auto) the attention cannot recompute (config.validate): never advised then
    from moefp8.memory import _more_recompute

    cfg = load_config(["experiment=moe3b_gpu"])
    for overlap, want in ((False, ["expert_out", "attention"]), (True, ["expert_out"]), ("auto", ["expert_out"])):
        assert _more_recompute(replace(cfg, dispatch=replace(cfg.dispatch, overlap=overlap))) == want


def test_cli():
    r = subprocess.run([sys.executable, "-m", "moefp8.memory", "experiment=v2_lite_ep4", "--gib", "139"],
                       capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0 and "v2_lite, recipe fp8, EP 4" in r.stdout and " GiB of 139.0 GiB" in r.stdout
    r = subprocess.run([sys.executable, "-m", "moefp8.memory", "experiment=v2_lite_ep4", "--gib", "79.1"],
                       capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and r.stderr.startswith("error: model.name=v2_lite")


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["fp8", "bf16"])
def test_plan_against_the_measured_peak(recipe):
    """One training step of the small model at micro-batch 8: the CUDA peak within 25% of the plan
    (the plan leaves out padding, workspaces and the allocator's slack; HEADROOM covers them)."""
    from moefp8.launch import routing_config
    from moefp8.model import Transformer
    from moefp8.optim import AdamW
    from moefp8.recipe import Recipe

    cfg = load_config(["model=small", f"recipe={recipe}", "train.micro_batch=8", "train.seq_len=1024"])
    torch.cuda.reset_peak_memory_stats()
    m = Transformer(routing_config(cfg, 1), Recipe.from_config(cfg.recipe), None, 0, 0).cuda()
    opt = AdamW(m.named_parameters(), cfg.optim)
    x = torch.randint(0, cfg.model.vocab_size, (8, 1025), device="cuda")
    for _ in range(2):  # the second step holds the moments and the weight caches
        out = m(x[:, :-1], x[:, 1:])
        (out.out + out.aux_loss).backward()
        opt.step(1e-4)
        opt.zero_grad()
    peak, want = torch.cuda.max_memory_allocated(), plan(cfg)["total"]
    assert 0.75 < peak / want < 1.25, (peak / GIB, want / GIB)


def test_attention_recompute_lowers_the_planned_activations():
    a = plan(load_config(["experiment=moe3b_gpu"]))
    b = plan(load_config(["experiment=moe3b_gpu", "train.recompute=[attention]"]))
    assert b["activations"] < 0.8 * a["activations"] and b["masters"] == a["masters"]


def test_expert_out_recompute_lowers_the_fp8_plan_only():
    """train.recompute=[expert_out]: per routed slot fc2's FP8 input (I bytes + scales) is kept instead
    of y (2H BF16 bytes); the BF16 recipe keeps y either way."""
    over = ["experiment=moe3b_gpu"]
    for recipe in ("fp8", "bf16"):
        a = activation_bytes_per_token(load_config([*over, f"recipe={recipe}"]))
        b = activation_bytes_per_token(load_config([*over, f"recipe={recipe}", "train.recompute=[expert_out]"]))
        m = load_config(over).model
        less = m.topk * (2 * m.hidden - m.moe_inter * (1 + 4 / 128)) if recipe == "fp8" else 0
        assert a["moe_mlp"] - b["moe_mlp"] == pytest.approx(less) and a["attention"] == b["attention"]


def test_rows_factor_counts_the_capped_rows_under_ep():
    """dispatch.rows_factor: the permuted tensors saved per routed slot (h, y) have factor x the balanced rows;
    at EP = 1 (the bound layout) the factor is unused and nothing changes."""
    over = ["experiment=v2_lite_ep4"]
    a = activation_bytes_per_token(load_config(over))
    b = activation_bytes_per_token(load_config([*over, "dispatch.rows_factor=1.5"]))
    m = load_config(over).model
    slot = (1 + 4 / 128) * 2 * m.moe_inter + 2 * m.hidden  # FP8 h with its scales, BF16 y
    assert b["moe_mlp"] - a["moe_mlp"] == pytest.approx(0.5 * m.topk * slot) and a["attention"] == b["attention"]
    one = ["experiment=moe3b_gpu"]
    assert activation_bytes_per_token(load_config([*one, "dispatch.rows_factor=1.5"])) == \
        activation_bytes_per_token(load_config(one))


def test_graphs_of_both_kinds_count_the_moe_attention_again():
    """train.cuda_graphs with dispatch.overlap=auto under EP: the MoE blocks' attention captured whole and
    per half, both sets of saved activations held by the graphs' pool; one kind alone adds nothing."""
    cfg = load_config(["experiment=small_gpu", "dispatch=all_to_all", "dispatch.ep_size=2"])
    base = plan(cfg, 2)
    per = activation_bytes_per_token(cfg)
    m, t = cfg.model, cfg.train
    auto = plan(replace(cfg, dispatch=replace(cfg.dispatch, overlap="auto")), 2)
    assert auto["graphs"] == t.micro_batch * t.seq_len * (m.n_layers - m.n_dense_layers) * per["attention"] > 0
    assert auto["total"] == base["total"] + auto["graphs"] and "graphs" not in base
    for other in (replace(cfg, dispatch=replace(cfg.dispatch, overlap=True)),  # halves only
                  replace(cfg, dispatch=replace(cfg.dispatch, overlap="auto"), train=replace(t, cuda_graphs=False)),
                  replace(cfg, dispatch=replace(cfg.dispatch, overlap="auto"), train=replace(t, recompute=["attention"]))):
        assert "graphs" not in plan(other, 2)


def test_out_of_memory_line_names_the_routing_skew_under_ep():
    from moefp8.memory import GIB, out_of_memory

    cfg = load_config(["experiment=v2_lite_ep4"])
    e = out_of_memory(cfg, 4, 12, 1, 139.7 * GIB, 139.8 * GIB, 10.7)
    msg = str(e)
    assert "\n" not in msg and msg.startswith("step 12, rank 1: CUDA out of memory (peak 139.7 of 139.8 GiB; the plan: ")
    assert "10.7x the mean" in msg and "up to 4x the tokens" in msg and "train.micro_batch=4" in msg
    assert "x the mean" not in str(out_of_memory(cfg, 4, 12, 1, None, None, 1.1))  # balanced: no such hint
    assert "x the mean" not in str(out_of_memory(load_config([]), 1, 3, 0, None, None, 8.0))  # EP=1: none either
