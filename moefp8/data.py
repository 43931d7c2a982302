"""Training data: tokenized shards, their preparation and a resumable loader.

`prepare` tokenizes text files with a tokenizer (`moefp8.tokenizer`: `bytes`, a BPE trained on
the same files, or a Hugging Face tokenizer.json) and writes a folder of shards and a manifest:

    out/index.json       {"format": "moefp8-tokens-v2", "vocab_size": 32768, "eos": 0, "dtype": "uint16",
                          "tokenizer": {"spec": "bpe:32768", "file": "tokenizer.json", "sha256": "..."},
                          "src": "stdlib", "glob": "*.py", "max_bytes": 32000000, "files": n, "bytes": n,
                          "tokens": n, "created": "2026-11-26T12:00:00Z",
                          "shards": [{"file": "shard_00000.bin", "tokens": n, "sha256": "..."}, ...]}
    out/shard_00000.bin  tokens as `dtype` (uint16 up to a vocabulary of 65536, else uint32; native
                         little-endian), read with np.memmap
    out/tokenizer.json   the tokenizer (not for bytes): the data carries what decodes it
    (indexes of format moefp8-bytes-v1, written before 2026-11-26, load as bytes in uint16)

    python -m moefp8.data prepare --src DIR --out DIR [--glob '*.txt'] [--max-bytes N] [--tokenizer bpe:32768]
    python -m moefp8.data prepare --src stdlib --out DIR   # the Python standard library's *.py sources
    python -m moefp8.data verify --path DIR                # every shard against its size and checksum

Nothing the user did not create is deleted or overwritten: `prepare` writes only into a folder
that is absent, empty, or an earlier output of `prepare` (its index.json and the files it lists,
nothing else); it builds in a fresh hidden folder beside `out` and renames it into place, and
removes an earlier output by the files its index lists. `ensure` (the training run's entry) never
prepares over data nor trains on data prepared from other settings (sources, patterns, size cap,
tokenizer) than the ones asked for, and checks every shard against its checksum (data.verify).

`Loader` cuts each shard into non-overlapping windows of seq_len + 1 tokens, shuffles the windows
of all shards once per epoch (seeded) and deals each step's global batch to the data-parallel
ranks: rank r of W takes windows [pos + r*B, pos + (r+1)*B) of the epoch's permutation. Its
position (epoch, pos) is the whole state: `state_dict()` / `load_state_dict()` resume exactly.
With `val_windows` > 0 that many windows, drawn once with a fixed seed (the same for every
train.seed, so runs of any seed are evaluated on the same text), are held out of training and
served by `val_batches()`. Every batch is checked against the vocabulary (a corrupt shard is
named, not a crash inside the embedding).
"""

import argparse
import hashlib
import json
import os
import shutil
import sys
import sysconfig
import tempfile
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from moefp8 import tokenizer as tokenizers
from moefp8.errors import UserError, first_line, report

EOS = 256  # the byte tokenizer's
VOCAB_SIZE = 257
FORMAT = "moefp8-tokens-v2"
FORMAT_V1 = "moefp8-bytes-v1"  # byte tokens in uint16, no "tokenizer", "dtype" optional: still read
DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
SHARD_TOKENS = 1 << 24  # 16M tokens (32 or 64 MB) per shard
READ_BYTES = 16 << 20  # text encoded per batch: the tokenizer's threads get many documents at once
VAL_SEED = 0x5EED  # picks the held-out windows; independent of train.seed
NAMED_SOURCES = ("stdlib", "site-packages")


class DataError(UserError):
    """The training data cannot be prepared or read; the message names the file or value and the fix."""


def encode(text: str | bytes) -> np.ndarray:
    b = text.encode("utf-8") if isinstance(text, str) else text
    return np.frombuffer(b, dtype=np.uint8).astype(np.uint16)


def decode(tokens) -> str:
    """Tokens -> text; EOS becomes a newline, bytes that are not valid UTF-8 become U+FFFD."""
    t = [int(x) for x in tokens]
    return bytes(x if x < 256 else 10 for x in t).decode("utf-8", errors="replace")


def source_dir(name: str) -> Path:
    """A prepare source: "stdlib" (the standard library's folder), "site-packages" (the folder of
    the installed packages torch is in: on a GPU machine the system's, with the CUDA build's
    sources and headers), or a folder path."""
    if name == "stdlib":
        return Path(sysconfig.get_paths()["stdlib"])
    if name == "site-packages":
        return Path(torch.__file__).parent.parent
    return Path(name)


def _split(s: str) -> list[str]:
    """"a, b,c" -> ["a", "b", "c"]: the comma-separated lists of --src and --glob."""
    return [x.strip() for x in s.split(",") if x.strip()]


# ---- prepare: which files, where the output may go, writing it, putting it in place ----

def _is_output(p: Path, out: Path) -> bool:
    """p (resolved) lies in `out` (resolved) or in one of its temporary folders (.out.*.prepare,
    .out.*.old: this or an interrupted earlier prepare's)."""
    if not p.is_relative_to(out.parent) or p == out.parent:
        return False
    top = p.relative_to(out.parent).parts[0]
    return top == out.name or (top.startswith(f".{out.name}.") and top.endswith((".prepare", ".old")))


def _walk(src_dir: Path, skip: set[str], out: Path):
    """The paths under src_dir (resolved), less those under a folder named in `skip` and those of
    the output `out` (resolved) when it lies inside src_dir."""
    inside = out.is_relative_to(src_dir)
    for p in src_dir.rglob("*"):
        if not skip & set(p.relative_to(src_dir).parts) and not (inside and _is_output(p, out)):
            yield p


def _census(paths: list[Path]) -> tuple[int, list[str]]:
    """(number of files among `paths`, their most common suffixes: [".txt (40)", ".md (3)"])."""
    files = [p for p in paths if p.is_file()]
    return len(files), [f"{s} ({n})" for s, n in Counter(p.suffix or "(no suffix)" for p in files).most_common(5)]


def find_files(src: str, glob: str, out: str) -> list[Path]:
    """The files `prepare` reads: those matching `glob` (comma-separated patterns, matched from the
    right as rglob does, so "sub/*.py" keeps its meaning) under each folder of `src` in turn, each
    folder's in sorted path order, each file once; never those of the output folder `out`."""
    patterns, out_dir = _split(glob), Path(out).resolve()
    files, seen, walked = [], set(), []
    for root in _split(src):
        src_dir = source_dir(root)
        if not src_dir.is_dir():
            raise DataError(f"data prepare: source folder {src_dir} does not exist; set data.prepare_from / --src "
                            f"to a folder of text files, 'stdlib' or 'site-packages'")
        skip = {"site-packages", "dist-packages"} if root == "stdlib" else set()  # installed packages are not stdlib
        paths = list(_walk(src_dir.resolve(), skip, out_dir))  # one walk of the tree for all the patterns
        found = {p for p in paths if any(p.match(g) for g in patterns) and p.is_file()}
        files += sorted(found - seen)
        seen |= found
        walked += paths
    if files:
        return files
    n, suffixes = _census(walked)
    if not n:
        raise DataError(f"data prepare: no file matches {glob!r} under {src}, which holds no files; set "
                        f"data.prepare_from / --src to a folder of text files")
    example = next((s.split(" ")[0] for s in suffixes if s.startswith(".")), ".txt")
    raise DataError(f"data prepare: no file matches {glob!r} under {src} (it holds {n} files: {', '.join(suffixes)}); "
                    f"set data.glob / --glob to match them, e.g. '*{example}'")


def _earlier_output(out: Path) -> list[str]:
    """The files of an earlier `prepare` output in `out` (index.json and the shards it lists that are
    there); [] for an absent or empty folder. DataError where out holds anything else."""
    if not out.exists():
        return []
    if not out.is_dir():
        raise DataError(f"data prepare: {out} is a file, not a folder; pick a new or empty folder")
    entries = sorted(os.listdir(out))
    try:
        ours = set(_listed_files(read_index(str(out)))) if entries else set()
    except DataError:  # no index of ours: nothing there was written by prepare
        ours = set()
    foreign = [e for e in entries if e not in ours or (out / e).is_symlink() or not (out / e).is_file()]
    if foreign:
        foreign.sort(key=lambda e: e == "index.json")  # name the user's file rather than an unreadable index
        raise DataError(f"data prepare: {out} is not empty and was not written by moefp8's prepare (it holds "
                        f"{len(entries)} entries, e.g. {foreign[0]}); pick a new or empty folder")
    return entries


def _docs(files: list[Path], max_bytes: int):
    """The bytes of `files` in order, the last one cut so that the total stays <= max_bytes."""
    total = 0
    for p in files:
        if total >= max_bytes:
            return
        data = p.read_bytes()[: max_bytes - total]
        total += len(data)
        yield data


def _batches(docs, size: int):
    """Lists of consecutive documents of about `size` bytes (at least one document each)."""
    batch, n = [], 0
    for d in docs:
        batch.append(d)
        n += len(d)
        if n >= size:
            yield batch
            batch, n = [], 0
    if batch:
        yield batch


def _progress(total_bytes: int, what: str):
    """A rich progress bar over bytes of text on a terminal (stderr); a no-op elsewhere (CI, logs)."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    p = Progress(TextColumn(what), BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn(),
                 transient=True, disable=not sys.stderr.isatty())
    return p, p.add_task(what, total=total_bytes)


def _write_shards(files: list[Path], dest: Path, max_bytes: int, shard_tokens: int, tok,
                  dtype: str) -> tuple[list[dict], int, int]:
    """Tokenizes `files` (each followed by EOS) with `tok` until max_bytes of text into
    dest/shard_NNNNN.bin of shard_tokens tokens of `dtype` (the last shorter). Returns (shard
    entries, files read, bytes read)."""
    shards, buf, n_buf, total, n_files = [], [], 0, 0, 0

    def flush():
        nonlocal buf, n_buf
        if n_buf:
            name, toks = f"shard_{len(shards):05d}.bin", np.concatenate(buf)
            toks.tofile(dest / name)
            shards.append({"file": name, "tokens": int(n_buf), "sha256": hashlib.sha256(toks).hexdigest()})
            buf, n_buf = [], 0

    size = min(max_bytes, sum(p.stat().st_size for p in files))
    bar, task = _progress(size, f"tokenizing ({tok.spec})")
    with bar:
        for batch in _batches(_docs(files, max_bytes), READ_BYTES):
            for toks in tok.encode_docs(batch):
                toks = toks.astype(DTYPES[dtype])  # ids < vocab_size, which dtype holds (prepare picks it)
                while len(toks):
                    take = toks[: shard_tokens - n_buf]
                    buf.append(take)
                    n_buf += len(take)
                    toks = toks[len(take):]
                    if n_buf == shard_tokens:
                        flush()
            n_files += len(batch)
            total += sum(len(d) for d in batch)
            bar.advance(task, sum(len(d) for d in batch))
    flush()
    return shards, n_files, total


def _prepared_meanwhile(out: Path, old_files: list[str], src: str, glob: str, max_bytes: int,
                        tokenizer: str) -> dict | None:
    """The index another process wrote into `out` while this one prepared the same data (two runs
    started at once on one data.path): the same settings, so theirs serves; DataError where they
    differ; None where `out` holds no index (not that race: something else is there)."""
    if old_files or not (out / "index.json").is_file():
        return None
    theirs = read_index(str(out))
    if not (_same_source(theirs, src, glob, max_bytes) and _same_tokenizer(theirs, tokenizer)):
        raise DataError(f"data.path={out}: another process prepared it from other settings "
                        f"({_settings(theirs.get('src'), theirs.get('glob'), theirs.get('max_bytes'))}, "
                        f"{tokenizers.describe(theirs)}) while this one prepared it; pick another data.path")
    return theirs


def _swap(new: Path, out: Path, old_files: list[str]) -> None:
    """Renames the folder `new` to `out` (absent, empty, or an earlier output whose files are
    old_files: renamed aside first, then only those files and the folder removed)."""
    if not old_files:
        os.replace(new, out)  # onto an empty folder too: POSIX rename replaces an empty directory
        return
    aside = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".old"))  # a unique name
    try:
        os.replace(out, aside)
    except OSError:
        aside.rmdir()
        raise
    try:
        os.replace(new, out)
    except OSError:
        os.replace(aside, out)
        raise
    for f in old_files:
        (aside / f).unlink(missing_ok=True)
    try:
        aside.rmdir()
    except OSError:  # someone wrote into out meanwhile: theirs, so the folder stays
        pass


def prepare(src: str, out: str, glob: str = "*.py", max_bytes: int = 32_000_000,
            shard_tokens: int = SHARD_TOKENS, tokenizer: str = tokenizers.BYTES) -> dict:
    """Tokenizes the files matching `glob` (one pattern, or several comma-separated: "*.py,*.h")
    under `src` (a folder, "stdlib": the Python standard library, "site-packages": the installed
    packages; several comma-separated, read in that order), each folder's files in sorted path
    order, each file followed by EOS, until max_bytes of text, with `tokenizer` (a spec of
    moefp8.tokenizer: "bytes", "bpe:N" trained on these files first, or a tokenizer.json path,
    copied into the output); writes shards and index.json into `out`, which must be absent, empty
    or an earlier output of prepare (replaced). Built in a fresh folder beside `out` (removed on
    failure), then renamed into place. Returns the index."""
    if max_bytes < 1 or shard_tokens < 1:
        raise DataError(f"data prepare: max_bytes={max_bytes}, shard_tokens={shard_tokens}: must be >= 1")
    kind, arg = tokenizers.parse_spec(tokenizer)
    given = tokenizers.HFTokenizer(arg, tokenizer) if kind == "file" else None  # a bad file: named before any work
    out_dir = Path(out).resolve()  # "." or a link to a folder: the folder itself, and its parent for the temp
    old_files = _earlier_output(out_dir)  # refuses a folder we did not write before reading anything
    files = find_files(src, glob, str(out_dir))
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    umask = os.umask(0)
    os.umask(umask)
    mode = out_dir.stat().st_mode & 0o7777 if out_dir.is_dir() else 0o777 & ~umask
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.", suffix=".prepare"))
    try:
        if kind == "bpe":
            tok = tokenizers.train_bpe(_docs(files, max_bytes), arg, tmp / "tokenizer.json")
        elif kind == "file":
            shutil.copyfile(given.path, tmp / "tokenizer.json")
            tok = tokenizers.HFTokenizer(tmp / "tokenizer.json", tokenizer)
        else:
            tok = tokenizers.ByteTokenizer()
        dtype = "uint16" if tok.vocab_size <= 1 << 16 else "uint32"
        shards, n_files, total = _write_shards(files, tmp, max_bytes, shard_tokens, tok, dtype)
        index = {"format": FORMAT, "vocab_size": tok.vocab_size, "eos": tok.eos, "dtype": dtype,
                 "tokenizer": {"spec": tokenizer, "file": None if kind == tokenizers.BYTES else "tokenizer.json",
                               "sha256": tok.digest},
                 "src": src, "glob": glob, "max_bytes": max_bytes, "files": n_files, "bytes": total,
                 "tokens": sum(s["tokens"] for s in shards),
                 "created": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), "shards": shards}
        (tmp / "index.json").write_text(json.dumps(index, indent=1))
        os.chmod(tmp, mode)  # mkdtemp's is 0o700
        try:
            _swap(tmp, out_dir, old_files)
        except OSError:  # out_dir is no longer absent or empty: did another process prepare it meanwhile?
            theirs = _prepared_meanwhile(out_dir, old_files, src, glob, max_bytes, tokenizer)
            if theirs is None:
                raise
            shutil.rmtree(tmp)
            return theirs
    except BaseException:
        if tmp.exists():  # made above: ours to remove
            shutil.rmtree(tmp)
        raise
    return index


# ---- reading: the index, the shards, the training run's entry ----

def _plain_name(f) -> bool:
    """A file name in the folder itself: never a path out of it."""
    return isinstance(f, str) and f not in ("", ".", "..") and Path(f).name == f


def read_index(path: str) -> dict:
    """The index.json (the manifest) of a prepared folder, checked: DataError (naming the file and
    the fix) for a missing, unparsable or foreign index, or one that lists no shard or a malformed
    one, or whose totals disagree with its shards. An index of FORMAT_V1 is returned as its v2
    equivalent (bytes, uint16)."""
    index_path = Path(path) / "index.json"
    if not index_path.is_file():
        raise DataError(f"data: {index_path} not found; prepare the folder with "
                        f"`python -m moefp8.data prepare --src DIR --out {path}` (or set data.prepare_from)")
    again = "prepare the data again into a new folder"
    try:
        index = json.loads(index_path.read_bytes())
    except ValueError as e:  # JSONDecodeError (its message has the line and column), UnicodeDecodeError
        raise DataError(f"data: {index_path} is not valid JSON ({first_line(e)}): it looks interrupted or "
                        f"edited; {again}") from None
    fmt = index.get("format") if isinstance(index, dict) else None
    if fmt == FORMAT_V1:
        index = {**index, "format": FORMAT, "dtype": index.get("dtype", "uint16"),
                 "tokenizer": {"spec": tokenizers.BYTES, "file": None, "sha256": tokenizers.BYTES}}
    if fmt not in (FORMAT, FORMAT_V1):
        raise DataError(f"data: {index_path} has format {fmt!r}, expected {FORMAT!r}; {again}")
    if not isinstance(index.get("shards"), list) or not index["shards"]:
        raise DataError(f"data: {index_path} lists no shard; {again}")
    for i, s in enumerate(index["shards"]):
        if not (isinstance(s, dict) and _plain_name(s.get("file")) and isinstance(s.get("tokens"), int)
                and s["tokens"] >= 0):
            raise DataError(f"data: {index_path} has a malformed shard entry ({i}): it looks edited; {again}")
    if not isinstance(index.get("vocab_size"), int):
        raise DataError(f"data: {index_path} has vocab_size {index.get('vocab_size')!r}, not a number; {again}")
    if index.get("dtype") not in DTYPES:
        raise DataError(f"data: {index_path} has dtype {index.get('dtype')!r}, expected one of "
                        f"{', '.join(DTYPES)}; {again}")
    if index["vocab_size"] > np.iinfo(DTYPES[index["dtype"]]).max + 1:
        raise DataError(f"data: {index_path} has a vocabulary of {index['vocab_size']} that does not fit its dtype "
                        f"{index['dtype']}; it looks edited; {again}")
    t = index.get("tokenizer")
    if not (isinstance(t, dict) and isinstance(t.get("spec"), str) and (t.get("file") is None or _plain_name(t["file"]))):
        raise DataError(f"data: {index_path} has a malformed tokenizer entry ({t!r}); {again}")
    listed = sum(s["tokens"] for s in index["shards"])
    if index.get("tokens", listed) != listed:
        raise DataError(f"data: {index_path} says {index['tokens']} tokens but its shards list {listed}: it looks "
                        f"edited; {again}")
    return index


def _listed_files(index: dict) -> list[str]:
    """The files of a prepared folder by its index: index.json, the shards, the tokenizer's file."""
    return ["index.json", *(s["file"] for s in index["shards"]), *filter(None, [index["tokenizer"]["file"]])]


def load_shards(path: str, index: dict | None = None) -> list[np.ndarray]:
    """The shards of a prepared folder (`index`: its read_index, read here if None) as read-only
    memmaps of the index's dtype; DataError (naming the file) for a missing, empty or truncated
    shard, or one of another dtype than the index's."""
    index = read_index(path) if index is None else index
    index_path = Path(path) / "index.json"
    dtype = DTYPES[index["dtype"]]
    out = []
    for s in index["shards"]:
        f = Path(path) / s["file"]
        if not f.is_file():
            raise DataError(f"data: shard {f} listed in {index_path} is missing; prepare the data again")
        size, want = f.stat().st_size, np.dtype(dtype).itemsize * s["tokens"]
        if size == 0:
            raise DataError(f"data: shard {f} is empty (index.json says {s['tokens']} tokens); prepare the data again")
        other = next((n for n, d in DTYPES.items() if d != dtype and np.dtype(d).itemsize * s["tokens"] == size), None)
        if other:
            raise DataError(f"data: shard {f} has {size} bytes: {s['tokens']} tokens of {other}, but index.json says "
                            f"{index['dtype']}; the shard and the manifest come from different preparations: "
                            f"prepare the folder again")
        if size != want:
            raise DataError(f"data: shard {f} has {size} bytes, index.json says {s['tokens']} tokens of "
                            f"{index['dtype']} ({want} bytes): truncated or rewritten; prepare the folder again")
        out.append(np.memmap(f, dtype=dtype, mode="r"))
    return out


def verify(path: str, index: dict | None = None) -> dict:
    """Every shard of a prepared folder against the manifest: sizes (load_shards), then each
    file's sha256 (~1 GB/s; shards of indexes before 2026-11 have none and are only sized), and
    the tokenizer file's. DataError naming the first file that does not match. Returns the index."""
    index = read_index(path) if index is None else index
    load_shards(path, index)
    for s in index["shards"]:
        if s.get("sha256") and _sha256(Path(path) / s["file"]) != s["sha256"]:
            raise DataError(f"data: shard {Path(path) / s['file']} does not match its checksum in "
                            f"{Path(path) / 'index.json'}: it was changed after preparation; prepare the data again "
                            f"into a new folder")
    t = index["tokenizer"]
    if t["file"]:
        f = Path(path) / t["file"]
        if not f.is_file() or _sha256(f) != t.get("sha256"):
            raise DataError(f"data: tokenizer {f} is {'changed' if f.is_file() else 'missing'}: it no longer "
                            f"matches {Path(path) / 'index.json'}; prepare the data again into a new folder")
    return index


def _sha256(f: Path) -> str:
    h = hashlib.sha256()
    with open(f, "rb") as fh:
        while chunk := fh.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def _settings(src, glob, max_bytes) -> str:
    """"'stdlib' (*.py, max_bytes=32000000)": what data was prepared from, for messages."""
    return f"{src!r} ({glob}" + (f", max_bytes={max_bytes})" if max_bytes is not None else ")")


def _same_source(index: dict, prepare_from: str, glob: str, max_bytes: int) -> bool:
    """Whether `index` was prepared from these settings: the same sources in the same order (folders
    compared by real path), the same patterns in any order, and max_bytes where it was recorded."""
    def roots(src):
        return [r if r in NAMED_SOURCES else os.path.realpath(r) for r in _split(src or "")]
    return (roots(index.get("src")) == roots(prepare_from) and set(_split(index.get("glob") or "")) == set(_split(glob))
            and index.get("max_bytes", max_bytes) == max_bytes)


def data_id(index: dict) -> str:
    """What the data is, whatever folder holds it: the shards' names, sizes and (recorded since
    2026-11) checksums. A checkpoint keeps it (a resume on other data is refused); the nodes of a
    run compare theirs (a copy per node is fine, other data is not)."""
    return hashlib.sha256(json.dumps([[s["file"], s["tokens"], s.get("sha256")]
                                      for s in index["shards"]]).encode()).hexdigest()[:16]


def folder_data_id(path) -> str | None:
    """data_id of the prepared folder `path`; None where it has no readable index."""
    try:
        return data_id(read_index(str(path)))
    except DataError:
        return None


def _same_tokenizer(index: dict, spec: str) -> bool:
    """Whether `index` was tokenized with `spec`: the same spec for bytes and bpe:N; for a file,
    the same tokenizer.json content (sha256), wherever it lies now."""
    kind, arg = tokenizers.parse_spec(spec)
    if kind != "file":
        return index["tokenizer"]["spec"] == spec
    return tokenizers.HFTokenizer(arg, spec).digest == index["tokenizer"].get("sha256")


def ensure(path: str, prepare_from: str, glob: str, max_bytes: int, say=print, *, tokenizer: str = tokenizers.BYTES,
           check: bool = True) -> dict:
    """The index of data.path, prepared first (telling `say` one line) if it has none; what the
    training run calls on rank 0 before reading data. DataError where `path` holds data prepared from
    other settings than prepare_from/glob/max_bytes (prepare_from "": whatever it holds is used),
    tokenized with another tokenizer, holds files of the user's, or has no data and prepare_from is
    "". check: every shard against its checksum (`verify`)."""
    if (Path(path) / "index.json").exists():
        index = read_index(path)
        if prepare_from and not _same_source(index, prepare_from, glob, max_bytes):
            raise DataError(f"data.path={path} holds data prepared from "
                            f"{_settings(index.get('src'), index.get('glob'), index.get('max_bytes'))}, not from "
                            f"data.prepare_from={_settings(prepare_from, glob, max_bytes)}: pick a new data.path for "
                            f"it, or data.prepare_from='' to train on what {path} holds")
        if not _same_tokenizer(index, tokenizer):
            held = tokenizers.describe(index)
            raise DataError(f"data.path={path} holds tokens of {held}, not of data.tokenizer={tokenizer}: set "
                            f"data.tokenizer={index['tokenizer']['spec']} to train on them, or pick a new data.path "
                            f"to prepare the texts with {tokenizer}")
        return verify(path, index) if check else index
    if not prepare_from:
        raise DataError(f"data.path={path}: no index.json there and data.prepare_from is empty; set "
                        f"data.prepare_from=DIR (a folder of texts, or 'stdlib') or run "
                        f"`python -m moefp8.data prepare --src DIR --out {path}`")
    if Path(path).is_dir() and any(Path(path).iterdir()):
        raise DataError(f"data.path={path} holds files moefp8 did not write and no index.json; to train on the "
                        f"texts in {path}: data.prepare_from={path} data.path=<a new folder>")
    say(f"data: preparing {path} from {prepare_from!r} ({glob}, <= {max_bytes / 1e6:.0f} MB, tokenizer {tokenizer})")
    return prepare(prepare_from, path, glob, max_bytes, tokenizer=tokenizer)


class Loader:
    """(x, y) int64 batches [B, seq_len] (y = x shifted by one) for data-parallel rank `rank` of
    `world`; deterministic in (seed, rank, world, position). `val_windows` windows are held out.
    vocab_size (the model's embedding rows; None: not checked): the index's vocabulary must fit in it.
    Every batch served is checked: a token id >= the index's vocab_size is a DataError naming the
    shard and the token's offset in it."""

    def __init__(self, path: str, batch: int, seq_len: int, rank: int = 0, world: int = 1, seed: int = 0,
                 val_windows: int = 0, vocab_size: int | None = None):
        if not 0 <= rank < world:
            raise ValueError(f"data loader: rank {rank} not in a world of {world}")
        index = read_index(path)
        self.vocab = index["vocab_size"]  # every token id served is below it (and so below vocab_size)
        self.tokenizer = index["tokenizer"]["spec"]
        if vocab_size is not None and self.vocab > vocab_size:
            raise DataError(f"data.path={path}: its tokens ({tokenizers.describe(index)}) need a vocabulary of "
                            f"{self.vocab} (index.json), more than model.vocab_size={vocab_size}: set "
                            f"model.vocab_size >= {self.vocab}")
        self.files = [Path(path) / s["file"] for s in index["shards"]]  # named in errors
        self.data_id = data_id(index)
        self.path = path
        self.shards = load_shards(path, index)
        self.batch, self.seq_len, self.rank, self.world, self.seed = batch, seq_len, rank, world, seed
        w = seq_len + 1
        # window i of shard s starts at token i * seq_len (windows share one token: the last target)
        counts = [max(0, (len(s) - 1) // seq_len) for s in self.shards]
        self.win_shard = np.repeat(np.arange(len(counts)), counts)
        self.win_start = np.concatenate([np.arange(c, dtype=np.int64) * seq_len for c in counts])
        n_all = len(self.win_start)
        if val_windows and not batch * world <= val_windows <= n_all // 2:
            raise DataError(f"data.val_windows={val_windows}: must be between one global batch ({batch} x {world} "
                             f"ranks) and half of the {n_all} windows of {w} tokens in {path}")
        held = (torch.randperm(n_all, generator=torch.Generator().manual_seed(VAL_SEED)).numpy()[:val_windows]
                if val_windows else np.zeros(0, dtype=np.int64))
        keep = np.ones(n_all, dtype=bool)
        keep[held] = False
        self.val_ids, self.train_ids = np.sort(held), np.flatnonzero(keep)  # window indices
        self.n_windows = len(self.train_ids)
        if self.n_windows < batch * world:
            raise DataError(f"data: {path} holds {self.n_windows} windows of {w} tokens, fewer than one global "
                             f"batch ({batch} x {world} ranks)")
        self.epoch, self.pos = 0, 0
        self._perm_epoch, self._perm = -1, None

    def steps_per_epoch(self, grad_accum: int = 1) -> int:
        """Optimizer steps of grad_accum micro-batches that read no window twice: the ranks move to
        the next epoch together when a micro-batch of all of them no longer fits."""
        return self.n_windows // (self.batch * self.world) // grad_accum

    def _permutation(self) -> np.ndarray:
        if self._perm_epoch != self.epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
            self._perm = self.train_ids[torch.randperm(self.n_windows, generator=g).numpy()]
            self._perm_epoch = self.epoch
        return self._perm

    def _rows(self, ids: np.ndarray) -> tuple[Tensor, Tensor]:
        rows = np.stack([self.shards[self.win_shard[i]][self.win_start[i]: self.win_start[i] + self.seq_len + 1]
                         for i in ids])  # [B, seq_len + 1] uint16 | uint32
        if rows.size and rows.max() >= self.vocab:  # one max per batch: a corrupt shard, not a crash in the embedding
            r, c = np.argwhere(rows >= self.vocab)[0]
            raise DataError(f"data: shard {self.files[self.win_shard[ids[r]]]} holds token id {rows[r, c]} at token "
                            f"{self.win_start[ids[r]] + c}, outside the vocabulary of {self.vocab} (index.json): "
                            f"the shard is corrupt; prepare the data again into a new folder")
        t = torch.from_numpy(rows.astype(np.int64))
        return t[:, :-1], t[:, 1:]

    def next(self) -> tuple[Tensor, Tensor]:
        per_step = self.batch * self.world
        if self.pos + per_step > self.n_windows:  # drop the epoch's remainder: every rank moves on together
            self.epoch, self.pos = self.epoch + 1, 0
        ids = self._permutation()[self.pos + self.rank * self.batch: self.pos + (self.rank + 1) * self.batch]
        self.pos += per_step
        return self._rows(ids)

    def val_batches(self):
        """This rank's share of the held-out windows as (x, y) batches, in whole global batches (every
        rank gets the same number; a remainder of fewer than batch x world windows is left out)."""
        g = self.batch * self.world
        for i in range(len(self.val_ids) // g):
            yield self._rows(self.val_ids[i * g + self.rank * self.batch: i * g + (self.rank + 1) * self.batch])

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos, "seed": self.seed, "world": self.world,
                "seq_len": self.seq_len, "batch": self.batch, "val_windows": len(self.val_ids),
                "data_id": self.data_id}

    def load_state_dict(self, sd: dict) -> None:
        mine = {"seed": self.seed, "seq_len": self.seq_len, "global batch": self.batch * self.world,
                "data.val_windows": len(self.val_ids)}
        theirs = {"seed": sd["seed"], "seq_len": sd["seq_len"], "global batch": sd["batch"] * sd["world"],
                  "data.val_windows": sd.get("val_windows", 0)}
        for k in mine:  # the position counts windows of the global batch: ranks x batch may be re-split
            if mine[k] != theirs[k]:
                raise ValueError(f"data loader: the checkpoint was taken with {k}={theirs[k]}, this run has "
                                 f"{k}={mine[k]}; the position would not mean the same tokens")
        if sd.get("data_id", self.data_id) != self.data_id:  # (checkpoints before 2026-11 have none)
            raise ValueError(f"data loader: the checkpoint was trained on other data (id {sd['data_id']}) than "
                             f"data.path={self.path} holds (id {self.data_id}); resume with the data.path it was "
                             f"trained on (the run dir's config.yaml names it), or start a new train.out_dir")
        self.epoch, self.pos = int(sd["epoch"]), int(sd["pos"])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m moefp8.data", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="tokenize a folder of text into shards + index.json")
    p.add_argument("--src", required=True, help="folder of text files, 'stdlib' or 'site-packages'; several "
                   "comma-separated")
    p.add_argument("--out", required=True)
    p.add_argument("--glob", default="*.py", help="file pattern; several comma-separated: '*.py,*.h'")
    p.add_argument("--max-bytes", type=int, default=32_000_000)
    p.add_argument("--tokenizer", default=tokenizers.BYTES, help="bytes | bpe:N (a BPE of N tokens trained on "
                   "these files) | PATH of a tokenizer.json")
    v = sub.add_parser("verify", help="check every shard of a prepared folder against index.json")
    v.add_argument("--path", required=True)
    a = ap.parse_args(argv)
    try:
        if a.cmd == "verify":
            idx = verify(a.path)
            print(f"{a.path}: {len(idx['shards'])} shard(s), {sum(s['tokens'] for s in idx['shards'])} tokens of "
                  f"{tokenizers.describe(idx)}: all match index.json")
            return
        idx = prepare(a.src, a.out, a.glob, a.max_bytes, tokenizer=a.tokenizer)
    except UserError as e:  # DataError, TokenizerError
        report(f"error: {e}")  # one line on stderr, exit status 1
    print(f"{a.out}: {idx['files']} files, {idx['bytes']} bytes -> {idx['tokens']} tokens of {a.tokenizer} "
          f"(vocabulary {idx['vocab_size']}, {idx['dtype']}), {len(idx['shards'])} shard(s)")


if __name__ == "__main__":
    main()
