"""Byte-level training data: a tokenizer, shard preparation and a resumable loader.

Tokens are the bytes of the text (0..255) and EOS = 256 between documents: no vocabulary file,
no download. `prepare` writes a folder of shards:

    out/index.json       {"format": "moefp8-bytes-v1", "vocab_size": 257, "eos": 256, "dtype": "uint16",
                          "shards": [{"file": "shard_00000.bin", "tokens": n}, ...], ...}
    out/shard_00000.bin  uint16 tokens (native little-endian), read with np.memmap

    python -m moefp8.data prepare --src DIR --out DIR [--glob '*.txt'] [--max-bytes N]
    python -m moefp8.data prepare --src stdlib --out DIR   # the Python standard library's *.py sources

`Loader` cuts each shard into non-overlapping windows of seq_len + 1 tokens, shuffles the windows
of all shards once per epoch (seeded) and deals each step's global batch to the data-parallel
ranks: rank r of W takes windows [pos + r*B, pos + (r+1)*B) of the epoch's permutation. Its
position (epoch, pos) is the whole state: `state_dict()` / `load_state_dict()` resume exactly.
With `val_windows` > 0 that many windows, drawn once with a fixed seed (the same for every
train.seed, so runs of any seed are evaluated on the same text), are held out of training and
served by `val_batches()`.
"""

import argparse
import json
import os
import shutil
import sysconfig
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

EOS = 256
VOCAB_SIZE = 257
FORMAT = "moefp8-bytes-v1"
SHARD_TOKENS = 1 << 24  # 16M tokens (32 MB) per shard
VAL_SEED = 0x5EED  # picks the held-out windows; independent of train.seed


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


def prepare(src: str, out: str, glob: str = "*.py", max_bytes: int = 32_000_000,
            shard_tokens: int = SHARD_TOKENS) -> dict:
    """Tokenizes the files matching `glob` (one pattern, or several comma-separated: "*.py,*.h")
    under `src` (a folder, "stdlib": the Python standard library, "site-packages": the installed
    packages; several comma-separated, read in that order), each folder's files in sorted path order, each file followed by EOS, until
    max_bytes of text; writes shards and index.json into `out` atomically (built in out.tmp, then
    renamed). Returns the index."""
    patterns = [g.strip() for g in glob.split(",") if g.strip()]
    files, seen = [], set()
    for root in [r.strip() for r in src.split(",") if r.strip()]:
        src_dir = source_dir(root)
        if not src_dir.is_dir():
            raise FileNotFoundError(f"data prepare: source folder {src_dir} does not exist")
        skip = {"site-packages", "dist-packages"} if root == "stdlib" else set()  # installed packages are not stdlib
        # one walk of the tree for all the patterns (rglob per pattern walked it once each); match()
        # matches from the right as rglob does, so "sub/*.py" keeps its meaning
        found = {p for p in src_dir.rglob("*") if any(p.match(g) for g in patterns)
                 and p.is_file() and not skip & set(p.relative_to(src_dir).parts)}
        files += sorted(found - seen)
        seen |= found
    if not files:
        raise ValueError(f"data prepare: no file matches {glob!r} under {src}")
    out_dir, tmp = Path(out), Path(str(out) + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shards, buf, n_buf, total, n_files = [], [], 0, 0, 0

    def flush():
        nonlocal buf, n_buf
        if n_buf:
            name = f"shard_{len(shards):05d}.bin"
            np.concatenate(buf).tofile(tmp / name)
            shards.append({"file": name, "tokens": int(n_buf)})
            buf, n_buf = [], 0

    for p in files:
        if total >= max_bytes:
            break
        data = p.read_bytes()[: max_bytes - total]
        toks = np.append(encode(data), np.uint16(EOS))
        total, n_files = total + len(data), n_files + 1
        while len(toks):
            take = toks[: shard_tokens - n_buf]
            buf.append(take)
            n_buf += len(take)
            toks = toks[len(take):]
            if n_buf == shard_tokens:
                flush()
    flush()
    index = {"format": FORMAT, "vocab_size": VOCAB_SIZE, "eos": EOS, "dtype": "uint16", "src": src,
             "glob": glob, "files": n_files, "bytes": total, "shards": shards}
    (tmp / "index.json").write_text(json.dumps(index, indent=1))
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    return index


def load_shards(path: str) -> list[np.ndarray]:
    """The shards of a prepared folder as read-only memmaps; clear errors (naming the file) for a
    missing index, a missing, empty or truncated shard."""
    index_path = Path(path) / "index.json"
    if not index_path.is_file():
        raise FileNotFoundError(f"data: {index_path} not found; prepare the folder with "
                                f"`python -m moefp8.data prepare --src DIR --out {path}`")
    index = json.loads(index_path.read_text())
    if index.get("format") != FORMAT:
        raise ValueError(f"data: {index_path} has format {index.get('format')!r}, expected {FORMAT!r}")
    if not index["shards"]:
        raise ValueError(f"data: {index_path} lists no shard")
    out = []
    for s in index["shards"]:
        f = Path(path) / s["file"]
        if not f.is_file():
            raise FileNotFoundError(f"data: shard {f} listed in {index_path} is missing")
        size, want = f.stat().st_size, 2 * s["tokens"]
        if size == 0:
            raise ValueError(f"data: shard {f} is empty (index.json says {s['tokens']} tokens)")
        if size != want:
            raise ValueError(f"data: shard {f} has {size} bytes, index.json says {s['tokens']} tokens "
                             f"({want} bytes): truncated or rewritten; prepare the folder again")
        out.append(np.memmap(f, dtype=np.uint16, mode="r"))
    return out


class Loader:
    """(x, y) int64 batches [B, seq_len] (y = x shifted by one) for data-parallel rank `rank` of
    `world`; deterministic in (seed, rank, world, position). `val_windows` windows are held out."""

    def __init__(self, path: str, batch: int, seq_len: int, rank: int = 0, world: int = 1, seed: int = 0,
                 val_windows: int = 0):
        if not 0 <= rank < world:
            raise ValueError(f"data loader: rank {rank} not in a world of {world}")
        self.shards = load_shards(path)
        self.batch, self.seq_len, self.rank, self.world, self.seed = batch, seq_len, rank, world, seed
        w = seq_len + 1
        # window i of shard s starts at token i * seq_len (windows share one token: the last target)
        counts = [max(0, (len(s) - 1) // seq_len) for s in self.shards]
        self.win_shard = np.repeat(np.arange(len(counts)), counts)
        self.win_start = np.concatenate([np.arange(c, dtype=np.int64) * seq_len for c in counts])
        n_all = len(self.win_start)
        if val_windows and not batch * world <= val_windows <= n_all // 2:
            raise ValueError(f"data.val_windows={val_windows}: must be between one global batch ({batch} x {world} "
                             f"ranks) and half of the {n_all} windows of {w} tokens in {path}")
        held = (torch.randperm(n_all, generator=torch.Generator().manual_seed(VAL_SEED)).numpy()[:val_windows]
                if val_windows else np.zeros(0, dtype=np.int64))
        keep = np.ones(n_all, dtype=bool)
        keep[held] = False
        self.val_ids, self.train_ids = np.sort(held), np.flatnonzero(keep)  # window indices
        self.n_windows = len(self.train_ids)
        if self.n_windows < batch * world:
            raise ValueError(f"data: {path} holds {self.n_windows} windows of {w} tokens, fewer than one global "
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
                         for i in ids]).astype(np.int64)
        t = torch.from_numpy(rows)
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
                "seq_len": self.seq_len, "batch": self.batch, "val_windows": len(self.val_ids)}

    def load_state_dict(self, sd: dict) -> None:
        mine = {"seed": self.seed, "seq_len": self.seq_len, "global batch": self.batch * self.world,
                "data.val_windows": len(self.val_ids)}
        theirs = {"seed": sd["seed"], "seq_len": sd["seq_len"], "global batch": sd["batch"] * sd["world"],
                  "data.val_windows": sd.get("val_windows", 0)}
        for k in mine:  # the position counts windows of the global batch: ranks x batch may be re-split
            if mine[k] != theirs[k]:
                raise ValueError(f"data loader: the checkpoint was taken with {k}={theirs[k]}, this run has "
                                 f"{k}={mine[k]}; the position would not mean the same tokens")
        self.epoch, self.pos = int(sd["epoch"]), int(sd["pos"])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m moefp8.data", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="tokenize a folder of text into uint16 shards + index.json")
    p.add_argument("--src", required=True, help="folder of text files, 'stdlib' or 'site-packages'; several "
                   "comma-separated")
    p.add_argument("--out", required=True)
    p.add_argument("--glob", default="*.py", help="file pattern; several comma-separated: '*.py,*.h'")
    p.add_argument("--max-bytes", type=int, default=32_000_000)
    a = ap.parse_args(argv)
    idx = prepare(a.src, a.out, a.glob, a.max_bytes)
    print(f"{a.out}: {idx['files']} files, {idx['bytes']} bytes, {len(idx['shards'])} shard(s)")


if __name__ == "__main__":
    main()
