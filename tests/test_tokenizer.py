"""moefp8/tokenizer.py and the data pipeline with subword tokenizers: BPE training on the standard
library (nothing downloads), tokenizer files, uint16/uint32 shards, the manifest's checks, and
one-line errors for every bad input the issue lists."""

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tokenizers")

from moefp8 import tokenizer as tk  # noqa: E402
from moefp8.hydra_config import load_config  # noqa: E402
from moefp8.data import DataError, Loader, ensure, load_shards, main, prepare, read_index, verify  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
STDLIB = Path(sysconfig.get_paths()["stdlib"])


def one_line(e: pytest.ExceptionInfo, *words: str) -> str:
    msg = str(e.value)
    assert "\n" not in msg, msg
    for w in words:
        assert w in msg, (w, msg)
    return msg


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    """~400 KB of the standard library's sources, some non-ASCII, one file not valid UTF-8."""
    d = tmp_path_factory.mktemp("src")
    n = 0
    for i, f in enumerate(sorted(STDLIB.glob("*.py"))):
        b = f.read_bytes()
        (d / f"{i:03d}.txt").write_bytes(b)
        n += len(b)
        if n > 400_000:
            break
    (d / "zz_unicode.txt").write_text("grüße, 東京, naïve café; x = 12345\n" * 20)
    (d / "zz_latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    return d


@pytest.fixture(scope="module")
def bpe(src, tmp_path_factory):
    """A BPE of 512 tokens prepared from `src`."""
    out = tmp_path_factory.mktemp("bpe") / "d"
    prepare(str(src), str(out), glob="*.txt", tokenizer="bpe:512", shard_tokens=50_000)
    return out


def docs_of(src: Path) -> list[bytes]:
    return [p.read_bytes() for p in sorted(src.glob("*.txt"))]


def split_docs(tokens: np.ndarray, eos: int) -> list[np.ndarray]:
    ends = np.flatnonzero(tokens == eos)
    return [tokens[a + 1 if i else 0: b] for i, (a, b) in enumerate(zip(np.r_[-1, ends[:-1]], ends))]


# ---- specs and tokenizer files ----

@pytest.mark.parametrize("spec, words", [("bpe:abc", "bpe:N needs a vocabulary size N >= 384"),
                                         ("bpe:100", "bpe:N needs a vocabulary size N >= 384"),
                                         ("bpe:", "e.g. bpe:32768")])
def test_malformed_bpe_spec(spec, words):
    with pytest.raises(tk.TokenizerError) as e:
        tk.parse_spec(spec)
    one_line(e, f"data.tokenizer={spec}", words)


def test_spec_kinds():
    assert tk.parse_spec("bytes") == ("bytes", None)
    assert tk.parse_spec("bpe:32768") == ("bpe", 32768)
    assert tk.parse_spec("/x/tokenizer.json") == ("file", "/x/tokenizer.json")


def test_bpe_training_is_deterministic_and_round_trips(src, tmp_path):
    docs = docs_of(src)
    a = tk.train_bpe(docs, 600, tmp_path / "a.json")
    b = tk.train_bpe(docs, 600, tmp_path / "b.json")
    assert a.digest == b.digest and a.vocab_size == 600 and a.tok.id_to_token(a.eos) == tk.EOS_TOKEN
    for d, ids in zip(docs, a.encode_docs(docs)):
        assert ids[-1] == a.eos and a.eos not in ids[:-1]
        assert a.decode(ids[:-1]) == d.decode("utf-8", errors="replace")  # lossless but for invalid UTF-8
    assert a.decode(a.encode_docs([b"x = 12345"])[0][:-1]) == "x = 12345"
    digits = [a.tok.id_to_token(int(i)) for i in a.encode_docs([b"12345"])[0][:-1]]
    assert digits == list("12345")  # digits one by one


@pytest.mark.parametrize("content, words", [
    (None, "not found; give the path of a tokenizer.json"),
    (b"{not json", "is not a Hugging Face tokenizer.json ("),
    (b'{"version": "1.0"}', "is not a Hugging Face tokenizer.json ("),
])
def test_bad_tokenizer_file_is_one_line(tmp_path, texts_dir, content, words):
    f = tmp_path / "tok" / "tokenizer.json"
    if content is not None:
        f.parent.mkdir()
        f.write_bytes(content)
    with pytest.raises(tk.TokenizerError) as e:
        prepare(str(texts_dir), str(tmp_path / "out"), glob="*.txt", tokenizer=str(f))
    one_line(e, f"data.tokenizer={f}", words)
    assert not (tmp_path / "out").exists()


def word_level(path: Path, n: int, eos: str | None = tk.EOS_TOKEN) -> Path:
    """A tokenizer.json of n tokens (a word-level vocabulary: "w0".."wN", "[UNK]", eos)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **({eos: 1} if eos else {}), **{f"w{i}": i + 2 for i in range(n - 2)}}
    t = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path.write_text(t.to_str())
    return path


def test_tokenizer_without_eos_is_one_line(tmp_path, texts_dir):
    f = word_level(tmp_path / "t.json", 50, eos=None)
    with pytest.raises(tk.TokenizerError) as e:
        prepare(str(texts_dir), str(tmp_path / "out"), glob="*.txt", tokenizer=str(f))
    one_line(e, "defines none of the end-of-document tokens", "add one as a special token")


@pytest.fixture
def texts_dir(tmp_path):
    d = tmp_path / "texts"
    d.mkdir()
    (d / "a.txt").write_text(" ".join(f"w{i % 70000}" for i in range(0, 140000, 7)))
    (d / "b.txt").write_text("w1 w2 unknown w69999\n" * 100)
    return d


# ---- prepare and load ----

def test_prepare_with_bpe_writes_the_manifest_and_decodes_to_the_text(bpe, src):
    idx = read_index(str(bpe))
    assert idx["format"] == "moefp8-tokens-v2" and idx["dtype"] == "uint16" and idx["vocab_size"] == 512
    t = idx["tokenizer"]
    assert t["spec"] == "bpe:512" and t["file"] == "tokenizer.json"
    assert t["sha256"] == tk.HFTokenizer(bpe / "tokenizer.json").digest
    tokens = np.concatenate(load_shards(str(bpe)))
    assert idx["tokens"] == len(tokens) == sum(s["tokens"] for s in idx["shards"]) and len(idx["shards"]) > 1
    assert len(tokens) < idx["bytes"] / 2  # subwords: fewer tokens than bytes
    tok = tk.load("bpe:512", bpe)
    texts = [tok.decode(d) for d in split_docs(tokens, idx["eos"])]
    assert texts == [d.decode("utf-8", errors="replace") for d in docs_of(src)]
    assert verify(str(bpe)) == idx


def test_a_tokenizer_file_is_copied_and_a_large_vocabulary_takes_uint32(tmp_path, texts_dir):
    f = word_level(tmp_path / "big.json", 70_002)
    out = tmp_path / "out"
    idx = prepare(str(texts_dir), str(out), glob="*.txt", tokenizer=str(f))
    assert idx["dtype"] == "uint32" and idx["vocab_size"] == 70_002 and idx["eos"] == 1
    assert (out / "tokenizer.json").read_bytes() == f.read_bytes() and idx["tokenizer"]["spec"] == str(f)
    tokens = np.concatenate(load_shards(str(out)))
    assert tokens.dtype == np.uint32 and tokens.max() == 69_999 + 2  # "w69999"
    loader = Loader(str(out), 2, 16, vocab_size=70_002)
    x, y = loader.next()
    assert x.shape == (2, 16) and int(x.max()) < 70_002
    with pytest.raises(DataError) as e:
        Loader(str(out), 2, 16, vocab_size=32_000)  # the model's vocabulary is smaller than the data's
    one_line(e, "need a vocabulary of 70002 (index.json), more than model.vocab_size=32000",
             "set model.vocab_size >= 70002")
    # the same file elsewhere is the same tokenizer; another file is not
    g = tmp_path / "copy.json"
    g.write_bytes(f.read_bytes())
    assert ensure(str(out), "", "*.txt", 1, say=pytest.fail, tokenizer=str(g))["dtype"] == "uint32"
    with pytest.raises(DataError) as e:
        ensure(str(out), "", "*.txt", 1, say=pytest.fail, tokenizer=str(word_level(tmp_path / "o.json", 100)))
    one_line(e, f"data.path={out} holds tokens of {f} (sha256 ", f"set data.tokenizer={f} to train on them")


def test_reprepare_replaces_the_tokenizer_too(bpe, src, tmp_path):
    out = tmp_path / "d"
    prepare(str(src), str(out), glob="*.txt", tokenizer="bpe:400", max_bytes=50_000)
    prepare(str(src), str(out), glob="*.txt", max_bytes=50_000)  # bytes: no tokenizer file
    assert sorted(p.name for p in out.iterdir()) == ["index.json", "shard_00000.bin"]


def test_shard_of_the_wrong_dtype_is_named(bpe, tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    for p in bpe.iterdir():
        (d / p.name).write_bytes(p.read_bytes())
    shard = d / "shard_00000.bin"
    np.fromfile(shard, dtype=np.uint16).astype(np.uint32).tofile(shard)  # another tool's uint32 tokens
    with pytest.raises(DataError) as e:
        Loader(str(d), 2, 16, vocab_size=512)
    one_line(e, f"data: shard {shard} has ", "tokens of uint32, but index.json says uint16",
             "prepare the folder again")


def test_manifest_that_does_not_match_its_shards(bpe, tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    for p in bpe.iterdir():
        (d / p.name).write_bytes(p.read_bytes())
    shard = d / "shard_00001.bin"
    b = bytearray(shard.read_bytes())
    b[100] ^= 1  # same size, other tokens
    shard.write_bytes(bytes(b))
    Loader(str(d), 2, 16, vocab_size=512)  # sizes agree: the loader alone cannot tell
    with pytest.raises(DataError) as e:
        ensure(str(d), "", "*.txt", 1, say=pytest.fail, tokenizer="bpe:512")  # data.verify (default) can
    one_line(e, f"data: shard {shard} does not match its checksum in {d / 'index.json'}")
    ensure(str(d), "", "*.txt", 1, say=pytest.fail, tokenizer="bpe:512", check=False)  # data.verify=false
    r = subprocess.run([sys.executable, "-m", "moefp8.data", "verify", "--path", str(d)], capture_output=True,
                       text=True, cwd=REPO)
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "does not match its checksum" in r.stderr
    (d / "tokenizer.json").write_text((bpe / "tokenizer.json").read_text().replace('"<|endoftext|>"', '"<|eot|>"'))
    shard.write_bytes((bpe / shard.name).read_bytes())
    with pytest.raises(DataError) as e:
        verify(str(d))
    one_line(e, f"data: tokenizer {d / 'tokenizer.json'} is changed")


def test_ensure_refuses_another_tokenizer_and_names_the_one_to_set(bpe, src, tmp_path):
    with pytest.raises(DataError) as e:
        ensure(str(bpe), "", "*.txt", 1, say=pytest.fail)  # data.tokenizer left at bytes
    one_line(e, f"data.path={bpe} holds tokens of bpe:512 (sha256 ", "not of data.tokenizer=bytes",
             "set data.tokenizer=bpe:512")
    assert ensure(str(bpe), str(src), "*.txt", 32_000_000, say=pytest.fail, tokenizer="bpe:512")["vocab_size"] == 512


def test_cli_prepare_and_verify(src, tmp_path, capsys):
    main(["prepare", "--src", str(src), "--out", str(tmp_path / "o"), "--glob", "*.txt", "--tokenizer", "bpe:450",
          "--max-bytes", "100000"])
    assert "tokens of bpe:450 (vocabulary 450, uint16)" in capsys.readouterr().out
    main(["verify", "--path", str(tmp_path / "o")])
    assert "all match index.json" in capsys.readouterr().out


def test_config_checks_the_model_vocabulary_against_bpe_n():
    with pytest.raises(ValueError, match=r"^model.vocab_size=257: data.tokenizer=bpe:1024 needs at least 1024; "
                                         r"set model.vocab_size=1024$"):
        load_config(["data.tokenizer=bpe:1024"])
    with pytest.raises(ValueError, match="bpe:N needs a vocabulary size"):
        load_config(["data.tokenizer=bpe:12", "model.vocab_size=1024"])
    assert load_config(["data.tokenizer=bpe:1024", "model.vocab_size=1024"]).data.tokenizer == "bpe:1024"


def test_training_on_a_bpe_prepared_on_first_use(src, tmp_path):
    """`python -m moefp8.train data.tokenizer=bpe:N`: prepared into data.path, trained; the loss starts
    near ln(N) and falls."""
    out, data = tmp_path / "run", tmp_path / "data"
    r = subprocess.run([sys.executable, "-m", "moefp8.train", "model=tiny", "model.vocab_size=512",
                        "data.tokenizer=bpe:512", f"data.prepare_from={src}", "data.glob=*.txt", f"data.path={data}",
                        "logger.mode=disabled", "train.progress=false", "train.steps=20", "train.micro_batch=4",
                        "train.seq_len=64", "optim.warmup_steps=2", f"train.out_dir={out}"],
                       capture_output=True, text=True, cwd=REPO, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "tokenizer bpe:512" in r.stdout
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()
              if '"loss"' in line]
    assert abs(losses[0] - np.log(512)) < 0.5 and losses[-1] < losses[0] - 0.5
    assert read_index(str(data))["tokenizer"]["spec"] == "bpe:512"
