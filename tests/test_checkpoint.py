"""moefp8/checkpoint.py: checksums recorded at save and verified at load (a bit flip is caught,
named, and passed over by find_last_good), DCP's errors unwrapped and classified (a full disk, a
damaged file, another model shape), re-saves and pruning that lose nothing and delete nothing of
yours, and saves killed at random points that never leave `latest` naming a damaged checkpoint."""

import contextlib
import errno
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from ckpt_harness import empty_state, same, state_of
from moefp8 import checkpoint
from moefp8.checkpoint import CheckpointError
from moefp8.testing import spawn_group

REPO = Path(__file__).resolve().parent.parent
HARNESS = str(REPO / "tests" / "ckpt_harness.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
N = 1_000_000  # floats in the weight of the unit tests' state: a real tensor, 4 MB


def meta_of(d: Path) -> dict:
    return json.loads((d / "meta.json").read_text())


def flip(d: Path, fqn: str = "model.w", n: int = 64) -> str:
    """Inverts n bytes in the middle of tensor fqn's data in its .distcp file (DCP's index says
    where); returns the file's name."""
    md = dcp.FileSystemReader(str(d)).read_metadata()
    info = next(v for k, v in md.storage_data.items() if k.fqn == fqn)
    f = d / info.relative_path
    b = bytearray(f.read_bytes())
    mid = info.offset + info.length // 2
    b[mid:mid + n] = bytes(x ^ 0xFF for x in b[mid:mid + n])
    f.write_bytes(b)
    return f.name


def as_v1(d: Path) -> None:
    """Makes d a checkpoint of before checksums: no "files" in meta.json."""
    m = meta_of(d)
    del m["files"]
    (d / "meta.json").write_text(json.dumps(m))


def test_round_trip_records_every_file(tmp_path):
    run = tmp_path / "run"
    p = checkpoint.save(run, 3, state_of(3, N), {"loss": 2.5})
    m = meta_of(p)
    assert m["step"] == 3 and m["loss"] == 2.5 and m["format"] == checkpoint.FORMAT
    on_disk = sorted(f.name for f in p.iterdir() if f.name != "meta.json")
    assert sorted(m["files"]) == on_disk == [".metadata", "__0_0.distcp"]
    for name, rec in m["files"].items():
        assert rec["bytes"] == (p / name).stat().st_size and len(rec["sha256"]) == 64
    assert (p / "__0_0.distcp").stat().st_size > 4 * N
    assert checkpoint.find_latest(run) == p and checkpoint.verify(p) is True
    st = empty_state(N)
    assert checkpoint.load(p, st)["step"] == 3 and same(st, state_of(3, N))


def test_a_bit_flip_is_named_refused_and_passed_over(tmp_path):
    run = tmp_path / "run"
    for step in (2, 4, 6):
        checkpoint.save(run, step, state_of(step, N))
    name = flip(run / "step_0000006")
    assert name == "__0_0.distcp"
    for call in (lambda: checkpoint.load(run / "step_0000006", empty_state(N)), lambda: checkpoint.find_latest(run)):
        with pytest.raises(CheckpointError) as e:
            call()
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith(f"checkpoint {run / 'step_0000006'}: __0_0.distcp fails its checksum "
                                                  f"(sha256 "), msg
        assert "recorded at save): the file was damaged after the save; resume from an earlier checkpoint with " \
               "train.resume=last_good" in msg
    assert checkpoint.find_last_good(run) == (run / "step_0000004", ["step_0000006: __0_0.distcp fails its checksum"])
    # a truncated file and a deleted one are named too; all three passed over, none left
    with open(run / "step_0000004" / "__0_0.distcp", "r+b") as f:
        f.truncate(1000)
    (run / "step_0000002" / "__0_0.distcp").unlink()
    with pytest.raises(CheckpointError, match=r"step_0000004: __0_0.distcp has the wrong size \(1000 bytes != \d+ "):
        checkpoint.verify(run / "step_0000004")
    with pytest.raises(CheckpointError, match=r"step_0000002: __0_0.distcp is missing \(\d+ bytes recorded at save\)"):
        checkpoint.verify(run / "step_0000002")
    assert checkpoint.find_last_good(run) == (None, ["step_0000006: __0_0.distcp fails its checksum",
                                                     "step_0000004: __0_0.distcp has the wrong size",
                                                     "step_0000002: __0_0.distcp is missing"])
    # why the checksums: the same flip in a checkpoint without them loads silently, with other weights
    p = checkpoint.save(tmp_path / "v1", 6, state_of(6, N))
    flip(p)
    as_v1(p)
    st = empty_state(N)
    assert checkpoint.verify(p) is False
    checkpoint.load(p, st)
    assert not torch.equal(st["model"]["w"], state_of(6, N)["model"]["w"])


def test_a_damaged_metadata_is_damage_not_another_model_config(tmp_path):
    p = checkpoint.save(tmp_path / "run", 1, state_of(1, 1000))
    b = bytearray((p / ".metadata").read_bytes())
    b[len(b) // 3:len(b) // 3 + 64] = bytes(64)
    (p / ".metadata").write_bytes(b)
    with pytest.raises(CheckpointError, match=r"\.metadata fails its checksum .*: the file was damaged after the save"):
        checkpoint.load(p, empty_state(1000))
    as_v1(p)  # no checksums: the load itself finds it unreadable
    with pytest.raises(CheckpointError) as e:
        checkpoint.load(p, empty_state(1000))
    msg = str(e.value)
    assert msg.startswith(f"checkpoint {p} is damaged: .metadata is unreadable (") and "model config" not in msg, msg
    assert "\n" not in msg and "train.resume=last_good" in msg
    # a damaged data file of a checkpoint without checksums (the torch.save header of its first record)
    q = checkpoint.save(tmp_path / "run2", 1, state_of(1, 1000))
    as_v1(q)
    with open(q / "__0_0.distcp", "r+b") as f:
        f.write(bytes(64))
    with pytest.raises(CheckpointError, match=r"is damaged: a data file is unreadable \(") as e:
        checkpoint.load(q, empty_state(1000))
    assert "model config" not in str(e.value)


def test_another_model_shape_does_not_fit(tmp_path):
    p = checkpoint.save(tmp_path / "run", 1, state_of(1, 1000))
    st = empty_state(1000)
    st["model"]["b"] = torch.zeros(7, 4)
    with pytest.raises(CheckpointError, match=r"does not fit this model \(was it written for another model config\?\)"
                                              r": Size mismatch .* for model\.b"):
        checkpoint.load(p, st)
    st = empty_state(1000)
    st["model"]["router.weight"] = torch.zeros(3)
    with pytest.raises(CheckpointError, match=r"does not fit this model .*Missing key .*model\.router\.weight"):
        checkpoint.load(p, st)


def test_optional_keys_and_checkpoints_from_before_checksums(tmp_path):
    p = checkpoint.save(tmp_path / "run", 1, state_of(1, 1000))
    as_v1(p)
    st = empty_state(1000)
    st["data"]["val_windows"] = torch.zeros(3)
    assert checkpoint.verify(p) is False and checkpoint.find_latest(tmp_path / "run") == p
    checkpoint.load(p, st, optional=("data.val_windows",))
    assert "val_windows" not in st["data"] and same(st, state_of(1, 1000))
    assert checkpoint.find_last_good(tmp_path / "run") == (p, [])


def test_aliases_load_a_tensor_stored_under_its_old_name(tmp_path):
    """A checkpoint of an older version stored model.b as model.b_old.weight: with the alias it
    loads into b (the same tensor, in place); a checkpoint with the new name ignores the alias."""
    old = state_of(1, 1000)
    old["model"]["b.weight"] = old["model"].pop("b")
    p = checkpoint.save(tmp_path / "old", 1, old)
    st = empty_state(1000)
    b = st["model"]["b"]
    checkpoint.load(p, st, aliases={("model", "b"): "b.weight", ("model", "nope"): "nope.weight"})
    assert torch.equal(b, state_of(1, 1000)["model"]["b"]) and st["data"] == {"pos": 1000}
    with pytest.raises(CheckpointError, match="Missing key"):  # without it: the one-line misfit
        checkpoint.load(p, empty_state(1000))
    p = checkpoint.save(tmp_path / "new", 2, state_of(2, 1000))
    st = empty_state(1000)
    checkpoint.load(p, st, aliases={("model", "b"): "b.weight"})
    assert same(st, state_of(2, 1000))


def test_meta_json_cannot_name_files_outside_the_checkpoint(tmp_path):
    p = checkpoint.save(tmp_path / "run", 1, state_of(1, 1000))
    m = meta_of(p)
    m["files"]["../../victim"] = m["files"].pop("__0_0.distcp")
    (p / "meta.json").write_text(json.dumps(m))
    with pytest.raises(CheckpointError, match=r"meta.json's \"files\" is not a list of DCP files"):
        checkpoint.verify(p)


def test_resave_replaces_the_old_and_keeps_your_files(tmp_path):
    run = tmp_path / "run"
    p = checkpoint.save(run, 3, state_of(3, 1000))
    (p / "notes.txt").write_text("mine")
    (p / "keep").write_text("")
    st = state_of(4, 1000)
    st["step"] = 3
    assert checkpoint.save(run, 3, st) == p
    back = empty_state(1000)
    checkpoint.load(p, back)
    assert same(back, st) and (p / "notes.txt").read_text() == "mine" and (p / "keep").exists()
    assert sorted(x.name for x in run.iterdir()) == ["latest", "step_0000003"]


def test_a_resave_killed_between_its_renames(tmp_path):
    """The window the re-save leaves (old folder aside, new not yet renamed): find_latest falls
    back to the newest complete checkpoint, remove_partial puts the old one back."""
    run = tmp_path / "run"
    for step in (1, 2):
        checkpoint.save(run, step, state_of(step, 1000))
    shutil.copytree(run / "step_0000002", run / "step_0000002.tmp")  # the new save, complete
    os.replace(run / "step_0000002", run / "step_0000002.old.tmp")
    assert (run / "latest").read_text().strip() == "step_0000002"
    assert checkpoint.find_latest(run) == run / "step_0000001"
    assert checkpoint.remove_partial(run) == [run / "step_0000002.tmp"]
    assert checkpoint.find_latest(run) == run / "step_0000002"
    assert sorted(x.name for x in run.iterdir()) == ["latest", "step_0000001", "step_0000002"]
    # `latest` naming a folder that is gone (and no re-save): the newest complete one
    shutil.rmtree(run / "step_0000002")
    assert checkpoint.find_latest(run) == run / "step_0000001"


def test_pruning_keeps_the_newest_the_pinned_latest_and_your_files(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "step_0000000").mkdir()  # not ours: no meta.json
    (run / "step_0000000" / "__0_0.distcp").write_text("yours")
    for step in range(1, 7):
        checkpoint.save(run, step, state_of(step, 1000), keep_last=2)
        if step == 2:
            (run / "step_0000002" / "keep").write_text("")  # your pin
        if step == 3:
            (run / "step_0000003" / "notes.txt").write_text("yours")
    assert sorted(x.name for x in run.glob("step_*")) == ["step_0000000", "step_0000002", "step_0000003",
                                                          "step_0000005", "step_0000006"]
    assert sorted(x.name for x in (run / "step_0000003").iterdir()) == ["notes.txt"]  # ours gone, yours kept
    assert (run / "step_0000000" / "__0_0.distcp").read_text() == "yours"
    assert checkpoint.verify(run / "step_0000002") and checkpoint.verify(run / "step_0000005")
    # never the one `latest` names, even when older than the newest keep_last
    (run / "latest").write_text("step_0000005\n")
    assert checkpoint.prune(run, 1) == []
    (run / "latest").write_text("step_0000006\n")
    assert checkpoint.prune(run, 1) == [run / "step_0000005"]
    assert checkpoint.prune(run, 0) == [] and checkpoint.find_latest(run) == run / "step_0000006"


def test_remove_partial_removes_only_our_leftovers(tmp_path):
    run = tmp_path / "run"
    p = checkpoint.save(run, 6, state_of(6, 1000))
    killed = run / "step_0000007.tmp"  # a save killed before its rename
    killed.mkdir()
    for name in (".metadata", "__0_0.distcp", "meta.json.tmp"):
        shutil.copy(p / name.replace(".tmp", ""), killed / name)
    (run / "step_0000008.tmp").mkdir()  # killed before DCP wrote anything
    yours = run / "step_0000009.tmp"
    yours.mkdir()
    shutil.copy(p / ".metadata", yours / ".metadata")
    (yours / "mine.txt").write_text("yours")
    assert checkpoint.remove_partial(run) == [killed, run / "step_0000008.tmp"]
    assert sorted(x.name for x in yours.iterdir()) == [".metadata", "mine.txt"]
    assert sorted(x.name for x in run.iterdir()) == ["latest", "step_0000006", "step_0000009.tmp"]
    # and a save of step 9 leaves your file in place (it goes along into step_0000009/)
    checkpoint.save(run, 9, state_of(9, 1000))
    assert (run / "step_0000009" / "mine.txt").read_text() == "yours" and checkpoint.verify(run / "step_0000009")


def test_full_disk_enospc_inside_dcp_writer(tmp_path, monkeypatch):
    """ENOSPC from the lowest write DCP makes (its file stream) after 100 kB of the data file:
    DCP wraps it in a CheckpointException; the message unwraps it."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    run = tmp_path / "run"
    checkpoint.save(run, 1, state_of(1, 1000))
    real = FileSystem.create_stream

    class FullDisk:
        def __init__(self, f, room: int):
            self.f, self.room = f, room

        def write(self, b) -> int:
            n = memoryview(b).nbytes
            if n > self.room:
                self.f.write(memoryview(b).cast("B")[:self.room])
                self.room = 0
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            self.room -= n
            return self.f.write(b)

        def __getattr__(self, name):
            return getattr(self.f, name)

    @contextlib.contextmanager
    def full_disk(self, path, mode):
        with real(self, path, mode) as f:
            yield FullDisk(f, 100_000) if mode == "wb" and str(path).endswith(".distcp") else f

    monkeypatch.setattr(FileSystem, "create_stream", full_disk)
    with pytest.raises(CheckpointError) as e:
        checkpoint.save(run, 2, state_of(2, N))
    msg = str(e.value)
    assert msg == (f"checkpoint {run / 'step_0000002'}: could not be written (rank 0: [Errno 28] No space left on "
                   f"device); the last complete checkpoint ({run / 'step_0000001'}) is kept and `train.resume=auto` "
                   f"continues from it"), msg
    assert sorted(x.name for x in run.iterdir()) == ["latest", "step_0000001"]
    assert (run / "latest").read_text().strip() == "step_0000001"


@pytest.mark.slow
def test_full_disk_efbig_through_real_dcp(tmp_path):
    """The file size limit (RLIMIT_FSIZE, SIGXFSZ ignored) makes DCP's own write of the data file
    fail with EFBIG, in a subprocess."""
    run = tmp_path / "run"
    r = subprocess.run([sys.executable, HARNESS, "fsize", str(run), str(1_000_000)], capture_output=True, text=True,
                       timeout=120, env=ENV)
    assert r.returncode == 3, r.stdout + r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1 and "could not be written (rank 0: [Errno 27] File too large)" in lines[0], r.stdout
    assert f"the last complete checkpoint ({run / 'step_0000001'}) is kept" in lines[0]
    assert sorted(x.name for x in run.iterdir()) == ["latest", "step_0000001"]
    assert checkpoint.find_latest(run) == run / "step_0000001"


def _two_ranks(rank, world, device, run):
    """Each rank holds its own experts (as under expert parallelism), so both ranks write data."""
    run = Path(run)
    hashed = []
    real = checkpoint._digest
    checkpoint._digest = lambda p: (hashed.append(p.name), real(p))[1]
    st = {"experts": {f"e{rank}": torch.arange(100_000.0) + 1e6 * rank}, "step": 1}
    p = checkpoint.save(run, 1, st, is_writer=rank == 0)
    assert hashed == (["__0_0.distcp", ".metadata"] if rank == 0 else ["__1_0.distcp"]), hashed  # its own files
    files = checkpoint.check_complete(p)["files"]
    assert sorted(files) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert all(files[n]["bytes"] == (p / n).stat().st_size for n in files)
    assert (p / "__1_0.distcp").stat().st_size > 400_000  # rank 1's experts are in rank 1's file
    back = {"experts": {f"e{rank}": torch.zeros(100_000)}, "step": 0}
    hashed.clear()
    checkpoint.load(p, back)
    assert torch.equal(back["experts"][f"e{rank}"], st["experts"][f"e{rank}"]) and back["step"] == 1
    assert hashed == sorted(files)[rank::world]  # the verification is shared
    dist.barrier()
    if rank == 0:
        with open(p / "__1_0.distcp", "r+b") as f:
            f.seek(300_000)
            b = f.read(1)
            f.seek(300_000)
            f.write(bytes([b[0] ^ 1]))
    dist.barrier()
    msgs = []
    for call in (lambda: checkpoint.verify(p), lambda: checkpoint.load(p, back), lambda: checkpoint.find_latest(run)):
        try:
            call()
            msgs.append("no error")
        except CheckpointError as e:
            msgs.append(str(e))
    both = [None, None]
    dist.all_gather_object(both, msgs)
    assert both[0] == both[1], both  # the same error on every rank
    assert all(m.startswith(f"checkpoint {p}: __1_0.distcp fails its checksum") for m in msgs), msgs
    assert checkpoint.find_last_good(run) == (None, ["step_0000001: __1_0.distcp fails its checksum"])
    # a write DCP makes fails on both ranks (EFBIG); DCP's gather drops the OSError behind torch.save's
    # "unexpected pos" error, so each rank reports what its folder shows
    import resource

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    try:
        checkpoint.save(run, 2, st, is_writer=rank == 0)
        msg = "no error"
    except CheckpointError as e:
        msg = str(e)
    dist.all_gather_object(both, msg)
    assert both[0] == both[1] == (f"checkpoint {run / 'step_0000002'}: could not be written (ranks 0, 1: [Errno 27] "
                                  f"File too large (the file size limit, ulimit -f, is 200000 bytes)); the last "
                                  f"complete checkpoint ({p}) is kept and `train.resume=auto` continues from it"), both
    dist.barrier()
    assert sorted(x.name for x in run.iterdir()) == ["latest", "step_0000001"]


@pytest.mark.slow
def test_two_gloo_ranks_hash_their_own_files_and_fail_alike(tmp_path):
    spawn_group(_two_ranks, 2, str(tmp_path / "run"), timeout_s=120)


@pytest.mark.slow
def test_sigkill_during_saves_never_damages_latest(tmp_path):
    """20 savers (tests/ckpt_harness.py) killed at seeded random points, most inside a save (the
    k-th save of that saver, k in 1..3, the first being a re-save): after each kill `latest`
    names a complete checkpoint that verifies (or, inside a re-save's two renames, a folder whose
    old copy is aside), find_latest gives a checkpoint that verifies and holds its step's state,
    and once remove_partial has run (as train.py does at start) `latest` is back, no step is
    lost and no .tmp folder is left."""
    run, keep = tmp_path / "run", 2
    rng = random.Random(7)
    phases, best, held = Counter(), 0, 0
    with open(tmp_path / "saver.err", "w") as err:
        srv = subprocess.Popen([sys.executable, HARNESS, "serve", str(run), "100000", str(keep)], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=err, text=True, env=ENV)
    try:
        for i in range(20):
            srv.stdin.write("go\n")
            srv.stdin.flush()
            pid = int(srv.stdout.readline())
            k, seen = rng.choice([1, 1, 2, 3]), set()
            deadline = time.monotonic() + 60
            while len(seen) < k and time.monotonic() < deadline:
                seen |= {d.name for d in run.glob("step_*.tmp") if not d.name.endswith(".old.tmp")}
                time.sleep(0.003)
            time.sleep(rng.uniform(0.0, 0.35))  # a save of 32 MB takes ~0.25 s here
            os.kill(pid, signal.SIGKILL)
            status = int(srv.stdout.readline())
            assert os.WIFSIGNALED(status), f"kill {i}: the saver ended: {(tmp_path / 'saver.err').read_text()}"
            names = {d.name for d in run.iterdir()}
            phases["in a re-save" if any(n.endswith(".old.tmp") for n in names) else
                   "in a save" if any(n.endswith(".tmp") and n.startswith("step_") for n in names) else
                   "between saves"] += 1
            pointer = (run / "latest").read_text().strip() if (run / "latest").exists() else None
            if pointer and not (run / pointer).exists():
                assert (run / f"{pointer}.old.tmp").is_dir(), f"kill {i}: latest names {pointer}, gone: {names}"
            elif pointer:
                assert checkpoint.verify(run / pointer), f"kill {i}: {pointer}"
            p = checkpoint.find_latest(run)  # as a reader sees it now
            if p is not None:
                st = empty_state()
                checkpoint.load(p, st)
                assert same(st, state_of(st["step"])), f"kill {i}: {p}"
            checkpoint.remove_partial(run)  # as train.py at start
            assert not list(run.glob("step_*.tmp")), f"kill {i}: {sorted(names)}"
            p = checkpoint.find_latest(run)
            if best:
                assert p is not None and p.name == (run / "latest").read_text().strip(), f"kill {i}: {p}"
                assert checkpoint.check_complete(p)["step"] >= best, f"kill {i}: {p} is older than step {best}"
            if p is not None:
                best = checkpoint.check_complete(p)["step"]
                # pruned: a save adds one folder and prunes after its rename, so a kill in between leaves
                # one more; two such kills in a row (a loaded machine) two more, never more than one per save
                n = len(list(run.glob("step_*")))
                assert n <= max(keep, held) + 1, f"kill {i}: {n} checkpoints after {held}"
                held = n
    finally:
        srv.stdin.close()
        try:
            srv.wait(timeout=30)
        except subprocess.TimeoutExpired:
            srv.kill()
            srv.wait()
    print(f"kills: {dict(phases)}; reached step {best}")
    assert best >= 5 and phases["in a save"] + phases["in a re-save"] >= 10, (phases, best)  # most inside a save
