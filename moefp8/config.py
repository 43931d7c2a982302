"""Training configuration: one small dataclass per concern (STYLE 10).

These dataclasses are the schema of the Hydra configs in `configs/` (`train.py` registers
`Config` as the structured schema, composes the YAML presets onto it and converts the result once
with `OmegaConf.to_object`); nothing here imports Hydra, and everything below `train.py` receives
plain dataclasses. `validate(cfg)` checks the values that the type system cannot and raises
ValueError naming the offending key and value.
"""

import math
import os
from dataclasses import dataclass, field, fields
from typing import Any

from moefp8.data import source_dir
from moefp8.tokenizer import TokenizerError, parse_spec
from moefp8.fp8 import TILE

RECIPES = ("fp8", "bf16")
SCALE_FMTS = ("pow2", "fp32")
GEMM_LIBS = ("moefp8", "deepgemm", "auto")  # recipe.gemm: GemmPolicy.mgrouped_lib, or auto (build.gemm_policy)
MOE_IMPLS = ("moefp8", "megablocks")  # recipe.moe_impl (moefp8.recipe.Recipe.moe_impl)
BACKENDS = ("local", "all_to_all", "deepep")
DISPATCH_MODES = ("auto", "exact", "capacity")  # the all_to_all backend's modes (dispatch/all_to_all.py)
DISPATCH_TRANSPORTS = ("collective", "copy_engine")  # how its bytes move (dispatch/all_to_all.py, copy_engine.py)
DEVICES = ("auto", "cpu", "cuda")
WANDB_MODES = ("offline", "online", "disabled")
NAN_POLICIES = ("stop", "skip")
MOMENT_DTYPES = ("bf16", "fp32")
SCORE_FUNCS = ("sigmoid", "softmax")
DENSE_LINEARS = ("wqkv", "wo", "dense_mlp")  # the non-expert linears: attention projections, dense MLPs
RECOMPUTE = ("attention", "expert_out")  # train.recompute's sub-layers
BYTE_VOCAB = 257  # 256 byte values + EOS (moefp8.data)


@dataclass
class ModelConfig:
    """Decoder-only MoE transformer (moefp8.model). Attention: n_heads x head_dim (RoPE);
    the first n_dense_layers MLPs are dense SwiGLU (dense_inter), the rest MoE layers."""
    name: str = "tiny"  # the preset's name; names the default run dir, outputs/runs/<name>-<recipe>
    vocab_size: int = BYTE_VOCAB  # embedding and LM-head rows; >= the data's vocabulary (bytes: 257; bpe:N: N)
    hidden: int = 128  # H, the residual stream width; a multiple of 128 with recipe=fp8
    n_layers: int = 3  # transformer blocks, dense and MoE together
    n_dense_layers: int = 1  # the first N blocks have a dense SwiGLU MLP, the others MoE; 0: all MoE
    n_heads: int = 2  # attention heads (multi-head: as many key/value heads)
    head_dim: int = 64  # per head; even (RoPE); n_heads * head_dim a multiple of 128 with recipe=fp8
    dense_inter: int = 256  # SwiGLU intermediate size of the dense MLPs
    moe_inter: int = 128  # intermediate size I of each routed (and shared) expert
    n_experts: int = 8  # E, routed experts per MoE layer; divisible by dispatch.ep_size and n_groups
    topk: int = 2  # K, routed experts per token
    n_shared: int = 1  # shared experts (of moe_inter each) that every token passes through; 0: none
    score_func: str = "sigmoid"  # router scores: sigmoid (DeepSeek-V3; top-k weights renormalized to 1) | softmax
    # group-limited routing: the experts in n_groups equal groups, each token picks its top-k from
    # the best topk_groups of them; 1: off
    n_groups: int = 1
    topk_groups: int = 1  # groups a token picks from (1 <= topk_groups <= n_groups)
    route_scale: float = 1.0  # multiplies the picked experts' routing weights (DeepSeek-V3: 2.5)
    bias_update_rate: float = 1e-3  # aux-loss-free balancing: bias step per optimizer step; 0: off
    seq_aux_alpha: float = 1e-4  # sequence-wise balance loss weight (0: off)
    # benchmarks only: the routers pick experts by random logits (every expert equally likely, the same
    # compute and bytes), the balanced load of a trained router where a fresh one sends nearly every
    # token to the same experts (bench/notes/scale.md, session 43). Megatron: moe_router_force_load_balancing
    force_balanced_routing: bool = False
    rope_theta: float = 10000.0  # RoPE base frequency
    norm_eps: float = 1e-6  # RMSNorm epsilon
    # the RMSNorms by moefp8's kernels (kernels/norm.py), each block's residual add before its MLP's norm
    # in the same pass, one pass each way (the fused residual adds); false: torch's F.rms_norm and a
    # separate add. The same function (CPU: the same code). 3B step on one H200: FP8 +2.1%, BF16 +1.2%
    # (bench/notes/scale.md, session 55)
    fused_norm: bool = True
    init_std: float = 0.02  # std of the normal init of matrices and experts (wo, w2: also / sqrt(2 n_layers))
    # std of the token embeddings' normal init; 0: init_std. At init_std (0.02) an untrained deep model's
    # routers send nearly every token to the same experts (the attention's shared context average outweighs
    # each token's embedding); torchtitan draws embeddings from N(0, 1), which routes near balance from
    # the first step (bench/notes/scale.md, session 43). Its effect on the loss is not measured yet.
    embed_init_std: float = 0.0


# Which linears compute in FP8 and how their scales are stored (moefp8.fp8, moefp8.linear).
@dataclass
class RecipeConfig:
    recipe: str = "fp8"  # fp8: the DeepSeek-V3 recipe for every linear but embedding/head/router/wo; bf16: baseline
    scale_fmt: str = "pow2"  # FP8 scales: powers of two (pow2) or exact amax/448 (fp32)
    # FP8 recipe: the dense linears (attention projections, dense MLPs) in FP8 too; false: those in
    # BF16 and only the MoE layers' experts in FP8 (an ablation knob: which part costs accuracy)
    fp8_dense: bool = True
    # FP8 recipe: these of the dense linears ("wqkv", "wo", "dense_mlp") in BF16, a finer knob than
    # fp8_dense=false (which is all three). Default []: every dense linear in FP8 (wo in FP8: held-out
    # loss within the FP8 runs' spread on the small BPE model, 1.1% faster at 3B; [wo] was the default
    # from session 11 to 54: bench/notes/convergence.md, session 54).
    bf16_linears: list[str] = field(default_factory=list)
    # FP8 recipe: the experts' m-grouped GEMMs (fprop, dgrad) by moefp8's kernels or, where DeepGEMM is
    # built, by DeepGEMM's (kernels/deepgemm.py; the same numerics); auto (the default): DeepGEMM where it
    # imports, is bit-identical and faster on the model's expert shapes (timed at start), else moefp8
    # (3B on one H200: +1.1-1.5% a whole step with DeepGEMM; bench/notes/scale.md, session 65). The wgrad stays moefp8's
    gemm: str = "auto"
    # the routed experts: moefp8's pipeline, or megablocks' dropless MoE (dMoE; moefp8.megablocks_experts)
    # on moefp8's router and weights: the BF16 baseline a user would pick instead (recipe=bf16, EP=1)
    moe_impl: str = "moefp8"


# Expert parallelism: how tokens travel to the ranks that hold their experts (dispatch/).
@dataclass
class DispatchConfig:
    backend: str = "local"  # local (EP=1, no communication) | all_to_all (torch.distributed) | deepep (DeepEP)
    ep_size: int = 1  # expert-parallel group size (ranks sharing one copy of the experts)
    # two micro-batches per block (MoE layers), communication overlapped (moefp8.overlap): false | true |
    # auto (the first steps time both schedules and keep the faster; moefp8.overlap_auto)
    overlap: Any = False
    # all_to_all: "exact" (count exchange + host sync), "capacity" (fixed blocks, no sync) or "auto"
    # (capacity on GPUs when ep_size <= model.topk)
    mode: str = "auto"
    # capacity mode: the most tokens a rank passes to one dispatch; 0: train.micro_batch * train.seq_len
    # (with overlap: the larger micro-batch's tokens)
    capacity: int = 0
    # EP > 1, where the dispatch brings no per-expert counts (the capacity mode): size each rank's permuted
    # rows for this factor of the balanced load instead of reading the counts back (one host sync per MoE
    # layer and micro-batch); a step where a rank's pairs need more runs again with exact layouts, said on
    # the console (moefp8.moe_stages.RowCap). 0: off (the read-back)
    rows_factor: float = 0.0
    # with rows_factor > 0, the all_to_all capacity mode's send blocks: instead of a whole capacity per
    # destination rank, this factor x the tokens it gets on average (p x capacity, p = 1 - C(E - E_l, K) /
    # C(E, K): 0.84 at top-6 of 64 experts over 4 ranks, 0.57 over 8), compacted: fewer bytes on the wire. A
    # rank whose block is too small flags it as a layout does, and the step runs again with whole blocks. 0: off
    send_factor: float = 0.0
    # all_to_all: "collective" (torch.distributed: NCCL kernels / gloo) or "copy_engine" (NVLink peer
    # copies, no SMs taken: one host, GPUs, the capacity mode only)
    transport: str = "collective"
    slots: int = 4  # copy_engine: send slots in its ring (more: fewer waits for the slowest peer, more memory)
    # the most CTAs (SMs) an EP collective may use: ncclConfig max_ctas of the EP group's communicator
    # (NCCL only, 1-64; 0: NCCL's choice). Fewer leave SMs to the GEMMs beside an overlapped exchange,
    # which run slower next to resident NCCL kernels (bench/notes/overlap.md, session 45)
    nccl_ctas: int = 0
    # dispatch.overlap: SMs the overlapped layers' GEMMs leave free for the exchanges (OverlapPolicy); 0: none
    gemm_sm_reserve: int = 0
    # the plain schedule (no micro-batch split): each MoE layer's shared experts run while its dispatch (and,
    # in the backward, its gradient dispatch) exchanges on a side stream (all_to_all capacity mode, EP > 1;
    # moefp8.moe_stages.RoutedExperts). The same bits as without
    shared_overlap: bool = False
    # node-limited routing: each token's experts on at most max_nodes nodes of the EP group (the
    # router's group-limited top-k with one group per node; DeepSeek-V3: 4); 0: off
    max_nodes: int = 0
    # ranks per node (node-limited routing, the hierarchical dispatch, the combine's summation order
    # across nodes); 0: torchrun's LOCAL_WORLD_SIZE
    ranks_per_node: int = 0
    # all_to_all across nodes: each token crosses to a remote node once and is forwarded inside it
    # (dispatch/hierarchical.py; exact mode, no dispatch.overlap); false: once per remote rank
    hierarchical: bool = False


# AdamW on fp32 master weights (moefp8.optim): linear warm-up, then cosine decay to train.steps.
@dataclass
class OptimConfig:
    lr: float = 3e-3  # peak learning rate, reached after warmup_steps
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio at train.steps
    warmup_steps: int = 10  # linear warm-up steps (clamped to train.steps)
    beta1: float = 0.9  # Adam's first-moment decay
    beta2: float = 0.95  # Adam's second-moment decay
    eps: float = 1e-8  # added to Adam's denominator
    weight_decay: float = 0.1  # on matrices only: not norms, biases or embeddings
    grad_clip: float = 1.0  # global grad norm; 0: off
    moment_dtype: str = "bf16"  # Adam moments: bf16 (DeepSeek-V3) or fp32


@dataclass
class DataConfig:
    """Tokenized shards (moefp8.data). If `path` holds no index.json yet, it is prepared from
    `prepare_from` with `tokenizer`: "stdlib" (the Python standard library's *.py sources: real text
    found offline on any machine), "site-packages" (torch's folder of installed packages), a folder of
    text files (several of these comma-separated, read in that order), or "" (then a missing path is
    an error)."""
    path: str = "outputs/data/stdlib"  # the prepared shards (index.json); prepared on first use if absent
    prepare_from: str = "stdlib"  # what to prepare data.path from: stdlib | site-packages | DIR[,DIR...] | ""
    glob: str = "*.py"  # file pattern under prepare_from; several comma-separated: "*.py,*.h"
    max_bytes: int = 32_000_000  # cap on the text read when preparing
    # bytes (vocabulary 257) | bpe:N (a byte-level BPE of N tokens trained on the prepared texts) |
    # PATH of a Hugging Face tokenizer.json (copied beside the shards); model.vocab_size must hold it
    tokenizer: str = "bytes"
    verify: bool = True  # before training: every shard against its sha256 in index.json (~1 GB/s, rank 0)
    val_windows: int = 0  # windows of train.seq_len + 1 tokens held out of training for train.eval_every


# The training loop (moefp8.train): length, batch, logging, checkpoints, resume, failures.
@dataclass
class TrainConfig:
    steps: int = 150  # optimizer steps in all (the tiny default trains ~70 s on 2 CPU cores)
    micro_batch: int = 8  # sequences per micro-batch per data-parallel rank
    grad_accum: int = 1  # micro-batches per optimizer step
    # with grad_accum > 1, the routed experts' gradients summed inside their wgrad GEMMs where no other rank
    # sums them (moefp8.accum: the same bits as autograd's sums, without its add per micro-batch)
    grad_accum_fusion: bool = True
    seq_len: int = 256  # tokens per sequence (windows of seq_len + 1 tokens: inputs, shifted targets)
    log_every: int = 10  # a console line every N steps (metrics.jsonl gets every step)
    fp8_stats_every: int = 100  # FP8 recipe: tile-scale statistics (fp8/* metrics) of one step in N; 0: off
    # the LM head's loss by chunks of this many tokens of the micro-batch, the [T, V] logits never
    # whole (moefp8.loss: ~10 bytes per token and vocabulary entry less at the peak); 0: off
    loss_chunk: int = 0
    # before a GPU run: stop with one line when moefp8.memory's plan passes 90% of the GPU (an
    # estimate: false runs anyway, e.g. to find the largest micro-batch by trying)
    check_memory: bool = True
    grad_bucket_mb: float = 25.0  # data-parallel gradient all-reduce buckets (moefp8.grad_sync), MB
    # the most CTAs (SMs) each gradient all-reduce may use: ncclConfig max_ctas of the communicators the
    # buckets reduce on (NCCL only, 1-64; 0: NCCL's choice, on the default group). Fewer leave SMs to the
    # backward's GEMMs, which the reductions run beside; too few and the last buckets reduce after it
    grad_reduce_ctas: int = 0
    # selective activation recompute: [attention] keeps only each block's input for its attention
    # and runs norm, QKV, attention, output projection again in the backward; [expert_out] (FP8
    # recipe) keeps fc2's FP8 input instead of the experts' BF16 output y and recomputes y for the
    # routing weights' gradient (one more fc2 GEMM per MoE layer); moefp8.memory counts both
    recompute: list[str] = field(default_factory=list)
    # CUDA graphs for each block's attention (moefp8.graphs): captured once, replayed every step, ~40
    # fewer host launches per layer; blocks in `recompute` and evaluation run eagerly. GPU only
    cuda_graphs: bool = False
    # with cuda_graphs: each block's MLP too (a dense MLP; a MoE layer where it exchanges no rows, EP = 1,
    # its permuted rows at their static bound; under EP one whose exchanges have fixed sizes, the all_to_all
    # capacity mode over NCCL, and whose layouts are capped, dispatch.rows_factor > 0): the whole block
    # replays one graph (the exchanges' collectives in it). Other MoE blocks keep the attention's graph only
    cuda_graphs_mlp: bool = False
    ckpt_every: int = 50  # a checkpoint every N steps and at the end; 0: only at the end
    # checkpoints kept in the run dir: the newest keep_last (0: all), plus any you pin by creating a
    # file named `keep` in its step_N/ folder; older ones are deleted after each save
    keep_last: int = 3
    eval_every: int = 0  # held-out loss (`val_loss`) over data.val_windows every N steps and at the end; 0: off
    out_dir: str = "outputs/runs/default"  # the run dir: checkpoints, metrics, wandb files
    # auto: the checkpoint `latest` names in out_dir (a damaged one stops the run, named); last_good: the
    # newest checkpoint that passes its checksums (says which newer ones it passed over and why); none: a
    # fresh start (refused in a run dir that already holds a run); or a step_N/ path
    resume: str = "auto"
    seed: int = 0  # model init and data order (the held-out windows do not depend on it)
    device: str = "auto"  # auto: cuda if available, else cpu
    nan_policy: str = "stop"  # non-finite loss or grad norm: stop (keep the last good checkpoint) | skip the step
    max_skipped_steps: int = 10  # nan_policy=skip: stop with an error after this many skipped steps in a row
    peak_tflops: float = 0.0  # for MFU; 0: look up the GPU (H100/H200 dense BF16 or FP8), none on CPU
    progress: bool = True  # a progress bar when the console is a terminal
    # seconds a collective waits for its peers before this rank gives up (a peer died or hangs,
    # e.g. on another node): gloo raises and the run stops with one line; NCCL's watchdog aborts
    dist_timeout_s: float = 600.0
    # wall-clock budget of one start, in seconds (0: none): after the first step that ends past it
    # the run writes a checkpoint and exits; the same command resumes it (a scheduler's time limit)
    time_limit_s: float = 0.0
    # deterministic kernels (torch.use_deterministic_algorithms, CUBLAS_WORKSPACE_CONFIG, memory-efficient
    # attention instead of flash attention, whose backward is not; the data-parallel gradient buckets reduced
    # after the backward, not during it), for GPU runs that repeat (and resume) bit for bit; an op with no
    # deterministic kernel warns, naming it
    deterministic: bool = False


# wandb, on rank 0 (metrics.jsonl in the run dir is written either way).
@dataclass
class LoggerConfig:
    mode: str = "offline"  # wandb: offline (run files in the run dir), online (needs a key), disabled
    project: str = "moefp8"  # wandb project
    name: str = ""  # wandb run name; "": the run dir's name


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    recipe: RecipeConfig = field(default_factory=RecipeConfig)
    dispatch: DispatchConfig = field(default_factory=DispatchConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)


def bf16_linears(r: RecipeConfig) -> frozenset[str]:
    """The dense linears that compute in BF16 under the FP8 recipe (wo by default)."""
    return frozenset(r.bf16_linears if r.fp8_dense else DENSE_LINEARS)


def _one_of(key: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{key}={value!r}: expected one of {', '.join(map(repr, allowed))}")


def _positive(key: str, value) -> None:
    if value <= 0:
        raise ValueError(f"{key}={value!r}: must be > 0")


def validate(cfg: Config) -> None:
    """Raises ValueError naming the first offending `key=value` (and why)."""
    m, r, d, o, data, t, lg = cfg.model, cfg.recipe, cfg.dispatch, cfg.optim, cfg.data, cfg.train, cfg.logger
    _one_of("recipe.recipe", r.recipe, RECIPES)
    _one_of("recipe.scale_fmt", r.scale_fmt, SCALE_FMTS)
    _one_of("recipe.gemm", r.gemm, GEMM_LIBS)
    _one_of("recipe.moe_impl", r.moe_impl, MOE_IMPLS)
    if r.moe_impl == "megablocks" and (r.recipe != "bf16" or d.ep_size != 1 or d.backend != "local" or d.overlap):
        raise ValueError(f"recipe.moe_impl=megablocks: megablocks' dMoE stands in for the BF16 recipe's experts on one "
                         f"process; set recipe=bf16 dispatch=local dispatch.ep_size=1 dispatch.overlap=false (got "
                         f"recipe={r.recipe}, dispatch={d.backend}, dispatch.ep_size={d.ep_size}, "
                         f"dispatch.overlap={d.overlap}) or recipe.moe_impl=moefp8")
    _one_of("dispatch.backend", d.backend, BACKENDS)
    if not isinstance(d.overlap, bool) and d.overlap != "auto":
        raise ValueError(f"dispatch.overlap={d.overlap!r}: expected false, true or auto")
    if d.shared_overlap and (d.backend != "all_to_all" or d.ep_size < 2 or d.mode == "exact" or d.hierarchical):
        raise ValueError(f"dispatch.shared_overlap=true: the shared experts hide the all_to_all capacity mode's "
                         f"exchanges under EP; got dispatch={d.backend}, dispatch.ep_size={d.ep_size}, "
                         f"dispatch.mode={d.mode}, dispatch.hierarchical={d.hierarchical}: set dispatch=all_to_all "
                         f"with ep_size >= 2, mode auto or capacity, not hierarchical, or dispatch.shared_overlap=false")
    if d.overlap == "auto" and t.deterministic:
        raise ValueError("dispatch.overlap=auto: picks the schedule by timing, which train.deterministic=true cannot "
                         "repeat; set dispatch.overlap=false or true")
    _one_of("train.device", t.device, DEVICES)
    _one_of("train.nan_policy", t.nan_policy, NAN_POLICIES)
    _one_of("logger.mode", lg.mode, WANDB_MODES)
    _one_of("optim.moment_dtype", o.moment_dtype, MOMENT_DTYPES)
    _one_of("model.score_func", m.score_func, SCORE_FUNCS)
    for name in r.bf16_linears:
        _one_of("recipe.bf16_linears entry", name, DENSE_LINEARS)
    for name in t.recompute:
        _one_of("train.recompute entry", name, RECOMPUTE)
    if not (isinstance(d.rows_factor, (int, float)) and 0 <= d.rows_factor < 1e6):  # inf / nan fail too
        raise ValueError(f"dispatch.rows_factor={d.rows_factor!r}: expected 0 (off) or a factor > 0 of the balanced "
                         f"load, e.g. 1.5")
    if not (isinstance(d.send_factor, (int, float)) and (d.send_factor == 0 or 1 <= d.send_factor < 1e6)):
        raise ValueError(f"dispatch.send_factor={d.send_factor!r}: expected 0 (off) or a factor >= 1 of a rank's "
                         f"average tokens per destination, e.g. 1.2")
    if d.send_factor and not d.rows_factor:
        raise ValueError(f"dispatch.send_factor={d.send_factor:g}: its overflows are caught and run again as "
                         f"dispatch.rows_factor's; set dispatch.rows_factor too (e.g. 1.25)")
    if d.rows_factor and 0 < d.rows_factor < 1:
        raise ValueError(f"dispatch.rows_factor={d.rows_factor!r}: below 1 every step would overflow and run twice; "
                         f"use >= 1 (1.5: room for 50% over the balanced load) or 0 (off)")
    if t.cuda_graphs_mlp and not t.cuda_graphs:
        raise ValueError("train.cuda_graphs_mlp=true: captures the blocks' MLPs beside their attention; set "
                         "train.cuda_graphs=true too, or train.cuda_graphs_mlp=false")
    if "attention" in t.recompute and d.overlap:
        raise ValueError(f"train.recompute={list(t.recompute)}: attention not with dispatch.overlap=true (the "
                         f"overlapped blocks schedule their attention themselves); take attention out of "
                         f"train.recompute or set dispatch.overlap=false")
    for key in ("hidden", "n_layers", "n_heads", "head_dim", "moe_inter", "n_experts", "topk", "vocab_size"):
        _positive(f"model.{key}", getattr(m, key))
    for key in ("steps", "micro_batch", "grad_accum", "seq_len", "log_every"):
        _positive(f"train.{key}", getattr(t, key))
    for name, sec in (("model", m), ("optim", o), ("train", t)):  # inf/nan pass range checks (nan <= 0 is False)
        for f in fields(sec):
            v = getattr(sec, f.name)
            if isinstance(v, float) and not math.isfinite(v):
                raise ValueError(f"{name}.{f.name}={v}: must be finite")
    _positive("optim.lr", o.lr)
    _positive("train.dist_timeout_s", t.dist_timeout_s)
    _positive("train.grad_bucket_mb", t.grad_bucket_mb)
    if not isinstance(t.grad_reduce_ctas, int) or not 0 <= t.grad_reduce_ctas <= 64:
        raise ValueError(f"train.grad_reduce_ctas={t.grad_reduce_ctas!r}: expected 0 (NCCL's choice) to 64 CTAs "
                         f"per gradient all-reduce")
    if t.loss_chunk < 0:
        raise ValueError(f"train.loss_chunk={t.loss_chunk}: must be >= 0 (0: off)")
    if t.time_limit_s < 0:
        raise ValueError(f"train.time_limit_s={t.time_limit_s}: must be >= 0 (0: no limit)")
    if t.fp8_stats_every < 0:
        raise ValueError(f"train.fp8_stats_every={t.fp8_stats_every}: must be >= 0 (0: off)")
    _positive("dispatch.ep_size", d.ep_size)
    _one_of("dispatch.mode", d.mode, DISPATCH_MODES)
    _one_of("dispatch.transport", d.transport, DISPATCH_TRANSPORTS)
    if d.transport == "copy_engine" and (d.backend != "all_to_all" or d.mode == "exact"):
        raise ValueError(f"dispatch.transport=copy_engine moves the all_to_all backend's capacity-mode blocks only; "
                         f"got dispatch={d.backend}, dispatch.mode={d.mode}: use dispatch=all_to_all with "
                         f"dispatch.mode=capacity or auto, or dispatch.transport=collective")
    if d.slots < 2:
        raise ValueError(f"dispatch.slots={d.slots}: must be >= 2 (the copy_engine transport's send slots)")
    if not isinstance(d.nccl_ctas, int) or not 0 <= d.nccl_ctas <= 64:
        raise ValueError(f"dispatch.nccl_ctas={d.nccl_ctas!r}: expected 0 (NCCL's choice) to 64 CTAs per collective")
    if d.nccl_ctas and d.backend != "all_to_all":
        raise ValueError(f"dispatch.nccl_ctas={d.nccl_ctas}: caps the all_to_all backend's NCCL exchanges; got "
                         f"dispatch={d.backend} (deepep: its own SM count); set dispatch.nccl_ctas=0")
    if not isinstance(d.gemm_sm_reserve, int) or d.gemm_sm_reserve < 0:
        raise ValueError(f"dispatch.gemm_sm_reserve={d.gemm_sm_reserve!r}: expected an integer >= 0 (0: all SMs)")
    if d.gemm_sm_reserve and d.overlap is False:
        raise ValueError(f"dispatch.gemm_sm_reserve={d.gemm_sm_reserve}: SMs left free while an overlapped layer runs; "
                         f"set dispatch.overlap=true or auto, or dispatch.gemm_sm_reserve=0")
    for key, off in (("capacity", "train.micro_batch * train.seq_len"), ("max_nodes", "off"),
                     ("ranks_per_node", "torchrun's LOCAL_WORLD_SIZE")):
        if getattr(d, key) < 0:
            raise ValueError(f"dispatch.{key}={getattr(d, key)}: must be >= 0 (0: {off})")
    if d.hierarchical and (d.backend != "all_to_all" or d.mode == "capacity" or d.transport != "collective"
                           or d.overlap):
        raise ValueError(f"dispatch.hierarchical=true: a mode of the all_to_all backend's exact exchange over "
                         f"torch.distributed, without dispatch.overlap; got dispatch={d.backend}, dispatch.mode={d.mode}, "
                         f"dispatch.transport={d.transport}, dispatch.overlap={d.overlap}")
    if d.max_nodes and d.backend == "local":
        raise ValueError(f"dispatch.max_nodes={d.max_nodes}: node-limited routing needs expert parallelism across "
                         f"nodes (dispatch=all_to_all or deepep with dispatch.ep_size spanning nodes)")
    if d.max_nodes and m.n_groups > 1:
        raise ValueError(f"dispatch.max_nodes={d.max_nodes}: node-limited routing makes the router's groups the EP "
                         f"group's nodes; leave model.n_groups=1 (got {m.n_groups}) or set dispatch.max_nodes=0")
    try:
        kind, n = parse_spec(data.tokenizer)
    except TokenizerError as e:
        raise ValueError(str(e)) from None
    need = {"bytes": BYTE_VOCAB, "bpe": n}.get(kind)  # a tokenizer file's: checked when the data is read
    if need and m.vocab_size < need:
        raise ValueError(f"model.vocab_size={m.vocab_size}: data.tokenizer={data.tokenizer} needs at least {need}; "
                         f"set model.vocab_size={need}")
    if m.head_dim % 2:
        raise ValueError(f"model.head_dim={m.head_dim}: RoPE needs an even head dimension")
    if not 0 <= m.n_dense_layers <= m.n_layers:
        raise ValueError(f"model.n_dense_layers={m.n_dense_layers}: must be between 0 and model.n_layers={m.n_layers}")
    if m.n_dense_layers and m.dense_inter <= 0:
        raise ValueError(f"model.dense_inter={m.dense_inter}: must be > 0 with dense layers")
    if m.n_shared < 0:
        raise ValueError(f"model.n_shared={m.n_shared}: must be >= 0")
    if m.topk > m.n_experts:
        raise ValueError(f"model.topk={m.topk}: more than model.n_experts={m.n_experts}")
    if m.n_groups < 1 or m.n_experts % m.n_groups:
        raise ValueError(f"model.n_groups={m.n_groups}: must divide model.n_experts={m.n_experts}")
    if not 1 <= m.topk_groups <= m.n_groups:
        raise ValueError(f"model.topk_groups={m.topk_groups}: must be between 1 and model.n_groups={m.n_groups}")
    if m.topk > m.topk_groups * (m.n_experts // m.n_groups):
        raise ValueError(f"model.topk={m.topk}: cannot pick that many experts from model.topk_groups="
                         f"{m.topk_groups} groups of {m.n_experts // m.n_groups}")
    if r.recipe == "fp8":  # 1x128 activation tiles and 128x128 weight blocks on every FP8 linear's K and N
        sizes = {"model.hidden": m.hidden, "model.moe_inter": m.moe_inter,
                 "model.n_heads*model.head_dim": m.n_heads * m.head_dim}
        if m.n_dense_layers:
            sizes["model.dense_inter"] = m.dense_inter
        for key, v in sizes.items():
            if v % TILE:
                raise ValueError(f"{key}={v}: not a multiple of {TILE}, which recipe=fp8 needs (1x{TILE} and "
                                 f"{TILE}x{TILE} tiles); pick another size or recipe=bf16")
    if m.n_experts % d.ep_size:
        raise ValueError(f"dispatch.ep_size={d.ep_size}: does not divide model.n_experts={m.n_experts}")
    if d.backend == "local" and d.ep_size != 1:
        raise ValueError(f"dispatch.ep_size={d.ep_size}: dispatch=local is EP=1; use dispatch=all_to_all")
    if not 0 <= o.min_lr_ratio <= 1:
        raise ValueError(f"optim.min_lr_ratio={o.min_lr_ratio}: must be in [0, 1]")
    if o.warmup_steps < 0:
        raise ValueError(f"optim.warmup_steps={o.warmup_steps}: must be >= 0 (it is clamped to train.steps)")
    if o.grad_clip < 0 or o.weight_decay < 0:
        raise ValueError(f"optim.grad_clip={o.grad_clip}, optim.weight_decay={o.weight_decay}: must be >= 0")
    for key, v, lo, hi in (("model.norm_eps", m.norm_eps, 0, None), ("model.rope_theta", m.rope_theta, 1, None),
                           ("model.init_std", m.init_std, 0, None), ("model.embed_init_std", m.embed_init_std, 0, None),
                           ("model.route_scale", m.route_scale, 0, None),
                           ("model.bias_update_rate", m.bias_update_rate, 0, None),
                           ("model.seq_aux_alpha", m.seq_aux_alpha, 0, None), ("optim.beta1", o.beta1, 0, 1),
                           ("optim.beta2", o.beta2, 0, 1), ("optim.eps", o.eps, 0, None),
                           ("train.peak_tflops", t.peak_tflops, 0, None)):
        if v < lo or (hi is not None and v >= hi):  # a NaN loss at the first step otherwise (found by fuzzing)
            raise ValueError(f"{key}={v}: must be " + (f">= {lo}" if hi is None else f"in [{lo}, {hi})"))
    if t.ckpt_every < 0:
        raise ValueError(f"train.ckpt_every={t.ckpt_every}: must be >= 0 (0: only at the end)")
    if t.keep_last < 0:
        raise ValueError(f"train.keep_last={t.keep_last}: must be >= 0 (0: keep every checkpoint)")
    if t.max_skipped_steps < 1:
        raise ValueError(f"train.max_skipped_steps={t.max_skipped_steps}: must be >= 1")
    if t.eval_every < 0 or data.val_windows < 0:
        raise ValueError(f"train.eval_every={t.eval_every}, data.val_windows={data.val_windows}: must be >= 0")
    if t.eval_every and not data.val_windows:
        raise ValueError(f"train.eval_every={t.eval_every}: the held-out loss needs held-out data; set "
                         f"data.val_windows (e.g. 256) or train.eval_every=0")
    if not t.out_dir:
        raise ValueError("train.out_dir='': the run needs a directory")
    if not data.path:
        raise ValueError("data.path='': the prepared data needs a folder; e.g. data.path=outputs/data/mine")
    if not os.path.exists(os.path.join(data.path, "index.json")):
        src = data.prepare_from
        if not src:
            raise ValueError(f"data.path={data.path!r}: no index.json there and data.prepare_from is empty; "
                             f"run `python -m moefp8.data prepare --src DIR --out {data.path}`")
        for root in [r.strip() for r in src.split(",") if r.strip()]:
            if not source_dir(root).is_dir():
                raise ValueError(f"data.prepare_from={src!r}: {root!r} is not a directory "
                                 f"(nor 'stdlib' or 'site-packages')")
        _positive("data.max_bytes", data.max_bytes)
