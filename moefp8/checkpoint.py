"""Checkpoints with torch.distributed.checkpoint (DCP), written atomically.

Layout inside the run dir:

    step_0000100/            one complete checkpoint
        .metadata            DCP's index (written last by DCP)
        __0_0.distcp         tensor data (one file per rank)
        meta.json            {"step": 100, "format": "moefp8-ckpt-v1", ...} for humans and checks
    step_0000200.tmp/        a save in progress (or killed): never loaded
    latest                   the name of the newest complete checkpoint ("step_0000200")

`save` writes into `step_N.tmp/`, renames it to `step_N/` with os.replace, then rewrites `latest`
through a temporary file and os.replace: a kill at any point leaves the previous checkpoint and
pointer intact. `load` refuses a `.tmp` directory or one without DCP's `.metadata` or our
meta.json, naming the path. The state is a nested dict of tensors and plain values (model and
optimizer state dicts, data position, RNG states, step): DCP loads tensors in place and replaces
the plain values in the dict it is given. DCP needs no process group for one process; under
torchrun every rank calls `save` (a collective) and rank 0 renames (`is_writer`).
"""

import json
import os
import re
import shutil
import warnings
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

FORMAT = "moefp8-ckpt-v1"
STEP_RE = re.compile(r"^step_(\d+)$")
_NO_PG_WARNING = "torch.distributed is disabled, unavailable or uninitialized"  # one process is what we mean


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded (partial, corrupt or missing) or written (e.g. a full disk);
    the message names it."""


def step_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / f"step_{step:07d}"


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save(run_dir: str | Path, step: int, state: dict, meta: dict | None = None, is_writer: bool = True) -> Path:
    """Writes `state` as checkpoint `step` of run_dir and points `latest` at it. Returns its path."""
    final = step_dir(run_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    multi = dist.is_available() and dist.is_initialized()
    if is_writer:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    if multi:
        dist.barrier()  # the directory exists before any rank writes into it
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_NO_PG_WARNING)
            dcp.save(state, checkpoint_id=str(tmp))
        if is_writer:
            _write_atomic(tmp / "meta.json", json.dumps({"format": FORMAT, "step": step, **(meta or {})}, indent=1))
            if final.exists():  # the same step saved again (e.g. the end of a run that resumed at its end)
                shutil.rmtree(final)
            os.replace(tmp, final)
            _write_atomic(Path(run_dir) / "latest", final.name + "\n")
    except (OSError, CheckpointException) as e:  # e.g. the disk is full; DCP wraps a rank's error
        if is_writer:
            shutil.rmtree(tmp, ignore_errors=True)  # the partial save: never loaded, and frees the space
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        kept = find_latest(run_dir)
        raise CheckpointError(f"checkpoint {final}: could not be written ({why}); the last complete checkpoint "
                              f"({kept or 'none'}) is kept and `train.resume=auto` continues from it") from e
    if multi:
        dist.barrier()  # no rank goes on (or loads) before the rename
    return final


def check_complete(path: str | Path) -> dict:
    """Returns the checkpoint's meta.json, or raises CheckpointError naming the path and what is wrong."""
    p = Path(path)
    if p.name.endswith(".tmp"):
        raise CheckpointError(f"checkpoint {p}: a partial save (.tmp directory), not a complete checkpoint")
    if not p.is_dir():
        raise CheckpointError(f"checkpoint {p}: no such directory")
    if not (p / ".metadata").is_file():
        raise CheckpointError(f"checkpoint {p}: DCP's .metadata is missing (partial or corrupt checkpoint)")
    try:
        meta = json.loads((p / "meta.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {p}: meta.json is missing or unreadable ({e})") from e
    if meta.get("format") != FORMAT or not isinstance(meta.get("step"), int):
        raise CheckpointError(f"checkpoint {p}: meta.json is not a {FORMAT} record: {meta}")
    return meta


def find_latest(run_dir: str | Path) -> Path | None:
    """The checkpoint `latest` names (refused, naming it, if it is not complete); without a
    `latest` file the highest-numbered complete step_N/ (a kill between the rename and the pointer
    update); None when the run dir holds no checkpoint."""
    run = Path(run_dir)
    pointer = run / "latest"
    if pointer.is_file():
        p = run / pointer.read_text().strip()
        check_complete(p)
        return p
    steps = sorted((int(m.group(1)), d) for d in run.glob("step_*") if (m := STEP_RE.match(d.name)))
    for _, d in reversed(steps):
        try:
            check_complete(d)
            return d
        except CheckpointError:
            continue
    return None


def load(path: str | Path, state: dict, optional: tuple[str, ...] = ()) -> dict:
    """Loads checkpoint `path` into `state` (tensors in place, plain values replaced); returns
    its meta.json. `optional`: dotted keys of `state` (e.g. "data.val_windows") that checkpoints
    written before they existed lack; those are dropped from `state` when the checkpoint has none."""
    meta = check_complete(path)
    if optional:
        have = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
        for key in optional:
            if key not in have:
                *parents, leaf = key.split(".")
                d = state
                for k in parents:
                    d = d[k]
                d.pop(leaf, None)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_NO_PG_WARNING)
        try:
            dcp.load(state, checkpoint_id=str(path))
        except (ValueError, RuntimeError, CheckpointException) as e:  # another model shape (DCP wraps its
            msg = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__  # size / key errors)
            raise CheckpointError(f"checkpoint {path} does not fit this model (was it written for another "
                                  f"model config?): {msg}") from None
    return meta
