"""What one GPU will hold for a training config, counted before anything is allocated.

    python -m moefp8.memory experiment=v2_lite_ep4 [--gib 80] [--gpus 4]   # the plan, one table

`plan(cfg, world)` counts bytes per GPU in six parts, seven with CUDA graphs of both kinds (world: the processes of the run):

    weights      the low-precision copies the GEMMs read (moefp8.weight_copy, experts.WeightCache): FP8 data
                 and its transpose for dgrad (2 bytes per parameter) or one BF16 cast (2 bytes)
    masters      the FP32 parameters (4 bytes), which AdamW updates
    moments      Adam's two moments (2 x 2 bytes in BF16, 2 x 4 in FP32: optim.moment_dtype)
    grads        FP32 gradients (4 bytes). Those the data-parallel buckets hold (moefp8.grad_sync: the
                 replicated parameters' under several processes, the routed experts' where another
                 rank holds the same experts) live through the step; the others (every gradient on one
                 process; the routed experts' at dispatch.ep_size = world) are made layer by layer as
                 the backward frees the activations and freed after the step, so they count only beyond
                 the activations freed by then, max(0, made - activations - logits) (measured: the 3B
                 preset peaks at the end of the backward with every gradient and no activation at
                 micro-batch 8, bench/notes/scale.md; the 16B preset at EP4 peaks before the backward)
    activations  what the backward keeps of one micro-batch (train.micro_batch x train.seq_len
                 tokens), per layer from docs/design.md §2's "saved for backward" lists
    logits       the LM head's peak: BF16 logits, their FP32 copy and the saved log-softmax, then
                 its gradient: ~10 bytes per token per vocabulary entry
    graphs       (only where nonzero) train.cuda_graphs with dispatch.overlap=auto under EP: the MoE
                 blocks capture their attention twice, whole and per half (moefp8.graphs), and the
                 graphs' pool keeps both sets of saved activations: one more MoE-blocks' attention

The routed experts are split over dispatch.ep_size ranks; everything else is replicated.
Activations count tokens as they arrive after dispatch: a token goes to each distinct rank of its
experts once (`distinct_ranks`), and each of its K slots is one permuted row. Per-expert padding
(rows to a multiple of 128 per expert), allocator slack and workspaces are not counted: `fits`
keeps a margin (HEADROOM) for them. The counts are an estimate to plan with; the training run
prints its plan beside the measured peak (`cuda_max_alloc_mb` in metrics.jsonl).
"""

import argparse
import itertools
import math
import sys
from dataclasses import replace

from moefp8.config import Config
from moefp8.errors import RankError, UserError, report

GIB = 1 << 30
HEADROOM = 0.90  # of a GPU's memory the plan may fill: CUDA context, workspaces, padding, fragmentation
SCALE = 4 / 128  # an fp32 scale per 1x128 tile: bytes per FP8 element


def distinct_ranks(n_experts: int, topk: int, ranks: int) -> float:
    """Expected distinct ranks among a token's top-k experts (uniform routing, E/R experts per
    rank): R (1 - C(E - E/R, K) / C(E, K))."""
    if ranks <= 1:
        return 1.0
    per = n_experts // ranks
    return ranks * (1 - math.comb(n_experts - per, topk) / math.comb(n_experts, topk))


def activation_bytes_per_token(cfg: Config) -> dict[str, float]:
    """Bytes the backward keeps per token of a micro-batch: one attention block, one dense MLP, one
    MoE MLP (routed rows at their arrival, counted per token of this rank's micro-batch)."""
    m, fp8 = cfg.model, cfg.recipe.recipe == "fp8"
    H, d, heads, I, K = m.hidden, m.n_heads * m.head_dim, m.n_heads, m.moe_inter, m.topk
    q8 = 1 + SCALE  # an FP8 element with its scale
    low = q8 if fp8 else 2  # a quantized (or BF16) GEMM input
    dense_lin = fp8 and cfg.recipe.fp8_dense
    # attention: its norm's input, the wqkv input, q/k/v after RoPE and the output (BF16, flash
    # attention), the log-sum-exp (fp32 per head), the wo input
    attn = 2 * H + (q8 if dense_lin and "wqkv" not in cfg.recipe.bf16_linears else 2) * H + 2 * 4 * d + 4 * heads
    attn += (q8 if dense_lin and "wo" not in cfg.recipe.bf16_linears else 2) * d
    if "attention" in cfg.train.recompute:
        attn = 2 * H  # the block's input only
    # the dense SwiGLU MLP (moefp8.mlp.MLP, as the shared experts): its norm's input, x and h (gate
    # and up), FP8 or BF16, and the fc2 input while backward recomputes it
    def mlp(fp8_mlp: bool, inter: int, x_bf16: float = 2 * H) -> float:
        return (q8 * H + q8 * 2 * inter + q8 * inter) if fp8_mlp else (x_bf16 + 2 * 2 * inter + 2 * inter)

    dense = 2 * H + mlp(fp8 and cfg.recipe.fp8_dense and "dense_mlp" not in cfg.recipe.bf16_linears, m.dense_inter)
    # MoE: its norm's input, the router's x (BF16), routing (ids, weights, layout), the dispatched
    # rows, and per routed slot h (2I, FP8 or BF16) and y (BF16, H) for the routing-weight gradient,
    # or with train.recompute=[expert_out] (FP8) the fc2 input (I) that y is recomputed from; shared
    # experts as a dense MLP of n_shared x I. With dispatch.rows_factor under EP the permuted tensors have
    # factor x the balanced pairs' rows (moe_stages.RowCap), used or not
    rows = distinct_ranks(m.n_experts, K, cfg.dispatch.ep_size)
    capped = cfg.dispatch.rows_factor if cfg.dispatch.ep_size > 1 and cfg.dispatch.rows_factor else 1.0
    routing = K * (8 + 4 + 4 + 4)
    y_or_a8 = q8 * I if fp8 and "expert_out" in cfg.train.recompute else 2 * H
    slot = (q8 if fp8 else 2) * 2 * I + y_or_a8
    shared = mlp(fp8, m.n_shared * I, x_bf16=0) if m.n_shared else 0.0  # BF16 x: the router's (counted)
    moe = 2 * H + 2 * H + routing + rows * low * H + capped * K * slot + shared
    return {"attention": attn, "dense_mlp": dense, "moe_mlp": moe}


def param_split(cfg: Config) -> tuple[int, int]:
    """(parameters on every rank, routed-expert parameters on this rank)."""
    from moefp8.model import param_counts  # (model imports the kernels: not needed for the plan's import)

    m = cfg.model
    n = param_counts(m)
    routed = (m.n_layers - m.n_dense_layers) * m.n_experts * 3 * m.hidden * m.moe_inter
    return n["total"] - routed, routed // cfg.dispatch.ep_size


def plan(cfg: Config, world: int = 1) -> dict[str, float]:
    """Bytes per GPU: weights, masters, moments, grads, activations, logits, and their total, for a run
    of `world` processes (at least dispatch.ep_size)."""
    m, t = cfg.model, cfg.train
    replicated, experts = param_split(cfg)
    p = replicated + experts
    embed = m.vocab_size * m.hidden  # looked up from the fp32 table: no low-precision copy
    moment = 2 * (2 if cfg.optim.moment_dtype == "bf16" else 4)
    T = t.micro_batch * t.seq_len
    per = activation_bytes_per_token(cfg)
    n_moe = m.n_layers - m.n_dense_layers
    acts = T * (m.n_layers * per["attention"] + m.n_dense_layers * per["dense_mlp"] + n_moe * per["moe_mlp"]
                + 2 * m.hidden * 2)  # + the final norm's input and the head's input
    out = {"weights": 2.0 * (p - embed), "masters": 4.0 * p, "moments": float(moment * p), "grads": 4.0 * p,
           "activations": float(acts),
           # train.loss_chunk: one chunk's logits at a time, plus the head's fp32 gradient kept to the backward
           "logits": (10.0 * min(T, t.loss_chunk) * m.vocab_size + 4.0 * embed) if t.loss_chunk else 10.0 * T * m.vocab_size}
    world, ep = max(world, cfg.dispatch.ep_size), cfg.dispatch.ep_size
    held = 0.0 if world == 1 else 4.0 * (replicated + (experts if world > ep else 0))  # in the buckets
    made = out["grads"] - held  # made as the activations free (module docstring)
    out["grads"] = held + max(0.0, made - out["activations"] - out["logits"])
    if t.cuda_graphs and cfg.dispatch.overlap == "auto" and cfg.dispatch.ep_size > 1 and t.micro_batch > 1 \
            and "attention" not in t.recompute:
        out["graphs"] = float(T * n_moe * per["attention"])
    out["total"] = sum(out.values())
    return out


def describe(pl: dict[str, float], capacity: float | None = None) -> str:
    """"memory per GPU (plan): weights 3.1 + masters 6.2 + ... = 41.0 GiB [of 79.1 GiB]"."""
    parts = " + ".join(f"{k} {v / GIB:.1f}" for k, v in pl.items() if k != "total")
    tail = f" of {capacity / GIB:.1f} GiB" if capacity else ""
    return f"memory per GPU (plan): {parts} = {pl['total'] / GIB:.1f} GiB{tail}"


def _more_recompute(cfg: Config) -> list[str]:
    """train.recompute's entries this config could add, the cheaper first: expert_out (FP8 recipe; one
    fc2 GEMM per MoE layer again), attention (not with dispatch.overlap true or auto)."""
    t = cfg.train
    return [r for r in ("expert_out", "attention") if r not in t.recompute
            and not (r == "attention" and cfg.dispatch.overlap)
            and not (r == "expert_out" and cfg.recipe.recipe != "fp8")]


def fits(cfg: Config, capacity: float, device_name: str = "this GPU", world: int = 1) -> dict[str, float]:
    """The plan for `world` processes; UserError (one line: the need, the parts, what to change) when
    its total exceeds HEADROOM of `capacity` bytes."""
    pl = plan(cfg, world)
    if pl["total"] <= HEADROOM * capacity:
        return pl
    t, d = cfg.train, cfg.dispatch
    static = pl["total"] - pl["activations"] - pl["logits"]
    fit = next((b for b in range(t.micro_batch - 1, 0, -1)
                if plan(replace(cfg, train=replace(t, micro_batch=b)), world)["total"] <= HEADROOM * capacity), 0)
    hints = []
    if fit:
        hints.append(f"lower train.micro_batch={t.micro_batch} to {fit} or less (activations and logits: "
                     f"{(pl['activations'] + pl['logits']) / GIB:.1f} GiB now; train.grad_accum keeps the batch)")
    more = _more_recompute(cfg)
    tries = ([*t.recompute, *c] for n in range(1, len(more) + 1) for c in itertools.combinations(more, n))
    rec = next((r for r in tries if plan(replace(cfg, train=replace(t, recompute=r)), world)["total"]
                <= HEADROOM * capacity), None)
    if rec:
        hints.append(f"set train.recompute=[{','.join(rec)}] (the same micro-batch, some of the backward again)")
    if not fit and not rec:
        hints.append(f"raise dispatch.ep_size={d.ep_size} (the experts' share of the {static / GIB:.1f} GiB of "
                     f"weights and optimizer state), shorten train.seq_len={t.seq_len}, or use GPUs with more memory")
    raise UserError(f"model.name={cfg.model.name}: {describe(pl)}, more than {HEADROOM:.0%} of the "
                    f"{capacity / GIB:.1f} GiB of {device_name}; " + ", or ".join(hints)
                    + " (the plan is an estimate: train.check_memory=false runs anyway)")


def out_of_memory(cfg: Config, world: int, step: int, rank: int, peak: float | None, capacity: float | None,
                  load_max_over_mean: float | None) -> RankError:
    """The one line for a CUDA out-of-memory error during training step `step` (1-based) on `rank`:
    the peak bytes beside the plan and what to change. load_max_over_mean: the MoE layers' expert load
    at the last logged step (None: none logged); peak / capacity: the device's bytes (None: unknown). Under EP a router that sends most tokens to a few
    experts (fresh routers do, for the first few hundred steps: bench/notes/scale.md, session 43)
    hands the rank holding them up to ep_size times the rows the plan counts."""
    t, ep = cfg.train, cfg.dispatch.ep_size
    skew = ""
    if ep > 1 and load_max_over_mean is not None and load_max_over_mean > 2:
        skew = (f" The experts' load was {load_max_over_mean:.1f}x the mean at the last logged step: the rank holding "
                f"the busiest experts receives up to {ep}x the tokens the plan counts (a fresh router's early steps).")
    used = f"peak {peak / GIB:.1f} of {capacity / GIB:.1f} GiB; " if peak is not None and capacity else ""
    more = _more_recompute(cfg)
    rec = f", or set train.recompute=[{','.join([*t.recompute, *more])}]" if more else ""
    return RankError(f"step {step}, rank {rank}: CUDA out of memory ({used}the plan: {plan(cfg, world)['total'] / GIB:.1f} "
                     f"GiB).{skew} Lower train.micro_batch="
                     f"{t.micro_batch} (train.grad_accum keeps the batch){rec}; the last checkpoint resumes the run")


def main(argv=None) -> None:
    from moefp8.hydra_config import load_config

    ap = argparse.ArgumentParser(prog="python -m moefp8.memory", description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=0, help="GPU memory to check the plan against, GiB (0: none)")
    ap.add_argument("--gpus", type=int, default=0, help="processes of the run (0: dispatch.ep_size)")
    ap.add_argument("overrides", nargs="*", help="the training run's Hydra overrides")
    a = ap.parse_args(argv)
    try:
        cfg = load_config(a.overrides)
        world = a.gpus or cfg.dispatch.ep_size
        pl = fits(cfg, a.gib * GIB, world=world) if a.gib else plan(cfg, world)
    except ValueError as e:  # ConfigError, UserError
        report(f"{'error' if isinstance(e, UserError) else 'config error'}: {e}")
    replicated, experts = param_split(cfg)
    print(f"{cfg.model.name}, recipe {cfg.recipe.recipe}, EP {cfg.dispatch.ep_size}, micro-batch "
          f"{cfg.train.micro_batch} x {cfg.train.seq_len}: {(replicated + experts) / 1e9:.2f}B parameters per GPU "
          f"({replicated / 1e9:.2f}B replicated + {experts / 1e9:.2f}B of the routed experts)")
    print(describe(pl, a.gib * GIB or None))


if __name__ == "__main__":
    main(sys.argv[1:])
