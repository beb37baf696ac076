"""State codecs: how one ``[T, H]`` tensor of hidden states becomes the bytes of one shard cell.

Every cell is self-contained (a row decodes without its neighbours) and every codec decodes straight
into a bf16 (or fp16) tensor. Ratios and speeds are measured in ``bench/codecs.out`` on real SmolLM2
states of ShareGPT; the numbers in this table come from there.

============  ========  =====================================================================  ======
codec         lossless  cell layout                                                            ratio
============  ========  =====================================================================  ======
bf16          yes       zstd-1 frame of the row-major 16-bit values                            ~0.78
bf16-split    yes       zstd-1 frame of the high bytes (``[T, H]``), then the low bytes raw     ~0.69
                        (``[T, H]``; mantissa bits barely compress)
fp8-e4m3      no        float32 scale per token (``[T]``, amax / 448), then a zstd-1 frame of  ~0.43
                        the e4m3 values ``x / scale`` (``[T, H]``)
============  ========  =====================================================================  ======

Why split bytes: a bf16 value's high byte (sign + 7 exponent bits) has ~2.7 bits of entropy per
channel, its low byte (1 exponent bit + 7 mantissa bits) ~7.9; interleaved, zstd sees noise. Why one
FP8 scale per token: hidden states carry outliers of |h| ~ 25,000 in a few channels, which a per-tensor
scale would crush (FIELD-NOTES "Compression"). Storing the high bytes channel-major (``[H, T]``) was
measured too: 0.1% smaller and as fast to encode, but ~25% slower to decode (the transpose), and a
trainer decodes every epoch: token-major it is (bench/codecs.out).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np
import torch
import zstandard

from capture.errors import CaptureError

DEFAULT = "bf16-split"
E4M3_MAX = 448.0  # largest finite float8_e4m3fn
ZSTD_LEVEL = 1  # measured on 30k tokens of these planes: level 1 keeps 0.683x, level 3 0.704x, and is ~2x faster


def _bits(t: torch.Tensor) -> np.ndarray:
    """The 16-bit patterns of a bf16/fp16 tensor as uint16 ``[T, H]`` (no copy when contiguous)."""
    return t.contiguous().view(torch.int16).numpy().view(np.uint16)


def _from_bits(bits: np.ndarray, tokens: int, hidden: int, dtype: torch.dtype) -> torch.Tensor:
    if bits.size != tokens * hidden:
        raise ValueError(f"cell holds {bits.size} values, expected {tokens * hidden}")
    return torch.from_numpy(np.ascontiguousarray(bits).view(np.int16)).view(dtype).view(tokens, hidden)


def _encode_bf16(states: torch.Tensor, zc: zstandard.ZstdCompressor) -> bytes:
    return zc.compress(_bits(states))


def _decode_bf16(cell, tokens: int, hidden: int, dtype: torch.dtype) -> torch.Tensor:
    n = tokens * hidden
    bits = np.frombuffer(zstandard.ZstdDecompressor().decompress(cell, max_output_size=2 * n), dtype=np.uint16).copy()
    return _from_bits(bits, tokens, hidden, dtype)


def _encode_split(states: torch.Tensor, zc: zstandard.ZstdCompressor) -> bytes:
    pairs = _bits(states).view(np.uint8).reshape(*states.shape, 2)  # little-endian: [..., 0] = low byte
    return zc.compress(np.ascontiguousarray(pairs[..., 1])) + np.ascontiguousarray(pairs[..., 0]).tobytes()


def _decode_split(cell, tokens: int, hidden: int, dtype: torch.dtype) -> torch.Tensor:
    n = tokens * hidden
    buf = memoryview(cell)
    high = np.frombuffer(zstandard.ZstdDecompressor().decompress(buf[: len(buf) - n], max_output_size=n), dtype=np.uint8)
    low = np.frombuffer(buf[len(buf) - n :], dtype=np.uint8)
    if high.size != n or low.size != n:
        raise ValueError(f"bf16-split cell holds {high.size}+{low.size} bytes, expected {n}+{n}")
    pairs = np.empty((tokens, hidden, 2), dtype=np.uint8)
    pairs[..., 0] = low.reshape(tokens, hidden)
    pairs[..., 1] = high.reshape(tokens, hidden)
    return _from_bits(pairs.view(np.uint16).reshape(tokens, hidden), tokens, hidden, dtype)


def _encode_fp8(states: torch.Tensor, zc: zstandard.ZstdCompressor) -> bytes:
    x = states.float()
    scale = (x.abs().amax(dim=1) / E4M3_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    q = (x / scale[:, None]).to(torch.float8_e4m3fn)
    return scale.numpy().astype("<f4").tobytes() + zc.compress(q.view(torch.uint8).numpy())


def _decode_fp8(cell, tokens: int, hidden: int, dtype: torch.dtype) -> torch.Tensor:
    n = tokens * hidden
    buf = memoryview(cell)
    scale = torch.from_numpy(np.frombuffer(buf[: 4 * tokens], dtype="<f4").copy())
    q = np.frombuffer(zstandard.ZstdDecompressor().decompress(buf[4 * tokens :], max_output_size=n), dtype=np.uint8)
    if q.size != n:
        raise ValueError(f"fp8-e4m3 cell holds {q.size} values, expected {n}")
    x = torch.from_numpy(q.copy()).view(torch.float8_e4m3fn).float().view(tokens, hidden) * scale[:, None]
    return x.to(dtype)


@dataclasses.dataclass(frozen=True)
class Codec:
    """One state codec. ``encode(states [T, H] bf16/fp16, compressor) -> bytes``;
    ``decode(cell, tokens, hidden, dtype) -> [T, H]`` tensor of ``dtype`` (ValueError on a size mismatch);
    ``ratio``: stored bytes / raw bf16 bytes measured on real SmolLM2 states (bench/codecs.out), used for
    disk estimates (``capture run --dry-run``)."""

    name: str
    lossless: bool
    ratio: float
    encode: Callable[[torch.Tensor, zstandard.ZstdCompressor], bytes]
    decode: Callable[..., torch.Tensor]


# The registry: a new codec is its two functions above and one line here.
REGISTRY = {c.name: c for c in (
    Codec("bf16", True, 0.78, _encode_bf16, _decode_bf16),
    Codec("bf16-split", True, 0.69, _encode_split, _decode_split),
    Codec("fp8-e4m3", False, 0.43, _encode_fp8, _decode_fp8),
)}
CODECS = tuple(REGISTRY)
LOSSLESS = {name: c.lossless for name, c in REGISTRY.items()}
RATIO = {name: c.ratio for name, c in REGISTRY.items()}


def check(codec: str) -> str:
    """``codec`` if it is known; raises CaptureError otherwise."""
    if codec not in REGISTRY:
        raise CaptureError(f"unknown codec {codec!r}; known: {', '.join(CODECS)}")
    return codec


def encode(codec: str, states: torch.Tensor, level: int = ZSTD_LEVEL) -> bytes:
    """Encode ``states`` (bf16 or fp16, ``[T, H]``) into one cell. Releases the GIL inside zstd.
    Raises ValueError for an unknown codec."""
    if codec not in REGISTRY:
        raise ValueError(f"unknown codec {codec!r}")
    return REGISTRY[codec].encode(states, zstandard.ZstdCompressor(level=level, write_checksum=True))


def decode(codec: str, cell, tokens: int, hidden: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Decode one cell into a ``[tokens, hidden]`` tensor of ``dtype`` (fp8 decodes to it too).

    ``cell`` is any buffer (bytes, memoryview, ``pyarrow.Buffer``). Raises ValueError on a size mismatch
    or an unknown codec.
    """
    if codec not in REGISTRY:
        raise ValueError(f"unknown codec {codec!r}")
    return REGISTRY[codec].decode(cell, tokens, hidden, dtype)
