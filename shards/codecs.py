"""State codecs: how one ``[T, H]`` tensor of hidden states becomes the bytes of one shard cell.

Every cell is self-contained (a row decodes without its neighbours) and every codec decodes straight
into a bf16 (or fp16) tensor. Ratios and speeds are measured by ``bench/codecs.py`` on real SmolLM2
states of ShareGPT (the lossy codecs' ratios here: 6,640 tokens of taps 1/8/15/22/29 + final during
development), what each costs a drafter trained on it by ``bench/frontier.py``.

============  ========  =====================================================================  ======
codec         lossless  cell layout                                                            ratio
============  ========  =====================================================================  ======
bf16          yes       zstd-1 frame of the row-major 16-bit values                            ~0.78
bf16-split    yes       zstd-1 frame of the high bytes (``[T, H]``), then the low bytes raw     ~0.69
                        (``[T, H]``; mantissa bits barely compress)
fp8-e4m3      no        float32 scale per token (``[T]``, amax / 448), then a zstd-1 frame of  ~0.43
                        the e4m3 values ``x / scale`` (``[T, H]``)
bf16-m3       no        bf16 rounded to 3 of its 7 mantissa bits (to nearest even), then both  ~0.45
                        byte planes in one zstd-1 frame
int8-b32      no        per token and block of 32 channels a bf16 scale (amax / 127) and int8  ~0.48
                        codes, one zstd-1 frame (:func:`_block_codec`)
int6-b32      no        the same with codes in [-31, 31]: zstd codes them in ~5.7 bits         ~0.36
fp4-b32       no        the same with FP4 E2M1 codes (MXFP4's element type), two a byte        ~0.25
int4-b32      no        the same with integer codes in [-7, 7], two a byte (``code + 7`` per    ~0.22
                        nibble, low first) from format 1.5; one a byte (int8) before, still read
============  ========  =====================================================================  ======

Cells end with a checksum of their bytes (:data:`CHECKS`; :func:`encode` ``check=``, recorded in the
schema's state fields as ``check``; which one a run's format version means is decided by its
:class:`shards.format.CellLayout`): XXH3-64 since format 1.4, CRC-32 in format 1.3 (zlib's CRC-32 checks
2.5 GB/s of cell here, ~25% on top of a ``bf16-split`` decode; XXH3-64 14.8 GB/s, ~4%:
bench/codecs.out). A damaged byte anywhere in a cell, also where no zstd frame covers it (``bf16-split``'s low
bytes, fp8's scales), is then an error, not other states.

Why split bytes: a bf16 value's high byte (sign + 7 exponent bits) has ~2.7 bits of entropy per
channel, its low byte (1 exponent bit + 7 mantissa bits) ~7.9; interleaved, zstd sees noise. Why
per-token (fp8) or per-block (int/fp4) scales: hidden states carry outliers of |h| ~ 25,000 in a few
channels, which a per-tensor scale would crush (FIELD-NOTES "Compression"). Storing the high bytes
channel-major (``[H, T]``) was measured too: 0.1% smaller and as fast to encode, but ~25% slower to
decode (the transpose), and a trainer decodes every epoch: token-major it is (bench/codecs.out).
"""

from __future__ import annotations

import dataclasses
import threading
import zlib
from typing import Callable

import numpy as np
import torch
import xxhash
import zstandard

from common.errors import CaptureError

DEFAULT = "bf16-split"
E4M3_MAX = 448.0  # largest finite float8_e4m3fn
ZSTD_LEVEL = 1  # measured on 30k tokens of these planes: level 1 keeps 0.683x, level 3 0.704x, and is ~2x faster


_CONTEXTS = threading.local()  # zstd contexts are not thread-safe: one set per thread, reused across cells


def decompressor() -> zstandard.ZstdDecompressor:
    """This thread's zstd decompression context, reused across cells: the zstd part of a ``bf16-split``
    decode ran 1,913 MB/s of bf16 with it and 1,645 with a fresh context per cell (bench/codecs.out)."""
    if not hasattr(_CONTEXTS, "decompressor"):
        _CONTEXTS.decompressor = zstandard.ZstdDecompressor()
    return _CONTEXTS.decompressor


def compressor(level: int = ZSTD_LEVEL) -> zstandard.ZstdCompressor:
    """This thread's zstd compression context at ``level`` (frames carry zstd's own checksum)."""
    if not hasattr(_CONTEXTS, "compressors"):
        _CONTEXTS.compressors = {}
    if level not in _CONTEXTS.compressors:
        _CONTEXTS.compressors[level] = zstandard.ZstdCompressor(level=level, write_checksum=True)
    return _CONTEXTS.compressors[level]


def _bits(t: torch.Tensor) -> np.ndarray:
    """The 16-bit patterns of a bf16/fp16 tensor as uint16 ``[T, H]`` (no copy when contiguous)."""
    return t.contiguous().view(torch.int16).numpy().view(np.uint16)


def _from_bits(bits: np.ndarray, tokens: int, hidden: int, dtype: torch.dtype) -> torch.Tensor:
    if bits.size != tokens * hidden:
        raise ValueError(f"cell holds {bits.size} values, expected {tokens * hidden}")
    return torch.from_numpy(np.ascontiguousarray(bits).view(np.int16)).view(dtype).view(tokens, hidden)


def _encode_bf16(states: torch.Tensor, zc: zstandard.ZstdCompressor) -> bytes:
    return zc.compress(_bits(states))


def _decode_bf16(cell, tokens: int, hidden: int, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    n = tokens * hidden
    bits = np.frombuffer(decompressor().decompress(cell, max_output_size=2 * n), dtype=np.uint16).copy()
    return _store(_from_bits(bits, tokens, hidden, dtype), out)


def _encode_split(states: torch.Tensor, zc: zstandard.ZstdCompressor) -> bytes:
    pairs = _bits(states).view(np.uint8).reshape(*states.shape, 2)  # little-endian: [..., 0] = low byte
    return zc.compress(np.ascontiguousarray(pairs[..., 1])) + np.ascontiguousarray(pairs[..., 0]).tobytes()


def _decode_split(cell, tokens: int, hidden: int, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    n = tokens * hidden
    buf = memoryview(cell)
    high = np.frombuffer(decompressor().decompress(buf[: len(buf) - n], max_output_size=n), dtype=np.uint8)
    low = np.frombuffer(buf[len(buf) - n :], dtype=np.uint8)
    if high.size != n or low.size != n:
        raise ValueError(f"bf16-split cell holds {high.size}+{low.size} bytes, expected {n}+{n}")
    out = _target(out, tokens, hidden, dtype)
    _kernels().interleave(high, low, *_flat(out), hidden)  # one pass, straight into the sample
    return out


def _kernels():
    """:mod:`shards.kernels`, imported on the first decode that needs it: numba costs ~0.5 s to import (and
    imports yaml), which a process that only lists or verifies shards should not pay."""
    from shards import kernels

    return kernels


def _target(out: torch.Tensor | None, tokens: int, hidden: int, dtype: torch.dtype) -> torch.Tensor:
    """``out`` (checked) or a new ``[tokens, hidden]`` tensor of ``dtype``."""
    if out is None:
        return torch.empty(tokens, hidden, dtype=dtype)
    if (tuple(out.shape) != (tokens, hidden) or out.dtype != dtype or (hidden > 1 and out.stride(1) != 1)
            or (tokens > 1 and out.stride(0) < hidden)):  # rows laid out one after another, never overlapping
        raise ValueError(f"out must be a [{tokens}, {hidden}] {dtype} tensor with unit stride along H and rows "
                         f"that do not overlap, not {list(out.shape)} {out.dtype} strides {out.stride()}")
    return out


def _store(result: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """``result``, copied into ``out`` when one is given (the codecs without a compiled pass)."""
    if out is None:
        return result
    return _target(out, *result.shape, result.dtype).copy_(result)


def _flat(out: torch.Tensor) -> tuple[np.ndarray, int, int]:
    """A 16-bit ``[T, H]`` tensor (rows may be strided, e.g. a tap's slice of ``[T, L, H]``) as
    (its whole storage as flat uint16, offset of row 0, row stride): the output convention of
    :mod:`shards.kernels`."""
    storage = out.as_strided((out.untyped_storage().nbytes() // 2,), (1,), 0)
    return storage.view(torch.int16).numpy().view(np.uint16), out.storage_offset(), out.stride(0)


def _encode_fp8(states: torch.Tensor, zc: zstandard.ZstdCompressor) -> bytes:
    x = states.float()
    scale = (x.abs().amax(dim=1) / E4M3_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    q = (x / scale[:, None]).to(torch.float8_e4m3fn)
    return scale.numpy().astype("<f4").tobytes() + zc.compress(q.view(torch.uint8).numpy())


def _decode_fp8(cell, tokens: int, hidden: int, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    n = tokens * hidden
    buf = memoryview(cell)
    scale = torch.from_numpy(np.frombuffer(buf[: 4 * tokens], dtype="<f4").copy())
    q = np.frombuffer(decompressor().decompress(buf[4 * tokens :], max_output_size=n), dtype=np.uint8)
    if q.size != n:
        raise ValueError(f"fp8-e4m3 cell holds {q.size} values, expected {n}")
    x = torch.from_numpy(q.copy()).view(torch.float8_e4m3fn).float().view(tokens, hidden) * scale[:, None]
    return _store(x.to(dtype), out)


# ------------------------------------------------------------------ lossy: bf16 with fewer mantissa bits

def _round_mantissa(bits: np.ndarray, keep: int) -> np.ndarray:
    """bf16/fp16 bit patterns rounded to ``keep`` mantissa bits, to nearest, ties to even (the dropped bits
    become 0); inf and NaN (exponent all ones) are left as they are, so a NaN stays a NaN. A value may
    round up into the next binade (that is exact rounding: the carry moves into the exponent)."""
    drop = 7 - keep
    if drop <= 0:
        return bits
    b = bits.astype(np.uint32)
    rounded = (b + ((1 << (drop - 1)) - 1) + ((b >> drop) & 1)) & ~np.uint32((1 << drop) - 1)
    special = (b & 0x7F80) == 0x7F80
    return np.where(special, b, rounded).astype(np.uint16)


def _mantissa_codec(keep: int):
    """bf16 with the mantissa rounded to ``keep`` of its 7 bits, stored like ``bf16-split`` but with the
    low bytes in a zstd frame too (after rounding they take 2**(keep+1) values, which zstd's entropy
    stage codes in ~keep+1 bits). Decodes to bf16 patterns directly (no arithmetic)."""

    def encode(states: torch.Tensor, zc: zstandard.ZstdCompressor) -> bytes:
        if states.dtype != torch.bfloat16:
            raise ValueError(f"bf16-m{keep} stores bf16 states, not {states.dtype}")
        pairs = _round_mantissa(_bits(states), keep).view(np.uint8).reshape(*states.shape, 2)
        return zc.compress(np.ascontiguousarray(pairs[..., 1]).tobytes() + np.ascontiguousarray(pairs[..., 0]).tobytes())

    def decode(cell, tokens: int, hidden: int, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
        n = tokens * hidden
        planes = np.frombuffer(_decompress(cell, 2 * n), dtype=np.uint8)
        if planes.size != 2 * n:
            raise ValueError(f"bf16-m{keep} cell holds {planes.size} bytes, expected {2 * n}")
        pairs = np.empty((n, 2), dtype=np.uint8)
        pairs[:, 1], pairs[:, 0] = planes[:n], planes[n:]
        return _store(_from_bits(pairs.view(np.uint16).reshape(tokens, hidden), tokens, hidden, torch.bfloat16).to(dtype), out)

    return encode, decode


# ------------------------------------------------------------------ lossy: block-scaled integer / 4-bit codes

BLOCK = 32  # values per block scale along the hidden dimension (the OCP MX formats' block size)
# FP4 E2M1 element values (OCP Microscaling v1.0: ±0, 0.5, 1, 1.5, 2, 3, 4, 6); 15 distinct levels
E2M1 = np.array([-6, -4, -3, -2, -1.5, -1, -0.5, 0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=np.float32)


def _block_codec(name: str, qmax: int = 0, levels: np.ndarray | None = None):
    """Block-scaled codes, one scale per token and block of 32 channels (the MX formats' layout, with a
    bf16 scale, not a power of two): ``s`` = max |h| of the block / ``qmax``, then per value a code,
    either the integer ``round(h / s)`` in ``[-qmax, qmax]`` or, with ``levels`` (E2M1, qmax 6), the index
    of the nearest level. Codes that fit a nibble (E2M1's 15 levels, and integers with ``qmax <= 7``,
    stored as ``code + qmax``) go two a byte, low nibble first; wider ones (int6, int8) one a byte
    (int8), where zstd's entropy stage codes them in about their entropy (~6 bits for int6).
    Cell: one zstd frame (content checksum) of the scales ``[T, nb]`` bf16 and the codes ``[T, nb, 32]``
    (H zero-padded to whole blocks). Decode: ``code * s`` in bf16 — codes and E2M1 levels are exact in
    bf16 and the product of two bf16 values is rounded once, as a float32 product cast to bf16 would be.

    Why int4 codes go two a byte (format 1.5; one a byte before): a reader core's zstd stage then has half
    the bytes to decode (~1.8 → ~3.4 GB/s of bf16 here; the cells also come out ~5% smaller), and the packed
    integer codes dequantize in one compiled pass into the sample (:func:`shards.kernels.dequantize_nibbles`):
    the only way this CPU reads a training codec at >= 1.5 GB/s a core (docs/performance.md). Cells of
    either layout decode (told apart by their decompressed size); the values are the same bits.

    Outliers: a block scale spans 32 channels of one token, so an outlier channel (|h| ~ 25,000 on real
    states) coarsens only its own block, never the token or the tensor (a per-tensor scale would zero
    almost everything). Measured alternative, not used: dividing each channel by its median or RMS |h|
    over the cell first (worse worst-token error: near-dead channels become outliers).
    Error bound per value (``Codec.bound``), in units of its block's max |h|: half a code step (1/(2 qmax);
    E2M1: 1/6, half the gap between 4 and 6, over 6), plus the bf16 rounding of ``s`` (to nearest,
    <= 2**-9 relative; codes are clamped), plus the output's rounding."""
    four = levels is not None
    if four:
        qmax = int(levels.max())
        mids = torch.from_numpy((levels[1:] + levels[:-1]) / 2)
    nibbles = four or qmax <= 7
    if nibbles:  # a byte's two codes (low nibble first) → their two levels as bf16 bit patterns: one take per byte
        book = np.resize(levels if four else np.arange(-qmax, qmax + 1, dtype=np.float32), 16)
        pairs = np.stack([book[np.arange(256) & 0xF], book[np.arange(256) >> 4]], axis=1)
        pair_bits = torch.from_numpy(pairs).to(torch.bfloat16).view(torch.int16).numpy().view(np.int32).ravel()

    def encode(states: torch.Tensor, zc: zstandard.ZstdCompressor, packed: bool = True) -> bytes:
        yb = _blocks(states.float())  # [T, nb, BLOCK]
        s = (yb.abs().amax(dim=2) / qmax).to(torch.bfloat16)  # [T, nb]
        r = (yb / s.float().clamp_min(torch.finfo(torch.float32).tiny)[..., None]).clamp(-qmax, qmax)
        if four:
            q = torch.bucketize(r, mids).to(torch.uint8)
        elif nibbles and packed:
            q = (torch.round(r).to(torch.int8) + qmax).to(torch.uint8)
        if nibbles and (four or packed):
            q = q.view(-1, 2)
            codes = (q[:, 0] | (q[:, 1] << 4)).numpy()
        else:  # one a byte: int6, int8, and int4 in runs of format 1.4 and before
            codes = torch.round(r).to(torch.int8).numpy()
        return zc.compress(s.view(torch.int16).numpy().tobytes() + codes.tobytes())

    def decode(cell, tokens: int, hidden: int, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
        nb = -(-hidden // BLOCK)
        n = tokens * nb * BLOCK  # codes of the zero-padded blocks
        sizes = ([2 * tokens * nb + n // 2] if nibbles else []) + ([] if four else [2 * tokens * nb + n])
        body = np.frombuffer(_decompress(cell, max(sizes)), dtype=np.uint8)
        if body.size not in sizes:
            raise ValueError(f"{name} cell holds {body.size} bytes, expected {' or '.join(map(str, sizes))}")
        s_bits = body[: 2 * tokens * nb].view(np.uint16)
        codes = body[2 * tokens * nb:]
        packed = nibbles and codes.size == n // 2
        if packed and not four and dtype == torch.bfloat16:  # the one compiled pass (integer nibbles)
            target = _target(out, tokens, hidden, dtype)
            flat, offset, stride = _flat(target)
            if hidden % BLOCK == 0 and offset % 2 == 0 and stride % 2 == 0 and flat.size % 2 == 0:
                done = _kernels().dequantize_nibble_pairs(s_bits, codes, flat.view(np.uint32), offset // 2, stride // 2,
                                                       hidden, qmax)
            else:
                done = _kernels().dequantize_nibbles(s_bits, codes, flat, offset, stride, hidden, qmax)
            if done:  # else a scale is not finite: torch below
                return target
        s = torch.from_numpy(s_bits.view(np.int16).copy()).view(torch.bfloat16)
        if packed:
            v = torch.from_numpy(np.take(pair_bits, codes).view(np.int16)).view(torch.bfloat16)  # [n]
        else:
            v = torch.from_numpy(codes.view(np.int8).copy()).to(torch.bfloat16)
        res = (v.view(tokens, nb, BLOCK) * s.view(tokens, nb, 1)).view(tokens, nb * BLOCK)[:, :hidden]
        return _store(res.to(dtype).contiguous(), out)

    return encode, decode


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """``[T, H]`` → ``[T, nb, BLOCK]``, zero-padded along H to whole blocks."""
    pad = -x.shape[1] % BLOCK
    return (torch.nn.functional.pad(x, (0, pad)) if pad else x).view(x.shape[0], -1, BLOCK)


def _decompress(buf, size: int) -> bytes:
    return decompressor().decompress(buf, max_output_size=size)


# ------------------------------------------------------------------ stated error bounds (tested on real states)

OUT = 2.0**-9  # the bf16 output's own rounding: half a unit in the 8th significant bit, relative


def _bound_fp8(x: torch.Tensor) -> torch.Tensor:
    """e4m3 keeps 3 mantissa bits: half a step is 2**-4 relative; below its normal range (2**-6 of the
    scale) the step is the subnormal one, 2**-9 of the scale (half: 2**-10)."""
    scale = x.abs().amax(dim=1, keepdim=True) / E4M3_MAX
    return (2.0**-4 + OUT) * x.abs() + 2.0**-10 * scale


def _bound_mantissa(keep: int):
    return lambda x: (2.0 ** -(keep + 1)) * x.abs() + 2.0**-133  # relative; subnormal bf16 steps absolute


def _bound_block(half_step: float):
    """``half_step`` of the block scale, plus its bf16 rounding, plus the output's."""
    def bound(x: torch.Tensor) -> torch.Tensor:
        s = _blocks(x.abs()).amax(dim=2, keepdim=True).expand(-1, -1, BLOCK).reshape(x.shape[0], -1)[:, : x.shape[1]]
        return (half_step + OUT) * s + OUT * x.abs()
    return bound


@dataclasses.dataclass(frozen=True)
class Codec:
    """One state codec. ``encode(states [T, H] bf16/fp16, compressor) -> bytes``;
    ``decode(cell, tokens, hidden, dtype, out=None) -> [T, H]`` tensor of ``dtype``, written into ``out``
    when given (ValueError on a size mismatch);
    ``ratio``: stored bytes / raw bf16 bytes measured on real SmolLM2 states (bench/codecs.out), used for
    disk estimates (``capture run --dry-run``). ``bound(x)``: the largest |decoded - x| the codec allows
    for each value of ``x`` (float32 ``[T, H]``); None for a lossless codec (bit-exact)."""

    name: str
    lossless: bool
    ratio: float
    encode: Callable[[torch.Tensor, zstandard.ZstdCompressor], bytes]
    decode: Callable[..., torch.Tensor]
    bound: Callable[[torch.Tensor], torch.Tensor] | None = None
    dtypes: tuple[str, ...] = ("bfloat16", "float16")  # state dtypes it stores


# The registry: a new codec is its two functions above and one line here.
REGISTRY = {c.name: c for c in (
    Codec("bf16", True, 0.78, _encode_bf16, _decode_bf16),
    Codec("bf16-split", True, 0.69, _encode_split, _decode_split),
    Codec("fp8-e4m3", False, 0.43, _encode_fp8, _decode_fp8, _bound_fp8),
    Codec("bf16-m3", False, 0.45, *_mantissa_codec(3), _bound_mantissa(3), ("bfloat16",)),
    Codec("int8-b32", False, 0.48, *_block_codec("int8-b32", qmax=127), _bound_block(1 / 254)),
    Codec("int6-b32", False, 0.36, *_block_codec("int6-b32", qmax=31), _bound_block(1 / 62)),
    Codec("fp4-b32", False, 0.25, *_block_codec("fp4-b32", levels=E2M1), _bound_block(1 / 6)),
    Codec("int4-b32", False, 0.22, *_block_codec("int4-b32", qmax=7), _bound_block(1 / 14)),
)}
CODECS = tuple(REGISTRY)
LOSSLESS = {name: c.lossless for name, c in REGISTRY.items()}
RATIO = {name: c.ratio for name, c in REGISTRY.items()}


class CellError(ValueError):
    """A state cell whose bytes fail their checksum (:data:`CHECKS`): the shard is damaged."""


# cell checksums (the ``check`` of a schema's state fields): name → (bytes appended, little-endian, function)
CHECKS: dict[str, tuple[int, Callable[[memoryview], int]]] = {
    "xxh3_64": (8, xxhash.xxh3_64_intdigest),  # format 1.4 on
    "crc32": (4, zlib.crc32),  # format 1.3
}


def check(codec: str, dtype: str | None = None) -> str:
    """``codec`` if it is known (and stores ``dtype`` states, when given); raises CaptureError otherwise."""
    if codec not in REGISTRY:
        raise CaptureError(f"unknown codec {codec!r}; known: {', '.join(CODECS)}")
    if dtype is not None and dtype not in REGISTRY[codec].dtypes:
        raise CaptureError(f"codec {codec} stores {' or '.join(REGISTRY[codec].dtypes)} states, not {dtype}")
    return codec


def encode(codec: str, states: torch.Tensor, level: int = ZSTD_LEVEL, check: str | None = None,
           packed: bool = True) -> bytes:
    """Encode ``states`` (bf16 or fp16, ``[T, H]``) into one cell. Releases the GIL inside zstd. ``check``:
    append that checksum of the cell (:data:`CHECKS`, little-endian), so that a damaged byte anywhere in
    it, also in the parts no zstd frame covers (bf16-split's low bytes, fp8's scales), fails to decode.
    ``packed``: ``int4-b32`` codes two a byte (False: one a byte). Which checksum and packing a run's
    format version means is decided by its :class:`shards.format.CellLayout`, which calls this. Raises
    ValueError for an unknown codec or check."""
    if codec not in REGISTRY:
        raise ValueError(f"unknown codec {codec!r}")
    if codec == "int4-b32" and not packed:
        cell = REGISTRY[codec].encode(states, compressor(level), packed=False)
    else:
        cell = REGISTRY[codec].encode(states, compressor(level))
    if check is None:
        return cell
    size, digest = _check(check)
    return cell + digest(cell).to_bytes(size, "little")


def _check(name: str) -> tuple[int, Callable]:
    if name not in CHECKS:
        raise ValueError(f"unknown cell check {name!r}; known: {', '.join(CHECKS)}")
    return CHECKS[name]


def decode(codec: str, cell, tokens: int, hidden: int, dtype: torch.dtype = torch.bfloat16,
           check: str | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode one cell into a ``[tokens, hidden]`` tensor of ``dtype`` (lossy codecs decode to it too).

    ``cell`` is any buffer (bytes, memoryview, ``pyarrow.Buffer``); ``check``: the checksum the cell ends
    with (:func:`encode`). ``out``: write into this ``[tokens, hidden]`` tensor of ``dtype`` (rows may be
    strided, e.g. ``sample[:, l]`` of a ``[T, L, H]`` sample; unit stride along H) and return it:
    ``bf16-split`` and packed ``int4-b32`` decode straight into it in one compiled pass
    (:mod:`shards.kernels`), the others copy. Raises CellError when that checksum fails,
    ``zstandard.ZstdError`` for a damaged frame, ValueError on a size mismatch, an unknown codec or check,
    or an ``out`` of another shape or dtype.
    """
    if codec not in REGISTRY:
        raise ValueError(f"unknown codec {codec!r}")
    if check is not None:
        size, digest = _check(check)
        view = memoryview(cell)
        if len(view) < size or digest(view[:-size]) != int.from_bytes(view[-size:], "little"):
            raise CellError(f"{codec} cell of {len(view)} bytes fails its {check}")
        cell = view[:-size]
    return REGISTRY[codec].decode(cell, tokens, hidden, dtype, out)
