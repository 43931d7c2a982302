"""Tokenizers for `moefp8.data`: bytes, or a subword BPE through Hugging Face `tokenizers`.

A tokenizer is named by a spec string (`data.tokenizer`, `--tokenizer`):

    bytes              the text's bytes (0..255) and EOS = 256: no file, vocabulary 257 (tiny, tests)
    bpe:32768          a byte-level BPE of at most 32768 tokens, trained on the texts being prepared
    PATH/tokenizer.json  a Hugging Face tokenizer file (any model's), loaded as it is

Every tokenizer marks the end of a document with one EOS id: `bpe:N` adds `<|endoftext|>`; a loaded
file must define one of EOS_NAMES as a token. Nothing is downloaded. `digest` identifies the
tokenizer (the sha256 of its tokenizer.json; "bytes" for bytes) and is recorded in the data's
index.json, so a run never reads tokens of one tokenizer as those of another.
"""

import hashlib
from pathlib import Path

import numpy as np

from moefp8.errors import UserError, first_line

BYTES = "bytes"
EOS_TOKEN = "<|endoftext|>"
# end-of-document tokens of common tokenizer files (GPT-2/Qwen, Llama 3, T5/Mistral, DeepSeek-V2/V3)
EOS_NAMES = (EOS_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "<｜end▁of▁sentence｜>")
MIN_BPE_VOCAB = 384  # the 256 byte symbols + EOS + a hundred merges: below it a BPE is bytes with extra steps


class TokenizerError(UserError):
    """The tokenizer spec or file cannot be used; the message names it and the fix."""


def parse_spec(spec: str) -> tuple[str, int | str | None]:
    """"bytes" -> ("bytes", None); "bpe:N" -> ("bpe", N); anything else -> ("file", path).
    TokenizerError for a malformed bpe spec (checked before any file is read)."""
    spec = str(spec).strip()
    if spec == BYTES:
        return BYTES, None
    if spec.startswith("bpe:"):
        n = spec[4:]
        if not n.isdigit() or int(n) < MIN_BPE_VOCAB:
            raise TokenizerError(f"data.tokenizer={spec}: bpe:N needs a vocabulary size N >= {MIN_BPE_VOCAB}, "
                                 f"e.g. bpe:32768")
        return "bpe", int(n)
    return "file", spec


class ByteTokenizer:
    """Tokens are the bytes of the text, EOS = 256 after each document."""

    spec = BYTES
    vocab_size = 257
    eos = 256
    digest = BYTES

    def encode_docs(self, docs: list[bytes]) -> list[np.ndarray]:
        """Each document's tokens (int64) followed by EOS."""
        return [np.append(np.frombuffer(d, dtype=np.uint8).astype(np.int64), self.eos) for d in docs]

    def decode(self, ids) -> str:
        """EOS becomes a newline; bytes that are not valid UTF-8 become U+FFFD."""
        return bytes(int(x) if int(x) < 256 else 10 for x in ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face `tokenizers.Tokenizer` from a tokenizer.json file; `spec` is what it was asked as."""

    def __init__(self, path: str | Path, spec: str | None = None):
        from tokenizers import Tokenizer

        path = Path(path)
        self.spec = spec or str(path)
        if path.is_dir():
            path = path / "tokenizer.json"  # a model's folder
        if not path.is_file():
            raise TokenizerError(f"data.tokenizer={self.spec}: {path} not found; give the path of a tokenizer.json "
                                 f"(Hugging Face tokenizers format), bpe:N to train one, or bytes")
        raw = path.read_bytes()
        try:
            self.tok = Tokenizer.from_str(raw.decode("utf-8"))
        except Exception as e:  # tokenizers raises its own Exception type for malformed files
            raise TokenizerError(f"data.tokenizer={self.spec}: {path} is not a Hugging Face tokenizer.json "
                                 f"({first_line(e)[:200]}); give a tokenizer.json, bpe:N or bytes") from None
        self.path, self.digest = path, hashlib.sha256(raw).hexdigest()
        ids = [self.tok.token_to_id(t) for t in EOS_NAMES]
        eos = next((i for i in ids if i is not None), None)
        if eos is None:
            raise TokenizerError(f"data.tokenizer={self.spec}: {path} defines none of the end-of-document tokens "
                                 f"{', '.join(EOS_NAMES)}; add one as a special token (documents are separated by it)")
        self.eos = eos
        # ids run 0..n-1 in a well-formed file; the largest id + 1 also where a file has gaps
        self.vocab_size = max(self.tok.get_vocab(with_added_tokens=True).values()) + 1

    def encode_docs(self, docs: list[bytes]) -> list[np.ndarray]:
        """Each document's tokens (int64) followed by EOS; text that is not valid UTF-8 is read with
        U+FFFD in place of its bad bytes. Encoded in parallel by `tokenizers` (its thread pool)."""
        texts = [d.decode("utf-8", errors="replace") for d in docs]
        encs = self.tok.encode_batch(texts, add_special_tokens=False)
        return [np.append(np.asarray(e.ids, dtype=np.int64), self.eos) for e in encs]

    def decode(self, ids) -> str:
        return self.tok.decode([int(x) for x in ids], skip_special_tokens=False)


def train_bpe(docs, vocab_size: int, out: Path, show_progress: bool = False) -> HFTokenizer:
    """A byte-level BPE of at most `vocab_size` tokens (EOS_TOKEN included) trained on `docs` (an
    iterable of bytes), written to `out` (a tokenizer.json) and loaded from it. Byte-level: every
    byte sequence has an encoding, so no text is ever unknown; digits split one by one (the
    convention of Llama 3 / DeepSeek-V3 pre-tokenizers, which keeps numbers from eating merges)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TOKEN], show_progress=show_progress,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((d.decode("utf-8", errors="replace") for d in docs), trainer)
    out.write_text(tok.to_str())
    return HFTokenizer(out, f"bpe:{vocab_size}")


def load(spec: str, folder: Path | None = None) -> "ByteTokenizer | HFTokenizer":
    """The tokenizer a prepared folder's index names: bytes, or its tokenizer.json in `folder`."""
    kind, _ = parse_spec(spec)
    if kind == BYTES:
        return ByteTokenizer()
    if folder is None:
        raise TokenizerError(f"data.tokenizer={spec}: a folder holding its tokenizer.json is needed")
    return HFTokenizer(folder / "tokenizer.json", spec)


def describe(index: dict) -> str:
    """"bytes" or "bpe:32768 (sha256 1a2b3c4d)": the tokenizer an index records, for messages."""
    t = index.get("tokenizer") or {"spec": BYTES}
    return t["spec"] if t.get("spec") == BYTES else f"{t.get('spec')} (sha256 {str(t.get('sha256'))[:8]})"

