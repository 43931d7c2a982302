"""What a training process builds from its config, in the order the run needs it: the data
(`open_data`), the model on its expert-parallel dispatcher (`build_model`), the data-parallel
gradient buckets (`grad_buckets`), for dispatch.overlap=auto the schedule chooser (`overlap_auto`),
and with train.cuda_graphs the captured attention (`cuda_graphs`, once the weights are restored). The
training loop (`moefp8.train`) and the whole-step profiler (`tools/profile_step.py`) build through
these, so that what is profiled is what trains.
"""

from dataclasses import replace

import torch

from moefp8.accum import arm
from moefp8.config import Config
from moefp8.data import DataError, Loader, ensure, folder_data_id
from moefp8.dispatch import build_dispatcher
from moefp8.grad_sync import GradBuckets
from moefp8.graphs import graph_attention
from moefp8.launch import dispatch_capacity, routing_config
from moefp8.model import Transformer
from moefp8.optim import AdamW
from moefp8.kernels.grouped_gemm import GemmPolicy, choose_mgrouped_lib
from moefp8.overlap import OverlapPolicy, halves
from moefp8.overlap_auto import OverlapAuto
from moefp8.parallel import Parallel, same_file
from moefp8.recipe import Recipe


def open_data(cfg: Config, par: Parallel, say=print) -> Loader:
    """data.path prepared (rank 0, from data.prepare_from with data.tokenizer, if it has no index)
    and verified (data.verify), checked to be the same data on every node, and this rank's
    loader over it. UserError (one line) for what the user can fix."""
    t, d = cfg.train, cfg.data
    par.on_main(lambda: ensure(d.path, d.prepare_from, d.glob, d.max_bytes, say, tokenizer=d.tokenizer,
                               check=d.verify), slow=True)  # preparing (and verifying) a corpus takes minutes
    same_file(d.path, f"data.path={d.path}", "prepare it on every node (the same command and sources give the "
              "same shards) or put it on a filesystem every node mounts", par.rank, par.world, folder_data_id)
    try:
        return Loader(d.path, t.micro_batch, t.seq_len, par.rank, par.world, t.seed, d.val_windows,
                      vocab_size=cfg.model.vocab_size)
    except OSError as e:  # an unreadable shard
        raise DataError(f"data.path={d.path}: {e}") from None


def gemm_policy(cfg: Config, device: torch.device, ep_size: int = 1, say=print, par: Parallel | None = None) -> GemmPolicy:
    """The GEMMs' policy: recipe.gemm's library, or for `auto` the one `choose_mgrouped_lib` finds
    on this device for the model's experts (fc1 [2I, H] and fc2 [H, I], each local expert with its
    balanced share of the routed rows); the choice said in one line (none for a recipe without FP8
    GEMMs: auto is the default). Under torchrun (par, world > 1) the ranks agree: DeepGEMM only where
    every rank chose it (a node without it, or one whose trial read it slower, keeps the job on moefp8's
    kernels; the outputs are the same bits either way, so this is for one library a job, said once)."""
    lib = cfg.recipe.gemm
    if lib == "auto" and cfg.recipe.recipe != "fp8":
        lib = "moefp8"
    if lib == "auto":
        m, t = cfg.model, cfg.train
        rows = t.micro_batch * t.seq_len * ep_size * m.topk // m.n_experts
        lib, why = choose_mgrouped_lib(m.n_experts // ep_size, max(rows, 1), [(2 * m.moe_inter, m.hidden),
                                                                            (m.hidden, m.moe_inter)], device)
        if "why" in why:
            reason = why["why"]
        else:
            ms = why["ms"]
            reason = (f"the experts' m-grouped GEMMs, fprop + dgrad: moefp8 {ms['moefp8']:.2f} ms, DeepGEMM "
                      f"{ms['deepgemm']:.2f} ms, outputs {'bit-identical' if why['identical'] else 'DIFFERENT'}")
        if par is not None and par.world > 1:
            chose = torch.tensor([float(lib == "deepgemm")], device=par.device)
            torch.distributed.all_reduce(chose)  # every rank runs this branch: the same config
            n = int(chose.item())
            if 0 < n < par.world:
                lib = "moefp8"
                reason += f"; DeepGEMM chosen on {n} of {par.world} ranks only: moefp8 on every rank"
            elif n == par.world:
                reason += f"; on all {par.world} ranks"
        say(f"recipe.gemm=auto: {lib} ({reason})")
    return GemmPolicy(mgrouped_lib=lib)


def build_model(cfg: Config, par: Parallel | None, device: torch.device, say=print) -> Transformer:
    """The model on `device`, its MoE layers on the config's dispatcher (par None: one process,
    the `local` backend at EP=1, whatever the config's dispatch says). say: where recipe.gemm=auto
    tells its choice."""
    m, d, t = cfg.model, cfg.dispatch, cfg.train
    if par is None or par.world == 1:
        dispatcher, ep_rank, model_cfg = build_dispatcher("local", m.n_experts, scale_fmt=cfg.recipe.scale_fmt), 0, m
    else:
        dispatcher = build_dispatcher(d.backend, m.n_experts, par.ep_group, cfg.recipe.scale_fmt,
                                      capacity=dispatch_capacity(cfg), mode=d.mode, transport=d.transport,
                                      slots=d.slots, ranks_per_node=par.ranks_per_node if par.spans_nodes else None,
                                      node_groups=par.node_groups)
        ep_rank, model_cfg = par.ep_rank, routing_config(cfg, par.world)
    model = Transformer.build(model_cfg, Recipe.from_config(cfg.recipe), dispatcher, ep_rank, device=device, seed=t.seed,
                             overlap=overlap_policy(cfg) if d.overlap is True else None,
                             gemm=gemm_policy(cfg, device, par.ep_size if par else 1, say, par),
                             recompute=tuple(t.recompute), loss_chunk=t.loss_chunk,
                             rows_factor=d.rows_factor if par is not None and par.ep_size > 1 else 0.0,
                             send_factor=d.send_factor if par is not None and par.ep_size > 1 else 0.0,
                             shared_overlap=d.shared_overlap and par is not None and par.ep_size > 1)
    # micro-batches summed inside the expert GEMMs where no other rank sums their gradients (moefp8.accum)
    if t.grad_accum_fusion and (n := arm(model, t.grad_accum, experts_alone=par is None or par.world == 1
                                             or par.ep_size == par.world)):
        say(f"train.grad_accum={t.grad_accum}: {n} routed expert weights sum their micro-batches' gradients inside "
            f"their wgrad GEMMs (moefp8.accum)")
    return model


def overlap_policy(cfg: Config) -> OverlapPolicy:
    """The two micro-batch schedule's policy (dispatch.overlap true, or auto's trials): its SM reserve."""
    return OverlapPolicy(gemm_sm_reserve=cfg.dispatch.gemm_sm_reserve)


def _sharded(par: Parallel | None, model: Transformer) -> set:
    return set(model.routed_expert_names()) if par is not None and par.ep_size > 1 else set()


def norm_split(par: Parallel | None, model: Transformer, opt: AdamW) -> tuple[list, list]:
    """(replicated, sharded) parameters as `optim.grad_norm` takes them: the routed experts are
    sharded over the EP group (with EP > 1), the rest is replicated."""
    sharded = _sharded(par, model)
    return ([p for n, p in opt.params.items() if n not in sharded], [p for n, p in opt.params.items() if n in sharded])


def grad_buckets(cfg: Config, par: Parallel | None, model: Transformer, opt: AdamW) -> GradBuckets | None:
    """The data-parallel gradient buckets (moefp8.grad_sync): replicated parameters summed over all
    ranks (`Parallel.grad_group`), the routed experts over their expert-data-parallel group; None on
    one process."""
    if par is None or par.world == 1:
        return None
    sharded = _sharded(par, model)
    return GradBuckets(opt.params, lambda n: par.expert_dp_group if n in sharded else par.grad_group, par.world,
                       cfg.train.grad_bucket_mb, overlap=not cfg.train.deterministic)


def overlap_auto(cfg: Config, par: Parallel | None, model: Transformer, say=print) -> OverlapAuto | None:
    """dispatch.overlap=auto: the chooser that times both schedules over the first steps
    (moefp8.overlap_auto); None for false / true. At EP=1 there is nothing to overlap: the plain
    schedule, said once."""
    if cfg.dispatch.overlap != "auto":
        return None
    if par is None or par.ep_size == 1:
        say("dispatch.overlap=auto: off (EP=1: no exchanges to overlap)")
        return None
    caps = None  # all_to_all with the capacity sized from the batch: the overlap's halves need half of it
    if cfg.dispatch.backend == "all_to_all" and not cfg.dispatch.capacity:
        caps = {s: dispatch_capacity(replace(cfg, dispatch=replace(cfg.dispatch, overlap=s == "on")))
                for s in OverlapAuto.SCHEDULES}

    def switch(schedule: str) -> None:
        if caps is not None:
            model.dispatcher.capacity = caps[schedule]
    return OverlapAuto(model, overlap_policy(cfg), all_reduce=par.all_reduce_, world=par.world, say=say,
                       on_switch=switch, device=par.device)


def cuda_graphs(cfg: Config, model: Transformer, device: torch.device, say=print) -> int:
    """train.cuda_graphs: every block's attention captured for the config's micro-batch (moefp8.graphs;
    after a checkpoint's restore, before the first step), and where the MoE layers may run the two
    micro-batch overlap (dispatch.overlap true, or auto at EP > 1) the MoE blocks' for its halves;
    with train.cuda_graphs_mlp the blocks whose MLP has static shapes whole; how many blocks replay,
    said in one line."""
    if not cfg.train.cuda_graphs:
        return 0
    if device.type != "cuda":
        say(f"train.cuda_graphs: off (not a CUDA device ({device}))")
        return 0
    B, ov = cfg.train.micro_batch, cfg.dispatch.overlap
    # the two micro-batch overlap splits the MoE blocks' batch: always (true), or in the steps auto runs it (EP > 1)
    split = B > 1 and (ov is True or (ov == "auto" and model.dispatcher.communicates))
    sizes = tuple(p.stop - p.start for p in halves(B)) if split else None
    n = graph_attention(model, B, cfg.train.seq_len, halves=sizes, overlap_only=ov is True,
                        mlp=cfg.train.cuda_graphs_mlp)
    whole = len(model.layers) if model.graphed_stack is not None else sum(b.graphed_whole is not None
                                                                           for b in model.layers)
    # MoE blocks under EP whole only with fixed-size exchanges and capped layouts (moefp8.graphs.whole_capturable)
    ep_eager = (cfg.train.cuda_graphs_mlp and model.dispatcher.communicates
                and any(b.is_moe and b.graphed_whole is None for b in model.layers))
    say(f"train.cuda_graphs: the attention of {n} of {len(model.layers)} blocks replays CUDA graphs"
        + (" (the others recompute it: train.recompute)" if n < len(model.layers) else "")
        + (f"; {whole} of them whole, with their MLP (train.cuda_graphs_mlp)" if cfg.train.cuda_graphs_mlp else "")
        + (", as one graph" if model.graphed_stack is not None else "")
        + ("; the MoE blocks under EP whole only with dispatch.rows_factor > 0, dispatch.overlap=false and the "
           "all_to_all capacity mode over NCCL (dispatch.transport=collective)" if ep_eager else "")
        + (f"; the MoE blocks' for the overlap's halves of {sizes[0]} and {sizes[1]} sequences" if split else ""))
    return n
