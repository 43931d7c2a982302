"""Data safety: `prepare` and `ensure` never delete or overwrite what the user made, never train on
other data than asked for, and bad input (folders, globs, indexes, shards, vocabularies) is one
line naming the value and the fix. Every refusal is checked to leave the folder byte-identical."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from moefp8 import data as data_mod
from moefp8.data import EOS, DataError, Loader, ensure, load_shards, prepare, read_index

REPO = Path(__file__).resolve().parent.parent


def snapshot(d: Path) -> dict:
    """Every path under d (folders too) with the sha256 of its bytes: equal before and after = untouched."""
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(Path(d).rglob("*"))}


def refusal(e: pytest.ExceptionInfo, *words: str) -> str:
    msg = str(e.value)
    assert "\n" not in msg, msg
    for w in words:
        assert w in msg, (w, msg)
    return msg


@pytest.fixture
def texts(tmp_path):
    """A user's folder of texts: 3 .txt files (one in a subfolder) and a .md."""
    src = tmp_path / "texts"
    (src / "sub").mkdir(parents=True)
    (src / "a.txt").write_text("".join(f"line {i}\n" for i in range(200)))
    (src / "b.txt").write_text("hello wörld\n" * 40)
    (src / "sub" / "c.txt").write_text("y" * 700)
    (src / "notes.md").write_text("my notes")
    return src


def tokens_of(path) -> bytes:
    t = np.concatenate(load_shards(str(path)))
    return bytes(t[t != EOS].astype(np.uint8))


def user_bytes(src: Path) -> bytes:
    return b"".join((src / f).read_bytes() for f in ("a.txt", "b.txt", "sub/c.txt"))


# ---- prepare: where it may write ----

def test_cli_src_equal_to_out_deletes_nothing(texts):
    before = snapshot(texts.parent)
    r = subprocess.run([sys.executable, "-m", "moefp8.data", "prepare", "--src", str(texts), "--out", str(texts),
                        "--glob", "*.txt"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].startswith(f"error: data prepare: {texts} is not empty and was not written by moefp8's prepare "
                               f"(it holds 4 entries, e.g. a.txt); pick a new or empty folder"), lines
    assert snapshot(texts.parent) == before


@pytest.mark.parametrize("content", ["user_file", "our_index_plus_user_file", "foreign_index", "subfolder"])
def test_prepare_refuses_a_folder_it_did_not_write(texts, tmp_path, content):
    out = tmp_path / "out"
    if content == "user_file":
        out.mkdir()
        (out / "notes.txt").write_text("mine")
    elif content == "our_index_plus_user_file":  # an earlier output the user added to: not only ours any more
        prepare(str(texts), str(out), glob="*.txt")
        (out / "notes.txt").write_text("mine")
    elif content == "foreign_index":
        out.mkdir()
        (out / "index.json").write_text(json.dumps({"format": "other-tool", "shards": [{"file": "notes.txt"}]}))
        (out / "notes.txt").write_text("mine")
    else:  # an earlier output plus a folder whose name a shard entry could have
        prepare(str(texts), str(out), glob="*.txt")
        (out / "notes.txt").mkdir()
    before = snapshot(tmp_path)
    with pytest.raises(DataError) as e:
        prepare(str(texts), str(out), glob="*.txt")
    refusal(e, f"data prepare: {out} is not empty and was not written by moefp8's prepare", "e.g. notes.txt",
            "pick a new or empty folder")
    assert snapshot(tmp_path) == before


def test_prepare_refuses_a_file(texts, tmp_path):
    (tmp_path / "out").write_text("a file of mine")
    before = snapshot(tmp_path)
    with pytest.raises(DataError) as e:
        prepare(str(texts), str(tmp_path / "out"), glob="*.txt")
    refusal(e, f"{tmp_path / 'out'} is a file, not a folder")
    assert snapshot(tmp_path) == before


def test_user_folder_named_out_tmp_is_untouched(texts, tmp_path):
    """The old code built in `<out>.tmp` after rmtree'ing it: a user's folder of that name is left alone."""
    mine = tmp_path / "out.tmp"
    mine.mkdir()
    (mine / "keep.txt").write_text("precious")
    before = snapshot(mine)
    prepare(str(texts), str(tmp_path / "out"), glob="*.txt")
    assert snapshot(mine) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "out.tmp", "texts"]


def test_prepare_into_an_empty_folder(texts, tmp_path):
    out = tmp_path / "out"
    out.mkdir(mode=0o750)
    os.chmod(out, 0o750)  # exactly, whatever the umask
    prepare(str(texts), str(out), glob="*.txt")
    assert tokens_of(out) == user_bytes(texts)
    assert out.stat().st_mode & 0o777 == 0o750  # the folder's mode is kept (mkdtemp's is 0o700)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "texts"]


def test_out_through_a_link(texts, tmp_path):
    """out a symbolic link to a folder (data kept on another disk): the data goes into that folder,
    the link stays, and preparing again replaces it there."""
    (tmp_path / "disk").mkdir()
    (tmp_path / "disk" / "d").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "disk" / "d")
    for glob in ("*.md", "*.txt"):
        prepare(str(texts), str(tmp_path / "link"), glob=glob)
    assert (tmp_path / "link").is_symlink() and tokens_of(tmp_path / "disk" / "d") == user_bytes(texts)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["disk", "link", "texts"]
    assert sorted(p.name for p in (tmp_path / "disk").iterdir()) == ["d"]


def test_reprepare_over_own_output(texts, tmp_path):
    """An earlier output (even a damaged one) is replaced: its files go, no temporary or aside
    folder is left, and the folder then holds exactly the new output."""
    out = tmp_path / "out"
    first = prepare(str(texts), str(out), glob="*.txt", shard_tokens=300)
    assert len(first["shards"]) > 3
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o777 & ~umask
    (out / first["shards"][1]["file"]).unlink()  # damaged: a shard missing, another truncated
    (out / first["shards"][2]["file"]).write_bytes(b"12")
    second = prepare(str(texts), str(out), glob="*.md")
    assert tokens_of(out) == b"my notes" and len(second["shards"]) == 1
    assert sorted(os.listdir(out)) == ["index.json", "shard_00000.bin"]
    third = prepare(str(texts), str(out), glob="*.txt", shard_tokens=500)
    assert tokens_of(out) == user_bytes(texts)
    assert sorted(os.listdir(out)) == ["index.json"] + [s["file"] for s in third["shards"]]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "texts"]


def test_failed_prepare_keeps_the_earlier_output(texts, tmp_path, monkeypatch):
    """A failure while writing removes only the temporary folder; the earlier output stays whole."""
    out = tmp_path / "out"
    prepare(str(texts), str(out), glob="*.txt", shard_tokens=300)
    before = snapshot(tmp_path)
    calls, docs = [], data_mod._docs

    def failing_docs(files, max_bytes):  # the second file fails, after the first was read
        for d in docs(files, max_bytes):
            calls.append(1)
            if len(calls) == 2:
                raise OSError("disk full")
            yield d

    monkeypatch.setattr(data_mod, "_docs", failing_docs)
    monkeypatch.setattr(data_mod, "READ_BYTES", 1)  # one file per batch: the first one's shards are written
    with pytest.raises(OSError, match="disk full"):
        prepare(str(texts), str(out), glob="*.txt", shard_tokens=100)
    assert len(calls) == 2 and snapshot(tmp_path) == before


@pytest.mark.parametrize("theirs_max_bytes", [10_000_000, 1000])
def test_two_processes_prepare_one_folder_at_once(texts, tmp_path, monkeypatch, theirs_max_bytes):
    """Two runs started at once on one data.path both prepare it: the one that renames second finds
    the first's output in place. The same settings: it keeps theirs (its own build removed, nothing
    else touched); other settings: one line naming data.path (theirs kept). Before, an OSError trace."""
    out, real_swap, raced = tmp_path / "data", data_mod._swap, []

    def other_finishes_first(new, out_, old):
        if not raced:  # the other process's whole prepare lands between this one's build and its rename
            raced.append(None)
            raced[0] = prepare(str(texts), str(out_), glob="*.txt", max_bytes=theirs_max_bytes)
        real_swap(new, out_, old)

    monkeypatch.setattr(data_mod, "_swap", other_finishes_first)
    if theirs_max_bytes == 1000:
        with pytest.raises(DataError) as e:
            prepare(str(texts), str(out), glob="*.txt", max_bytes=10_000_000)
        refusal(e, f"data.path={out}", "another process prepared it from other settings", "max_bytes")
    else:
        idx = prepare(str(texts), str(out), glob="*.txt", max_bytes=10_000_000)
        assert idx == read_index(str(out)) == raced[0]
        assert tokens_of(out) == user_bytes(texts)
    assert read_index(str(out)) == raced[0]  # theirs, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "texts"]  # no build folder left behind


def test_output_inside_the_source_is_not_read(texts, tmp_path):
    """out inside a source folder: its shards, index and temporary folders are not read as text."""
    out = texts / "prepared"
    prepare(str(texts), str(out), glob="*")
    want = b"".join((texts / f).read_bytes() for f in ("a.txt", "b.txt", "notes.md", "sub/c.txt"))
    assert tokens_of(out) == want
    (texts / ".prepared.x.prepare").mkdir()  # an interrupted earlier prepare's folder
    (texts / ".prepared.x.prepare" / "shard_00000.bin").write_bytes(b"\x01\x00")
    idx = prepare(str(texts), str(out), glob="*")  # again: the first output is not read either
    assert tokens_of(out) == want and idx["files"] == 4


# ---- prepare: which files ----

def test_glob_matching_nothing_lists_what_is_there(texts, tmp_path):
    before = snapshot(tmp_path)
    with pytest.raises(DataError) as e:
        prepare(str(texts), str(tmp_path / "out"))  # the default glob, *.py, in a folder of .txt
    msg = refusal(e, "no file matches '*.py'", str(texts), "4 files: .txt (3), .md (1)",
                  "set data.glob / --glob", "e.g. '*.txt'")
    assert msg.startswith("data prepare: ")
    assert snapshot(tmp_path) == before  # no output, no temporary folder
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError) as e:
        prepare(str(tmp_path / "empty"), str(tmp_path / "out"))
    refusal(e, f"under {tmp_path / 'empty'}, which holds no files", "data.prepare_from / --src")


def test_missing_source_and_bad_sizes(tmp_path):
    with pytest.raises(DataError) as e:
        prepare(str(tmp_path / "nope"), str(tmp_path / "out"))
    refusal(e, f"source folder {tmp_path / 'nope'} does not exist", "data.prepare_from / --src")
    with pytest.raises(DataError, match="max_bytes=0"):
        prepare("stdlib", str(tmp_path / "out"), max_bytes=0)
    assert list(tmp_path.iterdir()) == []


def test_index_records_its_settings(texts, tmp_path):
    idx = prepare(str(texts), str(tmp_path / "out"), glob="*.txt", max_bytes=1000, shard_tokens=400)
    on_disk = json.loads((tmp_path / "out" / "index.json").read_text())
    assert on_disk == idx and idx["max_bytes"] == 1000 and idx["src"] == str(texts) and idx["glob"] == "*.txt"
    assert idx["created"].endswith("Z") and len(idx["created"]) == 20
    for s in idx["shards"]:
        assert s["sha256"] == hashlib.sha256((tmp_path / "out" / s["file"]).read_bytes()).hexdigest()


# ---- reading ----

@pytest.mark.parametrize("text, words", [
    ("", ["is not valid JSON (Expecting value: line 1 column 1 (char 0))", "interrupted or edited"]),
    ('{"format": "moefp8-bytes-v1", "shards": [', ["is not valid JSON", "line 1 column 42"]),
    (b"\xff\xfe{", ["is not valid JSON"]),
    ('{"format": "v0", "shards": []}', ["has format 'v0', expected 'moefp8-tokens-v2'"]),
    ('{"format": "moefp8-bytes-v1", "vocab_size": 257, "shards": []}', ["lists no shard"]),
    ('{"format": "moefp8-bytes-v1", "vocab_size": 257, "shards": [{"file": "../x", "tokens": 1}]}',
     ["has a malformed shard entry (0): it looks edited"]),
    ('[1, 2]', ["has format None"]),
    ('{"format": "moefp8-tokens-v2", "vocab_size": 257, "dtype": "int8", "shards": [{"file": "s", "tokens": 1}]}',
     ["has dtype 'int8', expected one of uint16, uint32"]),
    ('{"format": "moefp8-tokens-v2", "vocab_size": 70000, "dtype": "uint16", "shards": [{"file": "s", "tokens": 1}]}',
     ["has a vocabulary of 70000 that does not fit its dtype uint16"]),
    ('{"format": "moefp8-tokens-v2", "vocab_size": 257, "dtype": "uint16", "tokenizer": {"spec": "bytes", '
     '"file": "/etc/passwd"}, "shards": [{"file": "s", "tokens": 1}]}', ["has a malformed tokenizer entry"]),
    ('{"format": "moefp8-tokens-v2", "vocab_size": 257, "dtype": "uint16", "tokenizer": {"spec": "bytes", '
     '"file": null}, "tokens": 5, "shards": [{"file": "s", "tokens": 1}]}', ["says 5 tokens but its shards list 1"]),
])
def test_corrupt_index_names_the_file(texts, tmp_path, text, words):
    d = tmp_path / "d"
    prepare(str(texts), str(d), glob="*.txt")
    (d / "index.json").write_bytes(text if isinstance(text, bytes) else text.encode())
    before = snapshot(tmp_path)
    for call in (lambda: Loader(str(d), 1, 8), lambda: read_index(str(d))):
        with pytest.raises(DataError) as e:
            call()
        refusal(e, f"data: {d / 'index.json'} ", "prepare the data again into a new folder", *words)
    with pytest.raises(DataError) as e:  # nor is it ours to replace: its shards cannot be told from the user's
        prepare(str(texts), str(d), glob="*.txt")
    refusal(e, "was not written by moefp8's prepare")
    assert snapshot(tmp_path) == before


@pytest.fixture
def prepared(texts, tmp_path):
    prepare(str(texts), str(tmp_path / "d"), glob="*.txt", shard_tokens=1000)
    return tmp_path / "d"


def test_loader_vocab_size_smaller_than_the_index(prepared):
    with pytest.raises(DataError) as e:
        Loader(str(prepared), 2, 16, vocab_size=100)
    refusal(e, f"data.path={prepared}: its tokens (bytes) need a vocabulary of 257 (index.json), more than "
               f"model.vocab_size=100: set model.vocab_size >= 257")
    x, _ = Loader(str(prepared), 2, 16, vocab_size=257).next()
    assert torch.equal(x, Loader(str(prepared), 2, 16).next()[0])


@pytest.mark.parametrize("value", [257, 65535])
@pytest.mark.parametrize("where", ["train", "val"])
def test_out_of_range_token_names_the_shard(prepared, tmp_path, value, where):
    """A token id the index's vocabulary does not have, written into a copy of a prepared folder in a
    window that next() (or val_batches()) serves: a DataError naming the shard and the token's offset."""
    d = tmp_path / "copy"
    shutil.copytree(prepared, d)
    n_val = Loader(str(d), 1, 16).n_windows // 2
    ld = Loader(str(d), 1, 16, vocab_size=512, val_windows=n_val)
    w = (ld.val_ids if where == "val" else ld.train_ids)[-1]
    shard, offset = d / f"shard_{ld.win_shard[w]:05d}.bin", int(ld.win_start[w]) + 5
    t = np.fromfile(shard, dtype=np.uint16)
    t[offset] = value
    t.tofile(shard)
    with pytest.raises(DataError) as e:
        if where == "val":
            list(ld.val_batches())
        else:
            for _ in range(ld.n_windows):  # one epoch: every training window once
                ld.next()
    refusal(e, f"data: shard {shard} holds token id {value} at token {offset}, outside the vocabulary of 257 "
               f"(index.json): the shard is corrupt; prepare the data again into a new folder")


def test_old_index_without_new_keys_loads(prepared, tmp_path):
    d = tmp_path / "old"
    shutil.copytree(prepared, d)
    idx = json.loads((d / "index.json").read_text())
    for k in ("max_bytes", "created"):
        del idx[k]
    for s in idx["shards"]:
        del s["sha256"]
    (d / "index.json").write_text(json.dumps(idx))
    a, b = Loader(str(d), 3, 32, seed=2, vocab_size=257), Loader(str(prepared), 3, 32, seed=2)
    for _ in range(5):
        assert torch.equal(a.next()[0], b.next()[0])
    # ensure: the settings it recorded (src, glob) match; max_bytes, not recorded, is not compared
    assert ensure(str(d), idx["src"], "*.txt", 123, say=pytest.fail) == idx


# ---- ensure: the training run's entry ----

def test_ensure_refuses_other_settings(prepared, texts, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "x.txt").write_text("other text")
    before = snapshot(tmp_path)
    for src, glob, max_bytes in ((str(other), "*.txt", 32_000_000), (str(texts), "*.md", 32_000_000),
                                 (str(texts), "*.txt", 1000)):
        with pytest.raises(DataError) as e:
            ensure(str(prepared), src, glob, max_bytes, say=pytest.fail)
        refusal(e, f"data.path={prepared} holds data prepared from '{texts}' (*.txt, max_bytes=32000000), not "
                   f"from data.prepare_from='{src}' ({glob}, max_bytes={max_bytes}): pick a new data.path for it, "
                   f"or data.prepare_from='' to train on what {prepared} holds")
    assert snapshot(tmp_path) == before


def test_ensure_reuses_matching_data(prepared, texts, tmp_path, monkeypatch):
    mtimes = {p.name: p.stat().st_mtime_ns for p in prepared.iterdir()}
    idx = json.loads((prepared / "index.json").read_text())
    monkeypatch.chdir(texts.parent)  # a relative path to the same folder, the patterns respelt: the same source
    for src, glob in ((str(texts), "*.txt"), ("texts", " *.txt,"), ("", "*.py")):
        assert ensure(str(prepared), src, glob, 32_000_000, say=pytest.fail) == idx
    assert {p.name: p.stat().st_mtime_ns for p in prepared.iterdir()} == mtimes


def test_ensure_prepares_a_new_folder(texts, tmp_path):
    said = []
    idx = ensure(str(tmp_path / "new"), str(texts), "*.txt", 32_000_000, say=said.append)
    assert len(said) == 1 and "\n" not in said[0] and said[0].startswith(f"data: preparing {tmp_path / 'new'}")
    assert idx == read_index(str(tmp_path / "new")) and tokens_of(tmp_path / "new") == user_bytes(texts)
    assert ensure(str(tmp_path / "new"), str(texts), "*.txt", 32_000_000, say=pytest.fail) == idx


def test_ensure_on_a_user_folder_without_index(texts, tmp_path):
    before = snapshot(tmp_path)
    with pytest.raises(DataError) as e:  # data.path=<my texts>: the lost folder
        ensure(str(texts), "stdlib", "*.py", 200_000, say=pytest.fail)
    refusal(e, f"data.path={texts} holds files moefp8 did not write and no index.json; to train on the texts in "
               f"{texts}: data.prepare_from={texts} data.path=<a new folder>")
    with pytest.raises(DataError) as e:
        ensure(str(texts), str(texts), "*.txt", 200_000, say=pytest.fail)
    refusal(e, "holds files moefp8 did not write")
    with pytest.raises(DataError) as e:
        ensure(str(tmp_path / "absent"), "", "*.py", 200_000, say=pytest.fail)
    refusal(e, f"data.path={tmp_path / 'absent'}: no index.json there and data.prepare_from is empty",
            "python -m moefp8.data prepare --src DIR --out")
    assert snapshot(tmp_path) == before
