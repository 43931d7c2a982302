"""What a checkpoint holds and how a start finds and restores it: the model and optimizer state
with the routed experts keyed by global index (resumable under another EP size), the data
position, the RNG states and the step (`train_state`), which checkpoint train.resume names
(`find_resume`), saving it (`save`) and loading it back in place (`restore`).
"""

from pathlib import Path

import torch

from moefp8 import checkpoint
from moefp8.data import DataError, Loader
from moefp8.model import Transformer
from moefp8.optim import AdamW


def expert_keys(sd: dict, names: list[str], offset: int) -> dict:
    """A state dict with each routed expert tensor [E_l, ...] replaced by one entry per expert,
    keyed by its global index (`layers.1.mlp.w1.expert5`, views sharing the storage): DCP then
    saves each expert once from the rank that holds it, and loads it into whichever rank holds it
    under any EP size."""
    out = dict(sd)
    for n in names:
        t = out.pop(n)
        out.update({f"{n}.expert{offset + e}": t[e] for e in range(t.shape[0])})
    return out

def model_state(model: Transformer, opt: AdamW) -> dict:
    """The checkpointed model and optimizer state: {"model": ..., "optim": {"step", "exp_avg",
    "exp_avg_sq"}} with the routed experts keyed per global expert (`expert_keys`)."""
    names, off = model.routed_expert_names(), model.expert_offset
    optim = opt.state_dict()
    return {"model": expert_keys(model.state_dict(), names, off),
            "optim": {**optim, "exp_avg": expert_keys(optim["exp_avg"], names, off),
                      "exp_avg_sq": expert_keys(optim["exp_avg_sq"], names, off)}}


def train_state(model: Transformer, opt: AdamW, loader: Loader, device: torch.device, step: int) -> dict:
    """Everything a resume needs; tensors are loaded into in place."""
    rng = {"cpu": torch.get_rng_state()}  # rank 0's (the ranks share the seed; training draws none)
    if device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(device)
    return {**model_state(model, opt), "data": loader.state_dict(), "rng": rng, "step": step}


def save(cfg, par, step: int, model: Transformer, opt: AdamW, loader: Loader, device: torch.device,
         loss: float, tokens: int) -> Path:
    """Checkpoint `step` of the run in train.out_dir (every rank calls it; rank 0 writes the
    metadata: the loss, the tokens seen, the world and EP sizes); returns its path."""
    return checkpoint.save(cfg.train.out_dir, step, train_state(model, opt, loader, device, step),
                           {"loss": loss, "tokens": tokens, "world": par.world, "ep_size": par.ep_size},
                           is_writer=par.rank == 0, keep_last=cfg.train.keep_last)


def find_resume(resume: str, run_dir: Path, say) -> Path | None:
    """The checkpoint this start continues from (train.resume): "auto" the one `latest` names
    (verified; a damaged one stops the run, named), "last_good" the newest one that verifies (each
    newer one passed over is said, with why), "none" nothing, else that step dir. Every rank calls
    this (the verification is shared among them) and gets the same answer or error."""
    if resume == "none":
        return None
    if resume == "auto":
        return checkpoint.find_latest(run_dir, verified=False)  # load() verifies it
    if resume == "last_good":
        path, passed = checkpoint.find_last_good(run_dir)
        for why in passed:
            say(f"[yellow]resume: passed over {why}")
        return path
    return Path(resume)


def restore(ckpt: Path, model: Transformer, opt: AdamW, loader: Loader, device: torch.device) -> int:
    """Loads checkpoint `ckpt` (verified) into the model, the optimizer, the loader and the RNGs in
    place; returns its step. Every rank calls it (a collective under torch.distributed)."""
    st = train_state(model, opt, loader, device, 0)
    # checkpoints of older versions: no val_windows / data_id; the dense layers' MLP as two linears
    dense = [f"layers.{i}.mlp.{w}" for i, b in enumerate(model.layers) if not b.is_moe for w in ("w1", "w2")]
    aliases = {(*sec, n): f"{n}.weight" for n in dense for sec in (("model",), ("optim", "exp_avg"), ("optim", "exp_avg_sq"))}
    checkpoint.load(ckpt, st, optional=("data.val_windows", "data.data_id"), aliases=aliases)
    opt.step_count = st["optim"]["step"]
    try:
        loader.load_state_dict(st["data"])
    except ValueError as e:
        raise DataError(f"checkpoint {ckpt}: {e}") from None
    torch.set_rng_state(st["rng"]["cpu"])
    if "cuda" in st["rng"]:
        torch.cuda.set_rng_state(st["rng"]["cuda"], device)
    return st["step"]
