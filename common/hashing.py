"""The hashes the manifest, shards and provenance rely on (all SHA-256, hex)."""

from __future__ import annotations

import hashlib
import os

import numpy as np


def token_sha256(input_ids: np.ndarray) -> str:
    """SHA-256 of the little-endian int32 bytes of ``input_ids`` (the shard column ``token_sha256``)."""
    return hashlib.sha256(np.ascontiguousarray(input_ids, dtype="<i4").tobytes()).hexdigest()


def text_sha256(text: str) -> str:
    """SHA-256 of the UTF-8 bytes of ``text`` (chat templates, serialized tokenizers)."""
    return hashlib.sha256(text.encode()).hexdigest()


def tokenizer_sha256(tokenizer) -> str:
    """SHA-256 of a fast tokenizer's serialized JSON (vocabulary, merges, normalizer, added tokens): the
    run header's ``tokenizer_sha256``."""
    return text_sha256(tokenizer.backend_tokenizer.to_str())


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    """SHA-256 of a file, streamed in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


_ONCE: dict[tuple[str, int, int], str] = {}


def sha256_file_once(path: str | os.PathLike) -> str:
    """:func:`sha256_file`, remembered for this process by (real path, size, mtime in ns): a run hashes each
    weight file once however many times it asks. Raises OSError when the file cannot be read."""
    real = os.path.realpath(path)
    st = os.stat(real)
    key = (real, st.st_size, st.st_mtime_ns)
    if key not in _ONCE:
        _ONCE[key] = sha256_file(real)
    return _ONCE[key]
