"""A decoder-only MoE transformer in DeepSeek-V3's mould, in one file.

    tokens [B, S] -> embedding (BF16 out) -> n_layers x Block -> RMSNorm -> LM head (BF16) -> logits
    Block:  h = x + Attention(RMSNorm(x));  out = h + MLP(RMSNorm(h))
    MLP:    the first n_dense_layers are dense SwiGLU, the rest `MoELayer` (routed + shared experts)

Precision (docs/design.md §1): every weight is an fp32 master; activations between layers are BF16.
Under `Recipe("fp8")` the attention projections are `Fp8Linear`s, the dense MLPs run the shared
experts' FP8 MLP (moefp8.mlp.MLP) and the experts the FP8 MoE path, except the linears named in the
recipe's `bf16_linears` (the training config's default: none, bench/notes/convergence.md session 54);
under "bf16" the same layers compute in BF16 (`Bf16Linear`, the MLP's BF16 path). Embedding, LM head, norms (fp32 math), the attention core (F.scaled_dot_product_attention,
causal) and the router stay in high precision. Attention is multi-head attention with RoPE, not
DeepSeek-V3's MLA.

What the model runs with is passed in as values: the `Recipe`, the `GemmPolicy` (which GEMMs run)
and the MoE layers' `OverlapPolicy` (None: no overlap). It owns the FP8 scale statistics recorder
(`scale_stats`, moefp8.fp8.ScaleStats) that every layer reports to.

Shapes: B batch, S sequence, H hidden, T = B*S tokens, L layers, E experts, V vocabulary.
"""

import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from moefp8.config import ModelConfig
from moefp8.dispatch import Dispatcher, build_dispatcher
from moefp8.fp8 import TILE, ScaleStats
from moefp8.graphs import replays, replays_stack
from moefp8.kernels.grouped_gemm import GemmPolicy
from moefp8.kernels.norm import add_rms_norm, rms_norm, rms_norm_split
from moefp8.kernels.rope import rope_qkv, rope_tables
from moefp8.linear import Fp8Linear, Fp8NormQKVRopeFunction, fuses_norm, make_linear
from moefp8.loss import linear_cross_entropy
from moefp8.mlp import MLP
from moefp8.moe import MoELayer
from moefp8.moe_stages import RowCap
from moefp8.overlap import Handoff, OverlappedBlock, OverlapPolicy, mean_over_halves
from moefp8.recipe import Recipe

BF16 = torch.bfloat16


class ModelOutput(NamedTuple):
    out: Tensor  # the mean cross-entropy (fp32 scalar) when targets are given, else logits [B, S, V] fp32
    aux_loss: Tensor  # sum over MoE layers of their sequence-wise balance losses (0 when off)
    load_LE: Tensor  # int64 [L_moe, E] tokens routed to each expert in each MoE layer
    # bool [2 L + 2] on the device: some output of that stage was NaN/Inf, in `Transformer.stages()`
    # order (embed, layers.i.attn, layers.i.mlp, ..., head). One isfinite reduction per stage, no
    # host sync: the training loop reads it only once the loss is non-finite.
    nonfinite: Tensor


class RMSNorm(nn.Module):
    """fused (model.fused_norm): on CUDA moefp8's kernels (kernels/norm.py), which also fuse the
    residual add before the norm (`add`); else torch's."""

    def __init__(self, dim: int, eps: float, fused: bool = False):
        super().__init__()
        self.eps, self.fused = eps, fused
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # x * rsqrt(mean(x^2) + eps) * weight, computed in fp32 and rounded to BF16 once; torch's fused
        # kernel on CUDA (one pass each way), the composite on CPU. BF16 in, BF16 weight copy, BF16 out:
        # fp32 in and out cost two casts of the activation each way (~11 ms per step of the small model)
        if self.fused:
            return rms_norm(x, self.weight, self.eps)
        return F.rms_norm(x, (x.shape[-1],), self.weight.to(x.dtype), self.eps)

    def split(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """-> (the norm of x, x for its other consumer): where fused, the gradient that consumer gives x is
        added in the norm's backward pass, not by autograd in a pass of its own."""
        if self.fused:
            return rms_norm_split(x, self.weight, self.eps)
        return self(x), x

    def add(self, x: Tensor, a: Tensor) -> tuple[Tensor, Tensor]:
        """-> (h = x + a, the norm of h): one pass each way where fused."""
        if self.fused:
            return add_rms_norm(x, a, self.weight, self.eps)
        h = x + a
        return h, self(h)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, recipe: Recipe, stats: ScaleStats | None = None,
                 gemm: GemmPolicy = GemmPolicy()):
        super().__init__()
        self.n_heads, self.head_dim = cfg.n_heads, cfg.head_dim
        d = cfg.n_heads * cfg.head_dim
        self.wqkv = make_linear(cfg.hidden, 3 * d, recipe, "wqkv", stats, gemm)
        self.wo = make_linear(d, cfg.hidden, recipe, "wo", stats, gemm)

    def forward(self, x_BSH: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        B, S, _ = x_BSH.shape
        # one function for the three, not three qkv[:, :, i]: each select's backward would zero-fill a
        # full-size d(qkv) and autograd add the three (~1 ms per layer at 32 x 1024 tokens of the small
        # model); unbind's backward stacked them in one more pass, which rope_qkv writes in place
        if isinstance(self.wqkv, Fp8Linear) and self.head_dim == TILE:  # d(qkv) quantized in rope's backward
            q, k, v = self.wqkv.qkv_rope(x_BSH, cos, sin, self.n_heads)
        else:
            q, k, v = rope_qkv(self.wqkv(x_BSH).view(B, S, 3, self.n_heads, self.head_dim), cos, sin)
        return self._core(q, k, v)

    def normed(self, x_BSH: Tensor, norm: "RMSNorm", cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """norm, then this attention: -> (its output, x for the residual, whose gradient the norm's backward
        adds). With fused norms and an FP8 QKV the norm quantizes its output for the QKV GEMM in its own pass
        (`Fp8NormQKVRopeFunction`); else `norm.split` and `forward`."""
        if fuses_norm(self.wqkv, self.head_dim, norm.fused, x_BSH):
            w = self.wqkv
            q, k, v, x_res = Fp8NormQKVRopeFunction.apply(x_BSH, w.weight, norm.weight, norm.eps, cos, sin,
                                                          self.n_heads, w.scale_fmt, w.stats, w.gemm)
            return self._core(q, k, v), x_res
        n, x_res = norm.split(x_BSH)
        return self(n, cos, sin), x_res

    def _core(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q, k [B, nh, S, hd] (rotated), v [B, S, nh, hd] -> the attention's output projection [B, S, H]."""
        B, _, S, _ = q.shape
        v = v.transpose(1, 2)  # q, k, v: [B, nh, S, hd] views of heads-last memory
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, nh, S, hd] bf16
        return self.wo(o.transpose(1, 2).reshape(B, S, -1))


class Block(nn.Module):
    """A transformer block (the `layer`-th): attention, then a dense MLP or a MoE layer. recipe,
    dispatcher, overlap, gemm: as `Transformer`'s; stats: the recorder its layers report to (the
    model's; None: one of its own, off)."""

    def __init__(self, cfg: ModelConfig, layer: int, recipe: Recipe, dispatcher: Dispatcher | None,
                 stats: ScaleStats | None = None, overlap: OverlapPolicy | None = None,
                 gemm: GemmPolicy = GemmPolicy(), recompute_attention: bool = False,
                 recompute_expert_out: bool = False, row_cap: RowCap | None = None, shared_overlap: bool = False):
        super().__init__()
        stats = stats if stats is not None else ScaleStats()
        self.stats, self.recompute_attention = stats, recompute_attention
        self.graphed_attend = None  # (the captured attend, its input shape): moefp8.graphs.graph_attention
        self.graphed_whole = None  # the same for the whole block (train.cuda_graphs_mlp)
        self.whole_outputs = ()  # the names of whole_checked's optional outputs, as captured
        self.graphed_halves = (None, None)  # the same for the overlap's micro-batches A and B (MoE blocks)
        self.attn_norm = RMSNorm(cfg.hidden, cfg.norm_eps, cfg.fused_norm)
        self.attn = Attention(cfg, recipe, stats, gemm)
        self.mlp_norm = RMSNorm(cfg.hidden, cfg.norm_eps, cfg.fused_norm)
        self.is_moe = layer >= cfg.n_dense_layers
        if self.is_moe:
            self.mlp = MoELayer(cfg.hidden, cfg.moe_inter, cfg.n_experts, cfg.topk, cfg.n_shared, recipe, dispatcher,
                                overlap, gemm, stats, score_func=cfg.score_func, n_groups=cfg.n_groups,
                                topk_groups=cfg.topk_groups, route_scale=cfg.route_scale,
                                bias_update_rate=cfg.bias_update_rate, seq_aux_alpha=cfg.seq_aux_alpha,
                                force_balance=cfg.force_balanced_routing, recompute_out=recompute_expert_out,
                                row_cap=row_cap, shared_overlap=shared_overlap)
        else:
            self.mlp = MLP(cfg.hidden, cfg.dense_inter, recipe.dense_fp8("dense_mlp"), recipe.scale_fmt, stats,
                           gemm)

    def attend(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The block up to its MLP: -> (attention output a, x + a, the MLP's input RMSNorm(x + a))."""
        a, x = self.attn.normed(x, self.attn_norm, cos, sin)  # x feeds the norm and the residual: one gradient pass
        h, m = self.mlp_norm.add(x, a)
        return a, h, m

    def attend_checked(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """`attend` as the captured graph runs it (moefp8.graphs): -> (x + a, the MLP's input, whether
        the attention output a holds a NaN/Inf)."""
        a, h, m = self.attend(x, cos, sin)
        return h, m, _nonfinite(a)

    def _mlp(self, h: Tensor, seq_len: int) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """The MLP on its input h -> (output, aux_loss, load_E): the MoE layer's three, a dense MLP's output alone."""
        return self.mlp(h, seq_len=seq_len) if self.is_moe else (self.mlp(h), None, None)

    def whole_checked(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, ...]:
        """The block as its captured whole graph runs it (moefp8.graphs, train.cuda_graphs_mlp): -> (x + a + o,
        whether a holds a NaN/Inf, whether o does, then those of the MoE layer's load_E, aux_loss and its capped
        layouts' overflow flags (dispatch.rows_factor under EP) that it has, named in `whole_outputs`)."""
        a, h, m = self.attend(x, cos, sin)
        cap = self.mlp.row_cap if self.is_moe else None
        prior = cap.swap(None) if cap is not None else None  # this block's flags alone, returned
        o, aux, load = self._mlp(m, x.shape[1])
        over = cap.swap(prior) if cap is not None else None
        extra = {"load": load, "aux": aux, "overflow": over}
        self.whole_outputs = tuple(k for k, v in extra.items() if v is not None)
        return (h + o, _nonfinite(a), _nonfinite(o)) + tuple(extra[k] for k in self.whole_outputs)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, flags: list, handoff: Handoff | None = None):
        """x [B, S, H] bf16 -> (out bf16, aux_loss | None, load_E | None); appends to `flags` one
        bool tensor per sub-layer: its output holds a NaN/Inf. handoff: passed along consecutive
        blocks (moefp8.overlap.Handoff): x's second half may still be pending from the previous
        block, and an overlapped block leaves its own output's second half pending; None: x and
        the output are whole on return."""
        if self.is_moe and self.mlp.overlap is not None and x.shape[0] > 1:
            # two micro-batches (the batch halves): attention and experts overlap the exchanges
            out, aux_2, load, nf_attn, nf_mlp = OverlappedBlock.apply(x, cos, sin, self, handoff, *self.parameters())
            flags += [nf_attn, nf_mlp]
            return out, mean_over_halves(aux_2, x.shape[0]), load
        if handoff is not None:
            handoff.wait()
        if replays(self, x, whole=True):  # train.cuda_graphs_mlp: the captured block (moefp8.graphs)
            out, nf_attn, nf_mlp, *rest = self.graphed_whole[0](x, cos, sin)
            flags += [nf_attn, nf_mlp]
            got = dict(zip(self.whole_outputs, rest))
            if "overflow" in got:  # (the graph's own buffer, which its next replay overwrites)
                self.mlp.row_cap.note(got["overflow"].clone())
            return out, got.get("aux"), got.get("load")
        if replays(self, x):  # train.cuda_graphs: the captured attention (moefp8.graphs)
            x, h, nf = self.graphed_attend[0](x, cos, sin)
            flags.append(nf)
        else:
            if self.recompute_attention and torch.is_grad_enabled():
                # keep x only; the backward runs attend again (its FP8 tiles are not recorded twice)
                a, x, h = checkpoint(self.attend, x, cos, sin, use_reentrant=False,
                                     context_fn=lambda: (nullcontext(), self.stats.paused()))
            else:
                a, x, h = self.attend(x, cos, sin)
            flags.append(_nonfinite(a))
        o, aux, load = self._mlp(h, x.shape[1])
        flags.append(_nonfinite(o))
        return x + o, aux, load


def _nonfinite(x: Tensor) -> Tensor:
    """A bool device tensor: does x hold a NaN or an infinity? One pass over x (its largest magnitude,
    which a NaN propagates to) where `~isfinite(x).all()` made five (abs, two compares, and, all)."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.bool, device=x.device)
    return ~torch.isfinite(torch.linalg.vector_norm(x.detach(), float("inf")))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, recipe: Recipe = Recipe(), dispatcher: Dispatcher | None = None,
                 ep_rank: int = 0, seed: int = 0, overlap: OverlapPolicy | None = None,
                 gemm: GemmPolicy = GemmPolicy(), recompute: tuple[str, ...] = (), loss_chunk: int = 0,
                 rows_factor: float = 0.0, shared_overlap: bool = False, send_factor: float = 0.0):
        """recipe: the `Recipe` (training builds it with `Recipe.from_config`); dispatcher: this
        rank's expert-parallel dispatcher, shared by the MoE layers (default: the EP=1 `local`
        backend); ep_rank: this rank's index in its EP group (it holds global experts
        [ep_rank * E_l, (ep_rank + 1) * E_l)); seed: the initialization seed; overlap: the MoE
        layers' two micro-batch overlap (an `OverlapPolicy`; None: off); gemm: the `GemmPolicy`
        every GEMM runs with; recompute: sub-layers whose activations the backward recomputes
        instead of keeping ("attention": each block's attention with its norms, from the block's
        input; "expert_out": the FP8 experts' output y, from fc2's FP8 input; train.recompute);
        loss_chunk: the LM head's cross-entropy by chunks of that many tokens, the [T, V] logits
        never whole (moefp8.loss; train.loss_chunk; 0: off); rows_factor: the MoE layers' permuted rows
        under EP sized for that factor of the balanced load without a read-back (`row_cap`, a
        `moe_stages.RowCap`: the training loop reads its overflow flags; dispatch.rows_factor; 0: off);
        send_factor: with it, the capacity mode's send blocks sized likewise (dispatch.send_factor; 0: off);
        shared_overlap: the MoE layers' shared experts behind their dispatches (`MoELayer`; dispatch.shared_overlap).
        `scale_stats`: the model's FP8 tile-scale recorder (off until the caller turns it on)."""
        super().__init__()
        self.cfg, self.recipe, self.gemm, self.loss_chunk = cfg, recipe, gemm, loss_chunk
        self.scale_stats = ScaleStats()
        self.row_cap = RowCap(rows_factor, send_factor)
        self.dispatcher = dispatcher = dispatcher or build_dispatcher("local", cfg.n_experts)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.layers = nn.ModuleList(Block(cfg, i, recipe, dispatcher, self.scale_stats, overlap, gemm,
                                          recompute_attention="attention" in recompute,
                                          recompute_expert_out="expert_out" in recompute, row_cap=self.row_cap,
                                          shared_overlap=shared_overlap)
                                    for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.hidden, cfg.norm_eps, cfg.fused_norm)
        self.head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        self.expert_offset = ep_rank * dispatcher.num_local_experts
        self.graphed_stack = None  # (every block as one captured graph, its input shape): moefp8.graphs
        if not self.head.weight.is_meta:  # on the meta device (`Transformer.build`): drawn once allocated
            self.reset_parameters(seed)

    @classmethod
    def build(cls, cfg: ModelConfig, *args, device: torch.device, seed: int = 0, **kw) -> "Transformer":
        """`Transformer(cfg, *args, seed=seed, **kw).to(device)`, the same values, made in place:
        constructed on the meta device (nothing allocated, nothing drawn), allocated on `device`,
        then drawn once by reset_parameters. The constructor's own draws (the experts' and MLPs'
        randn, which reset_parameters overwrites) cost the 16B-class preset most of its build."""
        with torch.device("meta"):
            model = cls(cfg, *args, seed=seed, **kw)
        model.to_empty(device=device)
        model.reset_parameters(seed)
        return model

    def routed_expert_names(self) -> list[str]:
        """Parameters sharded over the EP group: [E_l, ...] slices of the routed experts."""
        return [f"layers.{i}.mlp.{w}" for i, b in enumerate(self.layers) if b.is_moe for w in ("w1", "w2")]

    @torch.no_grad()
    def reset_parameters(self, seed: int = 0) -> None:
        """Normal(0, init_std) for every matrix and expert, the output projections (wo, w2) scaled
        by 1/sqrt(2 L) (GPT-2); the token embeddings Normal(0, embed_init_std or init_std); routers
        Normal(0, 1/sqrt(H)); norms at 1; the routers' biases (the
        only buffers) at 0. Each tensor (each expert: by its global index) draws from its own
        generator seeded from (seed, name): the weights do not depend on construction order or on
        how the experts are sharded."""
        std, experts = self.cfg.init_std, set(self.routed_expert_names())
        jobs = []  # (destination, generator key, std): independent draws, filled by a pool of threads
        for b in self.buffers():
            b.zero_()
        for name, p in self.named_parameters():
            if p.dim() == 1:  # the RMSNorms' weights
                p.fill_(1.0)
                continue
            s = self.cfg.hidden ** -0.5 if ".router." in name else std
            if name == "embed.weight" and self.cfg.embed_init_std:
                s = self.cfg.embed_init_std
            if name.endswith(("wo.weight", "w2.weight", "w2")):
                s *= (2 * self.cfg.n_layers) ** -0.5
            if name in experts:  # one generator per global expert
                jobs += [(p[e], f"{name}/{self.expert_offset + e}", s) for e in range(p.shape[0])]
            else:
                jobs.append((p, name, s))

        @torch.no_grad()  # (grad mode is per thread)
        def draw(job) -> None:  # a CPU generator draws on one thread; torch lets go of the GIL meanwhile
            dst, key, s = job
            g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(key.encode()))
            dst.copy_(torch.randn(dst.shape, generator=g).mul_(s))

        # the 16B-class preset's 5B parameters per GPU drew for minutes on one thread
        with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1)) as pool:
            list(pool.map(draw, jobs))

    def forward(self, idx_BS: Tensor, targets_BS: Tensor | None = None) -> ModelOutput:
        B, S = idx_BS.shape
        cos, sin = rope_tables(S, self.cfg.head_dim, self.cfg.rope_theta, idx_BS.device)
        x = self.embed(idx_BS).to(BF16)
        flags = [_nonfinite(x)]
        aux = torch.zeros((), device=idx_BS.device)
        loads = []
        handoff = Handoff()  # an overlapped block's output half B may finish behind the next block's attention
        if replays_stack(self, x):  # train.cuda_graphs_mlp, every block whole: one graph (moefp8.graphs)
            x, *rest = self.graphed_stack[0](x, cos, sin)
            got = iter(rest)
            for layer in self.layers:
                flags += [next(got), next(got)]  # (its attention's, its MLP's)
                extra = {k: next(got) for k in layer.whole_outputs}
                if "aux" in extra:
                    aux = aux + extra["aux"]
                if "load" in extra:
                    loads.append(extra["load"])
        else:
            for layer in self.layers:
                x, a, load = layer(x, cos, sin, flags, handoff)
                if a is not None:
                    aux = aux + a
                if load is not None:
                    loads.append(load)
        handoff.wait()
        load_LE = torch.stack(loads) if loads else torch.zeros(0, self.cfg.n_experts, dtype=torch.int64,
                                                               device=idx_BS.device)
        h = self.norm(x)
        if targets_BS is not None and self.loss_chunk > 0:  # the logits by chunks, never whole
            loss = linear_cross_entropy(h.view(B * S, -1), self.head.weight, targets_BS.reshape(-1), self.loss_chunk)
            flags.append(_nonfinite(loss))  # a non-finite logit makes its row's log-sum-exp, and so the loss
            return ModelOutput(loss, aux, load_LE, torch.stack(flags))
        logits = F.linear(h, self.head.weight.to(BF16)).float()  # [B, S, V]
        flags.append(_nonfinite(logits))
        if targets_BS is None:
            return ModelOutput(logits, aux, load_LE, torch.stack(flags))
        loss = F.cross_entropy(logits.view(B * S, -1), targets_BS.reshape(-1))
        return ModelOutput(loss, aux, load_LE, torch.stack(flags))

    def stages(self) -> list[str]:
        """Names of the entries of ModelOutput.nonfinite, in forward order."""
        return ["embed", *(f"layers.{i}.{s}" for i in range(len(self.layers)) for s in ("attn", "mlp")), "head"]

    def routers(self) -> list:
        return [b.mlp.router for b in self.layers if b.is_moe]

    def set_overlap(self, overlap: OverlapPolicy | None) -> None:
        """The MoE layers' schedule from the next forward on: two micro-batches with `overlap`'s
        policy, or (None) the plain one (dispatch.overlap=auto switches between them; the
        dispatcher's capacity must hold the whole micro-batch)."""
        for b in self.layers:
            if b.is_moe:
                b.mlp.overlap = overlap


def param_counts(cfg: ModelConfig) -> dict:
    """Parameters of the whole model (all experts, all ranks) from the config alone:
    total, active per token (top-k of the routed experts), and the embedding's share."""
    H, d, L, Lm = cfg.hidden, cfg.n_heads * cfg.head_dim, cfg.n_layers, cfg.n_layers - cfg.n_dense_layers
    attn = 4 * H * d + 2 * H  # wqkv, wo, two norms
    dense = 3 * H * cfg.dense_inter
    expert = 3 * H * cfg.moe_inter
    moe_fixed = cfg.n_shared * expert + cfg.n_experts * H  # shared experts + router
    embed = cfg.vocab_size * H
    head = cfg.vocab_size * H + H  # LM head + final norm
    total = L * attn + cfg.n_dense_layers * dense + Lm * (moe_fixed + cfg.n_experts * expert) + embed + head
    active = L * attn + cfg.n_dense_layers * dense + Lm * (moe_fixed + cfg.topk * expert) + embed + head
    return {"total": total, "active": active, "embedding": embed}


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward = 3x forward): 6 x the active matrix parameters
    (everything but the embedding lookup) plus causal attention's QK^T and PV, 6 * L * S * d
    (12 * L * S * d halved by the causal mask)."""
    n = param_counts(cfg)
    d = cfg.n_heads * cfg.head_dim
    return 6.0 * (n["active"] - n["embedding"]) + 6.0 * cfg.n_layers * seq_len * d
