"""An offline, deterministic text corpus and tokenizer for the GPT example.

The corpus is the docstrings of the Python standard library, read from its source files with
``ast`` (never imported: importing ``antigravity`` opens a browser, ``this`` prints). It needs no
download, is real English technical prose, and is the same on every machine running the same
Python build; :attr:`Corpus.digest` identifies it, so two runs can tell they trained on the same
text.

Tokens are UTF-8 bytes (vocabulary 256): no tokenizer file to ship, and a byte-level model
trains on anything. Samples are keyed by ``(seed, iteration, micro_batch, row)``, not by an
iterator's position, so any stage can recompute any micro-batch bit for bit after a failure.
"""

from __future__ import annotations

import ast
import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["ByteTokenizer", "Corpus", "load_corpus"]

_SKIP_DIRS = {"test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages", "__pycache__", "ensurepip"}


class ByteTokenizer:
    """UTF-8 bytes as tokens."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, tokens: list[int] | torch.Tensor) -> str:
        data = bytes(int(t) for t in (tokens.tolist() if isinstance(tokens, torch.Tensor) else tokens))
        return data.decode("utf-8", errors="replace")


@dataclass(frozen=True)
class Corpus:
    """A token stream and deterministic sampling from it."""

    tokens: torch.Tensor  # uint8, 1-D
    digest: str
    source: str

    def __len__(self) -> int:
        return int(self.tokens.numel())

    def batch(
        self, seed: int, iteration: int, micro_batch: int, batch_size: int, seq_len: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, labels)``, each ``[batch_size, seq_len]`` int64, labels shifted by one.

        Offsets come from a generator seeded by the position alone: the same (seed, iteration,
        micro_batch) gives the same rows wherever and whenever it is asked for.
        """
        span = len(self) - seq_len - 1
        if span <= 0:
            raise ValueError(f"corpus of {len(self)} tokens is too short for seq_len={seq_len}")
        g = torch.Generator().manual_seed(_mix(seed, iteration, micro_batch))
        starts = torch.randint(0, span, (batch_size,), generator=g)
        idx = starts[:, None] + torch.arange(seq_len + 1)[None, :]
        window = self.tokens[idx].long()
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()


def _mix(*parts: int) -> int:
    h = hashlib.blake2b(b"".join(int(p).to_bytes(8, "little", signed=True) for p in parts), digest_size=8)
    return int.from_bytes(h.digest(), "little") & ((1 << 63) - 1)


def _docstrings(path: Path) -> list[str]:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
        return []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc and len(doc) >= 40:
                out.append(doc)
    return out


def _stdlib_files(root: Path) -> list[Path]:
    files: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
        files.extend(Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py"))
    return files


def load_corpus(max_bytes: int = 4_000_000, cache_dir: str | os.PathLike[str] | None = None) -> Corpus:
    """Gather (or read from the cache) the standard library's docstrings, at most ``max_bytes``."""
    root = Path(sysconfig.get_paths()["stdlib"])
    default_cache = os.environ.get("DS_SWIFT_CACHE") or str(Path.home() / ".cache" / "ds-swift")
    cache = Path(cache_dir) if cache_dir is not None else Path(default_cache)
    key = hashlib.sha256(f"{root}|{max_bytes}|v1".encode()).hexdigest()[:16]
    path = cache / f"corpus-{key}.bin"
    if path.exists():
        data = path.read_bytes()
    else:
        parts: list[bytes] = []
        total = 0
        for f in _stdlib_files(root):
            for doc in _docstrings(f):
                b = doc.encode("utf-8") + b"\n\n"
                parts.append(b)
                total += len(b)
            if total >= max_bytes:
                break
        data = b"".join(parts)[:max_bytes]
        if len(data) < 10_000:
            raise RuntimeError(f"the standard library at {root} yielded only {len(data)} bytes of docstrings")
        cache.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(data)
        os.replace(tmp, path)  # atomic: ranks that build the cache at once never read half a file
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()
    return Corpus(tokens=tokens, digest=hashlib.sha256(data).hexdigest()[:16], source=f"docstrings of {root}")
