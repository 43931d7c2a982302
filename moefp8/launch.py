"""What a training config needs from the machine and the launch, checked before anything runs,
and the values derived from them: the device, one GPU per process, the dispatch's capacity and
node-limited routing for this topology, the GPU's peak for MFU, a multirun job's run dir name,
whether an exception was a lost peer. Every check raises ValueError naming the value and the fix.
"""

import hashlib
import os
from dataclasses import replace

import torch
import torch.distributed as dist

from moefp8.config import Config
from moefp8.dispatch import DEEPEP_INSTALL, node_limited_groups
from moefp8.parallel import check_parallel, ranks_per_node

# Dense BF16 peak of the GPU (SXM), TFLOP/s: MFU is reported against it for both recipes.
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "B200": 2250.0, "A100": 312.0}

def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("train.device='cuda': no CUDA device is available (use train.device=auto or cpu)")
    return torch.device(name)

def setup_device(t) -> torch.device:
    """This process's device for train config `t` (under torchrun the GPU of its LOCAL_RANK, made
    current), with the deterministic kernels chosen first when train.deterministic."""
    if t.deterministic:  # before the first cuBLAS call; GPU runs (and resumes) then repeat bit for bit
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)  # an op without a deterministic kernel warns, naming it
        # attention: the memory-efficient kernels. Flash attention's backward is not deterministic (and does not
        # warn): two passes over one batch gave other wqkv gradients in every layer (small model, H100, torch
        # 2.11), while the memory-efficient, cuDNN and math backends repeated; cuDNN's warns that it may not.
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_cudnn_sdp(False)
    device = resolve_device(t.device)
    if device.type == "cuda" and "LOCAL_RANK" in os.environ:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    return device

def check_gpus(device: torch.device, local_rank: int, visible: int, nproc: int) -> None:
    """More processes on this node than GPUs it can see (torchrun's LOCAL_RANK / LOCAL_WORLD_SIZE
    against torch.cuda.device_count()): ValueError before any CUDA or NCCL call."""
    if device.type == "cuda" and max(local_rank + 1, nproc) > visible:
        cvd = os.environ.get("CUDA_VISIBLE_DEVICES", "unset")
        raise ValueError(f"train.device=cuda: {max(local_rank + 1, nproc)} processes on this node but only "
                         f"{visible} GPU(s) visible (CUDA_VISIBLE_DEVICES={cvd}); launch at most {visible} per "
                         f"node (torchrun --nproc_per_node {visible})")

def check_launch(cfg: Config, env=os.environ) -> None:
    """What the config needs from this machine and launch: the device, one GPU per process, DeepEP,
    DeepGEMM and megablocks installed if asked for, the process count, a dispatch capacity that holds
    a micro-batch, GPUs for the copy-engine transport, a wandb key for logger.mode=online
    (ValueError naming the value)."""
    device = resolve_device(cfg.train.device)
    if device.type == "cuda":
        check_gpus(device, int(env.get("LOCAL_RANK", "0")), torch.cuda.device_count(),
                   int(env.get("LOCAL_WORLD_SIZE", "1")))
    d = cfg.dispatch
    if d.backend == "deepep":
        per_node = d.ranks_per_node or int(env.get("LOCAL_WORLD_SIZE", str(d.ep_size)))
        if d.ep_size > per_node or per_node % d.ep_size:
            raise ValueError(f"dispatch=deepep with dispatch.ep_size={d.ep_size}: the EP groups span nodes ({per_node} "
                             f"ranks per node), and the deepep backend is intranode only (DeepEP's internode mode "
                             f"needs RDMA NICs and NVSHMEM, untested here); use dispatch=all_to_all for expert "
                             f"parallelism across nodes, or a dispatch.ep_size that divides {per_node}")
        try:
            import deep_ep  # noqa: F401
        except ImportError as e:
            raise ValueError(f"dispatch=deepep: `import deep_ep` failed ({e}). {DEEPEP_INSTALL}") from None
    if cfg.recipe.gemm == "deepgemm":
        from moefp8.kernels import deepgemm

        if device.type != "cuda" or cfg.recipe.recipe != "fp8":
            raise ValueError(f"recipe.gemm=deepgemm: DeepGEMM's FP8 GEMMs run on CUDA GPUs in the fp8 recipe (this run: "
                             f"{device.type}, recipe={cfg.recipe.recipe}); use recipe.gemm=moefp8")
        if deepgemm.load() is None:
            raise ValueError(f"recipe.gemm=deepgemm: `import deep_gemm` failed. {deepgemm.INSTALL}; or use "
                             f"recipe.gemm=moefp8")
    if cfg.recipe.moe_impl == "megablocks":
        from moefp8 import megablocks_experts

        if device.type != "cuda":
            raise ValueError(f"recipe.moe_impl=megablocks: megablocks' kernels run on CUDA GPUs (this run: "
                             f"{device.type}); use recipe.moe_impl=moefp8")
        if megablocks_experts.load() is None:
            raise ValueError(f"recipe.moe_impl=megablocks: `import megablocks` failed. {megablocks_experts.INSTALL}; "
                             f"or use recipe.moe_impl=moefp8")
    if d.transport == "copy_engine" and device.type != "cuda":
        raise ValueError(f"dispatch.transport=copy_engine: copies between GPUs, but this run is on the {device.type} "
                         f"(train.device={cfg.train.device}); use dispatch.transport=collective")
    need = dispatch_capacity(replace(cfg, dispatch=replace(d, capacity=0)))
    if d.capacity and d.capacity < need and d.backend != "local":
        t = cfg.train
        raise ValueError(f"dispatch.capacity={d.capacity}: smaller than the {need} tokens a rank passes to one dispatch "
                         f"(train.micro_batch x train.seq_len = {t.micro_batch} x {t.seq_len}"
                         f"{', halved by dispatch.overlap' if d.overlap is True else ''}); set dispatch.capacity >= "
                         f"{need}, or 0 to size it from the batch")
    if cfg.logger.mode == "online" and not wandb_key(env):
        raise ValueError("logger.mode=online: no wandb API key found (WANDB_API_KEY, or `wandb login`); log in, or "
                         "use logger.mode=offline and upload later with `wandb sync <run dir>/wandb/offline-run-*`")
    check_parallel(cfg, int(env.get("WORLD_SIZE", "1")))
    rpn = ranks_per_node(cfg, int(env.get("WORLD_SIZE", "1")), env)
    if d.hierarchical and (d.ep_size <= rpn or d.ep_size % rpn):
        raise ValueError(f"dispatch.hierarchical=true: the EP group of dispatch.ep_size={d.ep_size} ranks must span "
                         f"several whole nodes of {rpn} ranks (torchrun --nnodes, or dispatch.ranks_per_node); within "
                         f"one node use dispatch.hierarchical=false")
    routing_config(cfg, int(env.get("WORLD_SIZE", "1")), env)  # node-limited routing fits the topology

def wandb_key(env=os.environ) -> bool:
    """Whether wandb will find an API key: WANDB_API_KEY, or the netrc entry `wandb login` writes
    for its host (WANDB_BASE_URL's, api.wandb.ai by default). Read without network or wandb."""
    if env.get("WANDB_API_KEY"):
        return True
    import netrc
    from urllib.parse import urlparse

    host = urlparse(env.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return netrc.netrc(env.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False

def peak_flops(cfg: Config, device: torch.device) -> float | None:
    if cfg.train.peak_tflops > 0:
        return cfg.train.peak_tflops * 1e12
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, tf in PEAK_BF16_TFLOPS.items():
            if key in name:
                return tf * 1e12
    return None  # CPU or an unknown GPU: no MFU

def dispatch_capacity(cfg: Config) -> int:
    """The most tokens a rank passes to one dispatch (the all_to_all capacity mode's blocks):
    dispatch.capacity, else micro_batch x seq_len; under the overlap its larger micro-batch: half
    the sequences (rounded up; moefp8.overlap.OverlappedBlock), or half of a lone sequence
    (dispatch.overlap=auto runs both schedules: the whole micro-batch)."""
    if cfg.dispatch.capacity:
        return cfg.dispatch.capacity
    B, S = cfg.train.micro_batch, cfg.train.seq_len
    if cfg.dispatch.overlap is not True:
        return B * S
    return -(-B // 2) * S if B > 1 else -(-S // 2)

def routing_config(cfg: Config, world: int, env=os.environ):
    """cfg.model with the router's groups set for node-limited routing (dispatch.max_nodes: one
    group per node of the EP group, `dispatch.node_limited_groups`); cfg.model itself when off.
    ValueError naming the value when the topology does not allow it."""
    d = cfg.dispatch
    if not d.max_nodes:
        return cfg.model
    rpn = ranks_per_node(cfg, world, env)
    n_groups, topk_groups = node_limited_groups(d.ep_size, rpn, cfg.model.n_experts, cfg.model.topk, d.max_nodes)
    return replace(cfg.model, n_groups=n_groups, topk_groups=topk_groups)

def job_dir_name(overrides: str) -> str:
    """A multirun job's run dir name under the sweep dir (hydra.sweep.subdir): its overrides
    (`optim.lr=1e-3,model=tiny`) with "/" made "_" so that a path value does not nest folders;
    long ones are cut and given a hash of the whole. The same overrides give the same name, so a
    sweep run again resumes each job in its own dir."""
    name = overrides.replace(os.sep, "_") or "defaults"
    if len(name) > 120:
        name = name[:100] + "-" + hashlib.sha1(overrides.encode()).hexdigest()[:10]
    return name

def comm_failure(e: BaseException) -> bool:
    """A collective that failed because a peer died, hung past train.dist_timeout_s or closed its
    connection (gloo raises a plain RuntimeError naming its transport; NCCL a DistError)."""
    while e is not None:
        if isinstance(e, dist.DistError) or (isinstance(e, RuntimeError) and any(
                s in str(e) for s in ("gloo/transport", "Connection reset by peer", "Connection closed by peer",
                                      "Timed out waiting"))):
            return True
        e = e.__cause__ or e.__context__
    return False
