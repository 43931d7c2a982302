"""Checkpoints with torch.distributed.checkpoint (DCP): written atomically, verified when loaded.

Layout inside the run dir:

    step_0000100/            one complete checkpoint
        .metadata            DCP's index (written last by DCP)
        __0_0.distcp         tensor data: __{rank}_{i}.distcp, one file per rank
        meta.json            {"format": "moefp8-ckpt-v1", "step": 100, ..., "files": {"__0_0.distcp":
                             {"bytes": 4001577, "sha256": "9c2e..."}, ".metadata": {...}}}
        keep                 (optional, made by you) a pin: pruning never deletes this checkpoint
    step_0000200.tmp/        a save in progress (or killed): never loaded, removed by `remove_partial`
    step_0000100.old.tmp/    a re-save of step 100 moved the old one aside (deleted once replaced;
                             put back by `remove_partial` if the re-save was killed before that)
    latest                   the name of the newest complete checkpoint ("step_0000200")

`save` writes into `step_N.tmp/`; each rank hashes (sha256) the data files it wrote itself, rank
0 also `.metadata`, and the writer records them all in meta.json, renames the folder to
`step_N/` with os.replace, then rewrites `latest` through a temporary file and os.replace: a
kill at any point leaves the previous checkpoint and pointer intact. A re-save of an existing
step moves the old folder aside first; a kill between the two renames leaves `latest` naming a
missing folder: `find_latest` then takes the newest complete one, and `remove_partial` (called
at start) puts the old folder back. Pruning (`keep_last`) deletes only the files a checkpoint's
meta.json lists (plus meta.json and .metadata) and then the empty folder: a file you put there
keeps its folder. Checkpoints written before checksums existed (no "files" in meta.json) load
without verification.

`load` refuses a `.tmp` directory or one without DCP's `.metadata` or our meta.json, and one whose
files differ from what meta.json recorded, naming the file. The state is a nested dict of tensors
and plain values (model and optimizer state dicts, data position, RNG states, step): DCP loads
tensors in place and replaces the plain values in the dict it is given. DCP needs no process group
for one process; under torchrun every rank calls `save`, `verify`, `load`, `find_latest` and
`find_last_good` (collectives: the hashing is shared among the ranks, and every rank raises the
same CheckpointError) and rank 0 renames and prunes (`is_writer`).
"""

import errno
import hashlib
import json
import os
import re
import resource
import warnings
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from moefp8.errors import UserError, first_line

FORMAT = "moefp8-ckpt-v1"  # "files" (checksums) was added without a bump: older records simply lack it
STEP_RE = re.compile(r"^step_(\d+)$")
PARTIAL_RE = re.compile(r"^step_\d+(\.old)?\.tmp$")  # a killed save, or a re-save's old folder
DCP_FILE_RE = re.compile(r"^(__\d+_\d+\.distcp|\.metadata)$")  # what DCP leaves in a finished save
OURS_RE = re.compile(r"^(__\d+_\d+\.distcp|(__\d+)?\.metadata(\.tmp)?|meta\.json(\.tmp)?)$")  # and mid-save
FIX = "resume from an earlier checkpoint with train.resume=last_good (or train.resume=<path>)"
_NO_PG_WARNING = "torch.distributed is disabled, unavailable or uninitialized"  # one process is what we mean
_CHUNK = 1 << 22  # 4 MiB reads; sha256 of a fresh 24 MB file (page cache): 0.04 s on the 2-core CI VM
_MISFIT = ("Size mismatch", "Missing key", "Unexpected key")  # DCP's words for a state of another shape


class CheckpointError(UserError):
    """A checkpoint that cannot be loaded (partial, damaged or missing) or written (e.g. a full disk);
    the message names it."""


def step_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / f"step_{step:07d}"


def _group() -> tuple[int, int]:
    """(rank, world) of the default process group; (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _gather(obj, world: int) -> list:
    """Every rank's obj, on every rank (small picklable values)."""
    if world == 1:
        return [obj]
    out = [None] * world
    dist.all_gather_object(out, obj)
    return out


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    """Makes the renames inside `path` durable (a power loss, not a kill, could undo them)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _digest(path: Path) -> dict:
    """{"bytes": n, "sha256": hex} of the file at `path`, read in chunks."""
    h, n, buf = hashlib.sha256(), 0, bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while k := f.readinto(buf):
            h.update(view[:k])
            n += k
    return {"bytes": n, "sha256": h.hexdigest()}


def _why(e: BaseException, folder: Path, rank: int) -> str:
    """One line for why this rank's part of a save failed. DCP wraps each rank's error in a
    CheckpointException (its str: "CheckpointException ranks:dict_keys([0])" and tracebacks), and
    torch.save turns the OSError of a failed write into "[enforce fail at inline_container.cc]
    unexpected pos 704 vs 598" (a RuntimeError whose __context__ is the OSError); the OSError is
    what the user needs. Under torch.distributed DCP pickles the errors between ranks, which drops
    the __context__: then this rank's folder says what the OSError was (no space, or the file size
    limit reached)."""
    if isinstance(e, CheckpointException):
        if rank not in e.failures:
            return ""  # another rank's failure: that rank says why
        e = e.failures[rank][0]
    chain = [e]
    while (x := chain[-1].__cause__ or chain[-1].__context__) is not None and len(chain) < 10:
        chain.append(x)
    os_error = next((x for x in chain if isinstance(x, OSError)), None)
    if os_error is not None:
        return first_line(os_error)
    if isinstance(e, RuntimeError):
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        if limit != resource.RLIM_INFINITY and any(p.stat().st_size >= limit for p in folder.glob(f"__{rank}_*")):
            return f"[Errno {errno.EFBIG}] {os.strerror(errno.EFBIG)} (the file size limit, ulimit -f, is {limit} " \
                   f"bytes)"
        st = os.statvfs(folder)
        if st.f_bavail * st.f_frsize < 1 << 20:
            return f"[Errno {errno.ENOSPC}] {os.strerror(errno.ENOSPC)} ({st.f_bavail * st.f_frsize} bytes free)"
    return f"{type(e).__name__}: {first_line(e)}"


def _by_rank(whys: list[str | None]) -> list[str]:
    """["rank 0: ...", "ranks 1, 2: ..."] from each rank's why (None: no failure, "": failed, said
    by another rank)."""
    by_msg: dict[str, list[int]] = {}
    for rank, why in enumerate(whys):
        if why:
            by_msg.setdefault(why, []).append(rank)
    if not by_msg and any(w is not None for w in whys):
        return ["DCP failed without saying why"]
    return [f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {m}" for m, r in by_msg.items()]


def _newest_complete(run: Path) -> Path | None:
    """The highest-numbered step_N/ that check_complete accepts (nothing is verified)."""
    steps = sorted((int(m.group(1)), d) for d in run.glob("step_*") if (m := STEP_RE.match(d.name)))
    for _, d in reversed(steps):
        try:
            check_complete(d)
            return d
        except CheckpointError:
            continue
    return None


def _pointed(run: Path) -> Path | None:
    """The folder `latest` names if it exists, else the newest complete one; unverified (messages)."""
    try:
        p = run / (run / "latest").read_text().strip()
        if p.is_dir() and p != run:
            return p
    except OSError:
        pass
    return _newest_complete(run)


def _remove_ours(folder: Path, names) -> bool:
    """Deletes `names` (ours) from folder, `.metadata` first (the folder is then never loaded,
    whatever a kill leaves) and meta.json last (a later prune still knows the folder is ours),
    then the folder if nothing else is left in it. True if the folder is gone."""
    order = [".metadata", *sorted(set(names) - {".metadata", "meta.json", "meta.json.tmp"}), "meta.json.tmp",
             "meta.json"]
    for name in order:
        try:
            (folder / name).unlink()
        except FileNotFoundError:
            pass
    try:
        folder.rmdir()
        return True
    except OSError:  # a file of yours (or one we did not list) is left in it: so is the folder
        return False


def _listed(folder: Path, meta: dict) -> list[str]:
    """The files of a checkpoint of ours: those meta.json lists, or for a record from before
    checksums the names only DCP writes."""
    if isinstance(meta.get("files"), dict):
        return [n for n in meta["files"] if isinstance(n, str)]
    return [p.name for p in folder.iterdir() if DCP_FILE_RE.match(p.name)]


def _meta_of(folder: Path) -> dict | None:
    """A folder's meta.json if it is one of ours (our format), else None; nothing else checked."""
    try:
        meta = json.loads((folder / "meta.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return meta if isinstance(meta, dict) and meta.get("format") == FORMAT else None


def _ours_in(folder: Path) -> list[str]:
    return [p.name for p in folder.iterdir() if OURS_RE.match(p.name)]


def save(run_dir: str | Path, step: int, state: dict, meta: dict | None = None, is_writer: bool = True,
         keep_last: int = 0) -> Path:
    """Writes `state` as checkpoint `step` of run_dir, with the size and sha256 of each of its files
    in meta.json, and points `latest` at it; then (keep_last > 0) prunes all but the newest
    keep_last checkpoints (see `prune`). Returns its path. Under torch.distributed every rank
    calls it (collectives) and a failure raises the same CheckpointError on every rank, e.g.
    "checkpoint run/step_0000004: could not be written (rank 0: [Errno 28] No space left on
    device); the last complete checkpoint (run/step_0000002) is kept and `train.resume=auto`
    continues from it"; the partial save is removed and `latest` is unchanged."""
    run = Path(run_dir)
    final = step_dir(run, step)
    tmp = final.with_name(final.name + ".tmp")
    aside = final.with_name(final.name + ".old.tmp")
    rank, world = _group()
    if is_writer:
        tmp.mkdir(parents=True, exist_ok=True)
        _remove_ours(tmp, _ours_in(tmp))  # a killed save's leftovers (a file of yours stays, and goes along)
        tmp.mkdir(exist_ok=True)
    if world > 1:
        dist.barrier()  # the directory exists before any rank writes into it
    files, why = {}, None  # why: None (this rank did its part) or why not ("" if another rank knows)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_NO_PG_WARNING)
            dcp.save(state, checkpoint_id=str(tmp))
        # this rank's own data files (rank 0 also DCP's .metadata): no rank reads the whole checkpoint
        mine = sorted(p.name for p in tmp.glob(f"__{rank}_*.distcp")) + ([".metadata"] if rank == 0 else [])
        files = {name: _digest(tmp / name) for name in mine}
    except (OSError, CheckpointException) as e:  # e.g. the disk is full
        try:
            why = _why(e, tmp, rank)
        except OSError:  # the folder is gone too
            why = f"{type(e).__name__}: {first_line(e)}"
    gathered = _gather((files, why), world)
    whys = _by_rank([w for _, w in gathered])
    if not whys and is_writer:
        files = dict(sorted((k, v) for f, _ in gathered for k, v in f.items()))
        old = None
        try:
            write_atomic(tmp / "meta.json", json.dumps({"format": FORMAT, "step": step, **(meta or {}),
                                                         "files": files}, indent=1))
            _fsync_dir(tmp)
            if final.exists():  # the same step saved again (e.g. the end of a run that resumed at its end)
                old = _meta_of(final) or {}
                if aside.exists():
                    _remove_ours(aside, _ours_in(aside))
                os.replace(final, aside)  # until `latest` is rewritten find_latest falls back to an older one
            os.replace(tmp, final)
            write_atomic(run / "latest", final.name + "\n")
            _fsync_dir(run)
        except OSError as e:
            whys = [f"rank {rank}: {first_line(e)}"]
            if aside.is_dir() and not final.exists():
                os.replace(aside, final)  # the old one back
        else:  # saved: what follows only tidies up (a failure leaves folders remove_partial or prune take)
            try:
                if old is not None:  # files of yours in the old folder move to the new one; ours are deleted
                    for p in aside.iterdir():
                        if not OURS_RE.match(p.name) and not (final / p.name).exists():
                            os.replace(p, final / p.name)
                    _remove_ours(aside, _listed(aside, old))
                prune(run, keep_last)
            except OSError:
                pass
    if world > 1:  # no rank goes on (or loads) before the rename, and all know whether it worked
        whys = [w for ws in _gather(whys if is_writer else [], world) for w in ws] or whys
    if whys:
        if is_writer and tmp.is_dir():  # the partial save: never loaded, and frees the space
            _remove_ours(tmp, _ours_in(tmp))
        raise CheckpointError(f"checkpoint {final}: could not be written ({'; '.join(whys)}); the last complete "
                              f"checkpoint ({_pointed(run) or 'none'}) is kept and `train.resume=auto` continues "
                              f"from it")
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
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or not isinstance(meta.get("step"), int):
        raise CheckpointError(f"checkpoint {p}: meta.json is not a {FORMAT} record: {meta}")
    files = meta.get("files", {})
    if not (isinstance(files, dict) and all(DCP_FILE_RE.match(k) and isinstance(v, dict) and isinstance(
            v.get("bytes"), int) and isinstance(v.get("sha256"), str) for k, v in files.items())):
        raise CheckpointError(f"checkpoint {p}: meta.json's \"files\" is not a list of DCP files with their "
                              f"bytes and sha256 (damaged or edited)")
    return meta


def _bad_files(p: Path, files: dict) -> list[tuple[str, str, str]]:
    """(file, what is wrong, details) for each file differing from its record, sorted; under
    torch.distributed rank r checks sorted(files)[r::world] and every rank gets the whole list."""
    rank, world = _group()
    bad = []
    for name in sorted(files)[rank::world]:
        want = files[name]
        try:
            got = _digest(p / name)
        except FileNotFoundError:
            bad.append((name, "is missing", f"({want['bytes']} bytes recorded at save): the file was deleted "
                                            f"after the save"))
            continue
        except OSError as e:
            bad.append((name, "is unreadable", f"({first_line(e)})"))
            continue
        if got["bytes"] != want["bytes"]:
            bad.append((name, "has the wrong size", f"({got['bytes']} bytes != {want['bytes']} recorded at save): "
                                                    f"the file was truncated or damaged after the save"))
        elif got["sha256"] != want["sha256"]:
            bad.append((name, "fails its checksum", f"(sha256 {got['sha256'][:12]}... != {want['sha256'][:12]}... "
                                                    f"recorded at save): the file was damaged after the save"))
    return sorted(b for part in _gather(bad, world) for b in part)


def verify(path: str | Path) -> bool:
    """Checks that checkpoint `path` is complete and each of its files has the size and sha256
    meta.json recorded at save. True: verified; False: written before checksums existed (no
    "files" in meta.json), complete but not verifiable. Raises CheckpointError, e.g.
    "checkpoint run/step_0000004: __0_0.distcp fails its checksum (sha256 3fa1... != 9c2e...
    recorded at save): the file was damaged after the save; resume from an earlier checkpoint
    with train.resume=last_good (or train.resume=<path>)". Under torch.distributed every rank
    calls it, checks its share of the files and raises the same error."""
    p = Path(path)
    meta = check_complete(p)
    if "files" not in meta:
        return False
    bad = _bad_files(p, meta["files"])
    if bad:
        name, what, detail = bad[0]
        more = f" (and {len(bad) - 1} more file{'s' if len(bad) > 2 else ''})" if len(bad) > 1 else ""
        raise CheckpointError(f"checkpoint {p}: {name} {what} {detail}{more}; {FIX}")
    return True


def find_latest(run_dir: str | Path, verified: bool = True) -> Path | None:
    """The checkpoint `latest` names, verified (refused, naming it and the file, if it is not
    complete or fails `verify`); when `latest` is missing or names a folder that does not exist (a
    kill between a save's rename and the pointer update, or inside a re-save) the highest-numbered
    complete step_N/, verified; None when the run dir holds no checkpoint. verified=False: no
    hashing, only check_complete (`load` verifies anyway)."""
    run = Path(run_dir)
    p = None
    if (run / "latest").is_file():
        p = run / (run / "latest").read_text().strip()
        if not p.exists() or p == run:
            p = None
    if p is None:
        p = _newest_complete(run)
    if p is not None:
        verify(p) if verified else check_complete(p)
    return p


def find_last_good(run_dir: str | Path) -> tuple[Path | None, list[str]]:
    """Newest first, the first step_N/ that is complete and verifies (None if none does), and one
    short line for each newer one passed over, e.g. "step_0000006: __0_0.distcp fails its checksum"
    (for train.resume=last_good). A collective under torch.distributed, like `verify`."""
    run = Path(run_dir)
    steps = sorted((int(m.group(1)), d) for d in run.glob("step_*") if (m := STEP_RE.match(d.name)))
    passed = []
    for _, d in reversed(steps):
        try:
            meta = check_complete(d)
        except CheckpointError as e:
            passed.append(f"{d.name}: {str(e).removeprefix(f'checkpoint {d}: ')}")
            continue
        bad = _bad_files(d, meta["files"]) if "files" in meta else []
        if not bad:
            return d, passed
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        passed.append(f"{d.name}: {bad[0][0]} {bad[0][1]}{more}")
    return None, passed


def prune(run_dir: str | Path, keep_last: int) -> list[Path]:
    """Deletes all but the newest keep_last complete checkpoints of run_dir (keep_last <= 0: none
    deleted); never the one `latest` names, nor one whose folder holds a file named `keep` (your
    pin), and only folders that are ours (named step_N, holding a meta.json of our format). Of
    those it deletes the files meta.json lists plus meta.json and .metadata, then the folder if
    nothing else is left in it. Returns the folders deleted. One process calls it (`save`'s writer)."""
    if keep_last <= 0:
        return []
    run = Path(run_dir)
    try:
        pinned_by_latest = run / (run / "latest").read_text().strip()
    except OSError:
        pinned_by_latest = None
    ours = []
    for d in run.glob("step_*"):
        if (m := STEP_RE.match(d.name)) and d.is_dir() and not d.is_symlink() and (meta := _meta_of(d)):
            ours.append((int(m.group(1)), d, meta))  # a folder without our meta.json is not ours: left alone
    ours.sort(key=lambda x: x[0], reverse=True)
    complete = []
    for _, d, _ in ours:
        try:
            check_complete(d)
            complete.append(d)
        except CheckpointError:
            pass
    keep = set(complete[:keep_last]) | {pinned_by_latest}
    removed = []
    for _, d, meta in ours:
        if d in keep or (d / "keep").exists():
            continue
        try:
            names = _listed(d, meta)
            if all(DCP_FILE_RE.match(n) for n in names) and _remove_ours(d, names):
                removed.append(d)
        except OSError:  # e.g. no permission: the folder stays, the next save tries again
            continue
    return removed


def remove_partial(run_dir: str | Path) -> list[Path]:
    """Deletes the step_N.tmp/ folders killed saves left in run_dir, but only those holding nothing
    but files DCP or `save` write (__R_I.distcp, .metadata, meta.json and their .tmp); a folder
    holding anything else is left alone. A re-save killed between its two renames (step_N.old.tmp/
    there, step_N/ not) gets its old checkpoint back as step_N/, the one `latest` names. Returns
    the folders removed. Call it from one process while no save runs (train.py: at start, holding
    the run dir's lock), before `find_latest`."""
    removed = []
    for d in sorted(Path(run_dir).glob("step_*.tmp")):
        if not PARTIAL_RE.match(d.name) or not d.is_dir() or d.is_symlink():
            continue
        final = d.with_name(d.name.removesuffix(".old.tmp"))
        if d.name.endswith(".old.tmp") and not final.exists() and _meta_of(d) is not None:
            os.replace(d, final)
            continue
        entries = list(d.iterdir())
        if all(OURS_RE.match(p.name) and p.is_file() and not p.is_symlink() for p in entries):
            if _remove_ours(d, [p.name for p in entries]):
                removed.append(d)
    return removed


def _damaged(path: Path, what: str) -> CheckpointError:
    return CheckpointError(f"checkpoint {path} is damaged: {what}; {FIX}")


def load(path: str | Path, state: dict, optional: tuple[str, ...] = (), aliases: dict[tuple, str] | None = None) -> dict:
    """Verifies checkpoint `path` (see `verify`), then loads it into `state` (tensors in place,
    plain values replaced); returns its meta.json. `optional`: dotted keys of `state` (e.g.
    "data.val_windows") that checkpoints written before they existed lack; those are dropped from
    `state` when the checkpoint has none. `aliases`: {(section, ..., key): the key older
    checkpoints stored it under}, loaded from there when the checkpoint has only the old key. A
    state of another shape: "checkpoint P does not fit this model (was it written for another
    model config?): <DCP's words, naming the tensor>"; an unreadable .metadata or data file (no
    checksums to catch it first): "checkpoint P is damaged: ...". Under torch.distributed every
    rank calls it and meets the same error."""
    p = Path(path)
    verify(p)
    meta = check_complete(p)
    try:
        have = dcp.FileSystemReader(str(p)).read_metadata().state_dict_metadata
    except Exception as e:  # unpickling errors of every kind: not a question of the model config
        raise _damaged(p, f".metadata is unreadable ({type(e).__name__}: {first_line(e)})") from None
    def holder(parents) -> dict:  # the dict of `state` at that path
        d = state
        for k in parents:
            d = d[k]
        return d

    for key in optional:
        if key not in have:
            *parents, leaf = key.split(".")
            holder(parents).pop(leaf, None)
    for (*parents, leaf), old in (aliases or {}).items():
        d = holder(parents)
        if ".".join([*parents, leaf]) not in have and ".".join([*parents, old]) in have and leaf in d:
            d[old] = d.pop(leaf)  # the same tensor: loaded in place under its old name
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_NO_PG_WARNING)
        try:
            dcp.load(state, checkpoint_id=str(p))
        except (ValueError, RuntimeError, OSError, EOFError, CheckpointException) as e:
            errs = [x for _, (x, _) in sorted(e.failures.items())] if isinstance(e, CheckpointException) else [e]
            misfit = [x for x in errs if isinstance(x, (ValueError, RuntimeError)) and
                      any(w in str(x) for w in _MISFIT)]
            if misfit:  # DCP's size and key checks, naming the tensor
                raise CheckpointError(f"checkpoint {p} does not fit this model (was it written for another "
                                      f"model config?): {first_line(misfit[0])}") from None
            raise _damaged(p, f"a data file is unreadable ({type(errs[0]).__name__}: {first_line(errs[0])})") from None
    return meta


def latest_name(run_dir: Path) -> str:
    """What `latest` names (unverified: for messages), or "none"."""
    try:
        return str(run_dir / (run_dir / "latest").read_text().strip())
    except OSError:
        return "none"
