"""The target's top-K next-token log-probabilities: how one row's ``[T, K]`` arrays become shard cells.

A run captured with ``--topk K`` stores, per token position t, the K largest next-token
log-probabilities of the target at t (its distribution over token t+1; the position convention of
``argmax``: ``topk_ids[t, 0] == argmax[t]``), in two columns of one cell per row each:

================  =======  ==========================================================================
column            decodes  cell layout (``T*K`` values, row-major ``[T, K]``)
================  =======  ==========================================================================
``topk_ids``      int32    the 4 little-endian byte planes of the ids (all byte 0s, then all byte 1s, ...),
                           one zstd-1 frame
``topk_logprobs`` float32  the 32-bit patterns, each row delta-coded along K (first value kept, then the
                           difference to its left neighbour, modulo 2**32), as 4 byte planes, one zstd-1
                           frame
================  =======  ==========================================================================

Both are lossless (integer deltas modulo 2**32 invert exactly, whatever the values). Values are
``logit - logsumexp(all logits)`` in float32 over the **full** vocabulary (never renormalized over
the K kept), descending along K; ties in value go to the lower token id. A trainer gets probabilities as
``exp(topk_logprobs)`` and the tail mass (every token outside the top K) as ``1 - exp(topk_logprobs).sum(-1)``.

Why this layout (SmolLM2 top-32 over ShareGPT): raw, the two columns are 256 bytes a token (an Arrow
``list<int32>`` / ``list<float32>`` would store that: the IPC stream itself is written uncompressed).
Measured on 13,385 tokens during development: zstd-1 over the interleaved bytes 61.7 + 64.1 bytes a token;
byte planes 57.3 + 45.1; byte planes with the logprob rows delta-coded 57.3 + 32.2 (zstd level 3 no
smaller). On a real capture (``capture run --topk 32``, 36 ShareGPT conversations, 48,577 tokens):
**56.4 + 31.2 = 87.6 bytes a token** (2.74 bytes per kept entry, :data:`BYTES_PER_ENTRY`), next to 4,608
raw state bytes a token for 3 taps + final; one thread encodes ~380 MB/s and decodes ~400 MB/s of raw
top-K. A descending row of negative float32 has ascending bit patterns, so its deltas are small integers
whose high bytes are mostly zero.

The cells are ``binary`` (32-bit offsets), not ``large_binary`` like the state cells, so that a reader
of format 1.1 (which takes every ``large_binary`` column for a state) ignores them; a record batch holds
at most 2 GiB of one top-K column (>= 500k tokens at K = 1024).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
from shards import codecs

IDS = "topk_ids"
LOGPROBS = "topk_logprobs"
COLUMNS = (IDS, LOGPROBS)
TYPE = pa.binary()
MAX_K = 1024  # a sane cap: top-64 already keeps ~0.92 of the mass (FIELD-NOTES); 1024 is ~3 KB a token
ENCODING = {IDS: "zstd1-byteplanes", LOGPROBS: "zstd1-delta-byteplanes"}
DTYPE = {IDS: "int32", LOGPROBS: "float32"}
BYTES_PER_ENTRY = 2.74  # stored bytes per token and kept entry, both columns (measured, module docstring)
ZSTD_LEVEL = 1


def _planes(u: np.ndarray) -> bytes:
    """uint32 ``[T, K]`` → its 4 little-endian byte planes, concatenated."""
    return np.ascontiguousarray(u.astype("<u4", copy=False).view(np.uint8).reshape(-1, 4).T).tobytes()


def _unplanes(cell, tokens: int | None, k: int, column: str) -> np.ndarray:
    raw = codecs.decompressor().decompress(cell)
    n = len(raw) // 4
    if len(raw) % (4 * k) or (tokens is not None and n != tokens * k):
        want = f"{tokens} x {k}" if tokens is not None else f"a multiple of {k}"
        raise ValueError(f"{column} cell holds {len(raw)} bytes, not {want} 4-byte values")
    planes = np.frombuffer(raw, dtype=np.uint8).reshape(4, n)
    return np.ascontiguousarray(planes.T).view("<u4").reshape(n // k, k)


def encode_ids(ids: np.ndarray) -> bytes:
    """int32 ``[T, K]`` → one ``topk_ids`` cell."""
    return codecs.compressor(ZSTD_LEVEL).compress(_planes(np.asarray(ids, dtype=np.int32).view(np.uint32)))


def encode_logprobs(values: np.ndarray) -> bytes:
    """float32 ``[T, K]`` → one ``topk_logprobs`` cell (lossless for any bit pattern)."""
    u = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    delta = u.copy()
    delta[:, 1:] = u[:, 1:] - u[:, :-1]  # uint32 arithmetic wraps: invertible for any values
    return codecs.compressor(ZSTD_LEVEL).compress(_planes(delta))


def decode_ids(cell, k: int, tokens: int | None = None) -> np.ndarray:
    """One ``topk_ids`` cell (any buffer) → int32 ``[T, K]``. Raises ValueError when it does not hold
    ``tokens`` x ``k`` values (``tokens`` None: any multiple of ``k``)."""
    return _unplanes(cell, tokens, k, IDS).view(np.int32)


def decode_logprobs(cell, k: int, tokens: int | None = None) -> np.ndarray:
    """One ``topk_logprobs`` cell → float32 ``[T, K]`` (ValueError as :func:`decode_ids`)."""
    u = np.cumsum(_unplanes(cell, tokens, k, LOGPROBS), axis=1, dtype=np.uint32)  # wraps like the encoder
    return u.view(np.float32)


def field_metadata(column: str, k: int) -> dict:
    """A top-K field's metadata: encoding, the dtype it decodes to, shape, K."""
    return {"encoding": ENCODING[column], "dtype": DTYPE[column], "shape": f"[T, {k}]", "k": str(k)}
