"""Byte-level data: prepare (tokens, caps, shards, atomic output), the loader (determinism,
data-parallel ranks, exact resume across epochs) and clear errors for broken shards."""

import json

import numpy as np
import pytest
import torch

from moefp8.data import EOS, DataError, Loader, decode, encode, load_shards, main, prepare


@pytest.fixture
def texts(tmp_path):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "b.txt").write_text("hello wörld\n" * 50)
    (src / "a.txt").write_text("".join(f"line {i}\n" for i in range(300)))
    (src / "sub" / "c.txt").write_text("x" * 1000)
    (src / "skip.md").write_text("not matched")
    return src


def test_prepare_tokens(texts, tmp_path):
    idx = prepare(str(texts), str(tmp_path / "out"), glob="*.txt")
    toks = np.concatenate(load_shards(str(tmp_path / "out")))
    want = b"".join((texts / f).read_bytes() for f in ("a.txt", "b.txt", "sub/c.txt"))  # sorted paths
    assert idx["files"] == 3 and idx["bytes"] == len(want)
    assert len(toks) == len(want) + 3 and (toks == EOS).sum() == 3
    assert bytes(toks[toks != EOS].astype(np.uint8)) == want
    assert decode(encode("grüße\n")) == "grüße\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]  # no temporary folder left


def test_prepare_several_globs(texts, tmp_path):
    """Comma-separated patterns: the union of their files, each once, in sorted path order."""
    idx = prepare(str(texts), str(tmp_path / "out"), glob="*.txt, *.md,b.txt")
    toks = np.concatenate(load_shards(str(tmp_path / "out")))
    want = b"".join((texts / f).read_bytes() for f in ("a.txt", "b.txt", "skip.md", "sub/c.txt"))
    assert idx["files"] == 4 and bytes(toks[toks != EOS].astype(np.uint8)) == want


def test_prepare_several_folders(texts, tmp_path):
    """Comma-separated source folders: read in the order given, each one's files sorted; a file
    reached twice (a folder inside another) is read once; a missing folder is named."""
    extra = tmp_path / "extra"
    extra.mkdir()
    (extra / "0.txt").write_text("first of extra")
    idx = prepare(f"{extra},{texts},{texts / 'sub'}", str(tmp_path / "out"), glob="*.txt")
    toks = np.concatenate(load_shards(str(tmp_path / "out")))
    want = b"".join(p.read_bytes() for p in (extra / "0.txt", texts / "a.txt", texts / "b.txt", texts / "sub" / "c.txt"))
    assert idx["files"] == 4 and bytes(toks[toks != EOS].astype(np.uint8)) == want
    with pytest.raises(DataError, match=f"source folder {tmp_path / 'missing'} does not exist"):
        prepare(f"{texts},{tmp_path / 'missing'}", str(tmp_path / "o2"), glob="*.txt")


def test_prepare_named_sources(tmp_path):
    """"site-packages": the folder of the installed packages torch is in, beside "stdlib" and folders."""
    idx = prepare("site-packages", str(tmp_path / "sp"), glob="torch/version.py")
    assert idx["files"] >= 1 and idx["src"] == "site-packages"
    tokens = np.concatenate(load_shards(str(tmp_path / "sp")))
    assert b"__version__" in bytes(tokens[tokens != EOS].astype(np.uint8))


def test_prepare_cap_and_shards(texts, tmp_path):
    idx = prepare(str(texts), str(tmp_path / "out"), glob="*.txt", max_bytes=1500, shard_tokens=512)
    assert idx["bytes"] == 1500
    assert [s["tokens"] for s in idx["shards"]][:-1] == [512] * (len(idx["shards"]) - 1)
    assert sum(s["tokens"] for s in idx["shards"]) == 1500 + idx["files"]


def test_prepare_stdlib_cli(tmp_path, capsys):
    main(["prepare", "--src", "stdlib", "--out", str(tmp_path / "std"), "--max-bytes", "200000"])
    idx = json.loads((tmp_path / "std" / "index.json").read_text())
    assert idx["bytes"] == 200000 and "site-packages" not in capsys.readouterr().out
    text = decode(np.concatenate(load_shards(str(tmp_path / "std")))[:5000])
    assert "import" in text or "def " in text


@pytest.fixture
def data(texts, tmp_path):
    prepare(str(texts), str(tmp_path / "d"), glob="*.txt", shard_tokens=1000)
    return str(tmp_path / "d")


def batches(loader, n):
    return [loader.next() for _ in range(n)]


def test_loader_shapes_and_determinism(data):
    a, b = Loader(data, 3, 128, seed=5), Loader(data, 3, 128, seed=5)
    assert a.n_windows // 3 < 20  # the 20 batches cross an epoch boundary
    for (x, y), (x2, y2) in zip(batches(a, 20), batches(b, 20)):
        assert x.shape == y.shape == (3, 128) and x.dtype == torch.int64
        assert torch.equal(x[:, 1:], y[:, :-1])
        assert torch.equal(x, x2) and torch.equal(y, y2)
    c = Loader(data, 3, 16, seed=6)
    assert not torch.equal(c.next()[0], Loader(data, 3, 16, seed=5).next()[0])


def test_loader_ranks_partition_the_global_batch(data):
    one = Loader(data, 4, 16, rank=0, world=1)
    r0, r1 = Loader(data, 2, 16, rank=0, world=2), Loader(data, 2, 16, rank=1, world=2)
    for _ in range(12):
        x = one.next()[0]
        assert torch.equal(torch.cat([r0.next()[0], r1.next()[0]]), x)


def test_steps_per_epoch(data):
    """The last step that reads no window twice, for any split of a step over ranks and micro-batches."""
    for world, accum in ((1, 1), (1, 3), (2, 2)):
        loaders = [Loader(data, 2, 16, rank=r, world=world, seed=3) for r in range(world)]
        steps = loaders[0].steps_per_epoch(accum)
        seen = set()
        for _ in range(steps * accum):  # every rank's micro-batches of the first `steps` steps
            for ld in loaders:
                ids = ld._permutation()[ld.pos + ld.rank * ld.batch: ld.pos + (ld.rank + 1) * ld.batch]
                ld.next()
                seen.update(ids.tolist())
        assert len(seen) == steps * accum * 2 * world and all(ld.epoch == 0 for ld in loaders)
        for _ in range(accum):  # the step after them starts the next epoch (or crosses into it)
            for ld in loaders:
                ld.next()
        assert loaders[0].epoch == 1


def test_loader_resume_exact(data):
    a = Loader(data, 3, 128, seed=1)
    batches(a, 7)
    sd = a.state_dict()
    rest = batches(a, 15)
    assert a.epoch >= 1  # crossed an epoch boundary
    b = Loader(data, 3, 128, seed=1)
    b.load_state_dict(sd)
    for (x, y), (x2, y2) in zip(rest, batches(b, 15)):
        assert torch.equal(x, x2) and torch.equal(y, y2)
    with pytest.raises(ValueError, match="seq_len=128"):
        Loader(data, 3, 64, seed=1).load_state_dict(sd)


def test_held_out_windows(data):
    """data.val_windows: the same held-out windows for every seed, never served by next(); without
    them the training order is what it was before the split existed (randperm of all windows)."""
    plain = Loader(data, 2, 16, seed=4)
    g = torch.Generator().manual_seed(4 * 1_000_003)
    assert np.array_equal(plain._permutation(), torch.randperm(plain.n_windows, generator=g).numpy())
    a, b = Loader(data, 2, 16, seed=4, val_windows=6), Loader(data, 2, 16, seed=9, val_windows=6)
    assert np.array_equal(a.val_ids, b.val_ids) and len(a.val_ids) == 6 and a.n_windows == plain.n_windows - 6
    assert torch.equal(torch.cat([x for x, _ in a.val_batches()]), a._rows(a.val_ids)[0])
    for _ in range(2):  # two epochs: the training permutation never holds a held-out window
        assert len(a._permutation()) == a.n_windows and not set(a._permutation()) & set(a.val_ids)
        a.epoch += 1
    # data-parallel ranks split each held-out global batch; a remainder under one global batch is left out
    r0, r1 = Loader(data, 2, 16, 0, 2, val_windows=6), Loader(data, 2, 16, 1, 2, val_windows=6)
    v0, v1 = list(r0.val_batches()), list(r1.val_batches())
    assert len(v0) == len(v1) == 1
    assert torch.equal(torch.cat([v0[0][0], v1[0][0]]), torch.cat([x for x, _ in a.val_batches()])[:4])
    with pytest.raises(ValueError, match="data.val_windows=3: must be between one global batch"):
        Loader(data, 2, 16, 0, 2, val_windows=3)
    with pytest.raises(ValueError, match="data.val_windows=6"):  # resuming with another split: other positions
        plain.load_state_dict(a.state_dict())


def test_errors_name_the_path(data, tmp_path):
    with pytest.raises(DataError, match=str(tmp_path / "nope" / "index.json")):
        Loader(str(tmp_path / "nope"), 1, 8)
    shard = tmp_path / "d" / "shard_00001.bin"
    raw = shard.read_bytes()
    shard.write_bytes(raw[:-6])
    with pytest.raises(DataError, match=f"{shard} has {len(raw) - 6} bytes.*truncated"):
        Loader(data, 1, 8)
    shard.write_bytes(b"")
    with pytest.raises(DataError, match=f"{shard} is empty"):
        Loader(data, 1, 8)
    shard.unlink()
    with pytest.raises(DataError, match=f"{shard} listed in"):
        Loader(data, 1, 8)
    with pytest.raises(DataError, match="does not exist"):
        prepare(str(tmp_path / "missing"), str(tmp_path / "o"))
    with pytest.raises(DataError, match="no file matches"):
        prepare(str(tmp_path / "d"), str(tmp_path / "o"), glob="*.rst")
