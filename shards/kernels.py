"""Compiled decode passes (numba): the last step of a cell's decode, written straight into the sample.

A reader core spends most of a decode in zstd; what follows must be one pass over the output or the
reader cannot keep up (docs/performance.md "Reader speed": at this CPU's ~1.8 GB/s zstd stage, 1.5 GB/s
of finished bf16 samples leaves ~9 GB/s for everything else; numpy/torch take 2-3 passes and a copy
into the stacked ``[T, L, H]`` sample). Each kernel here is one vectorized loop (numba/LLVM), checked bit for
bit against the numpy/torch path it replaces (tests/test_codecs.py).

Output convention: ``out`` is a flat ``uint16`` array (16-bit patterns of bf16 or fp16) and row ``t`` of
the ``[T, H]`` result lands at ``out[offset + t * stride : ... + H]``; so a tap decodes into its slice
``[:, l, :]`` of a C-contiguous ``[T, L, H]`` sample (``offset = l * H``, ``stride = L * H``) with no
stacking copy. Compiled on first use in a process (about a second each), then cached beside this file
(numba's ``cache=True``; ``NUMBA_CACHE_DIR`` where that is read-only).
"""

from __future__ import annotations

import numba
import numpy as np
from numba import types
from numba.extending import intrinsic


@intrinsic
def _f32_bits(typingctx, x):
    """The IEEE bit pattern of a float32 as uint32 (an LLVM bitcast, no memory round trip)."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], context.get_value_type(types.uint32))
    return types.uint32(types.float32), codegen


@intrinsic
def _bits_f32(typingctx, x):
    """The float32 whose IEEE bit pattern is the uint32 ``x``."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], context.get_value_type(types.float32))
    return types.float32(types.uint32), codegen


@numba.njit(nogil=True, cache=True, boundscheck=False)
def _bf16(u):
    """float32 bits → bf16 bits, rounded to nearest, ties to even: torch's float→bf16 rounding
    (c10::BFloat16 round_to_nearest_even) for every finite and infinite value (NaN is not handled here:
    the kernels refuse a cell with a non-finite scale, which the caller decodes with torch)."""
    return np.uint16((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))


@numba.njit(nogil=True, cache=True, boundscheck=False)
def _finite(bits):
    """Whether every bf16 bit pattern in ``bits`` is finite (exponent not all ones)."""
    for i in range(bits.shape[0]):
        if bits[i] & np.uint16(0x7F80) == np.uint16(0x7F80):
            return False
    return True


@numba.njit(nogil=True, cache=True, boundscheck=False)
def interleave(high, low, out, offset, stride, hidden):
    """``bf16-split``: ``out`` rows ← ``(high << 8) | low``. ``high``, ``low``: uint8 ``[T * H]`` byte planes
    (token-major); ``out``: flat uint16, row ``t`` at ``offset + t * stride``."""
    for t in range(high.shape[0] // hidden):
        o = out[offset + t * stride: offset + t * stride + hidden]
        hi = high[t * hidden: (t + 1) * hidden]
        lo = low[t * hidden: (t + 1) * hidden]
        for h in range(hidden):
            o[h] = (np.uint16(hi[h]) << np.uint16(8)) | np.uint16(lo[h])


@numba.njit(nogil=True, cache=True, boundscheck=False)
def dequantize_nibble_pairs(scales, codes, out, offset, stride, hidden, zero):
    """:func:`dequantize_nibbles` where ``hidden % 32 == 0`` and rows start at even positions: ``out`` is
    the flat output as uint32 (``offset``, ``stride`` in uint32 units) and each code byte becomes one
    uint32 holding its two bf16 values (little-endian: low nibble's first), so stores need no interleave
    (~1.7x the 16-bit kernel's speed here: 8-9 vs ~5 GB/s of bf16). Returns False, writing nothing, when a
    scale is not finite."""
    if not _finite(scales):
        return False
    nb = hidden // 32
    for t in range(scales.shape[0] // nb):
        row = offset + t * stride
        for b in range(nb):
            k = t * nb + b
            s = _bits_f32(np.uint32(scales[k]) << np.uint32(16))
            c = codes[k * 16: k * 16 + 16]
            o = out[row + b * 16: row + b * 16 + 16]
            for j in range(16):
                v = np.int32(c[j])
                lo = np.uint32(_bf16(_f32_bits(np.float32((v & 15) - zero) * s)))
                hi = np.uint32(_bf16(_f32_bits(np.float32((v >> 4) - zero) * s)))
                o[j] = lo | (hi << np.uint32(16))
    return True


@numba.njit(nogil=True, cache=True, boundscheck=False)
def dequantize_nibbles(scales, codes, out, offset, stride, hidden, zero):
    """Block codes two a byte (low nibble first), integer levels ``nibble - zero``: ``out`` rows ← bf16 of
    ``(nibble - zero) * s``, the float32 product (exact: a 4-bit integer times an 8-bit significand) rounded
    once to bf16, as torch's bf16 ``levels * scales`` rounds it. ``scales``: uint16 bf16 bits ``[T * nb]``;
    ``codes``: uint8 ``[T * nb * 16]`` (nb = ceil(H / 32), the last block zero-padded). Returns False,
    writing nothing, when a scale is not finite (inf/NaN products: the caller decodes that cell with torch)."""
    if not _finite(scales):
        return False
    nb = (hidden + 31) // 32
    full = hidden // 32
    for t in range(scales.shape[0] // nb):
        row = offset + t * stride
        for b in range(full):
            k = t * nb + b
            s = _bits_f32(np.uint32(scales[k]) << np.uint32(16))
            c = codes[k * 16: k * 16 + 16]
            o = out[row + b * 32: row + b * 32 + 32]
            for j in range(16):
                v = np.int32(c[j])
                o[2 * j] = _bf16(_f32_bits(np.float32((v & 15) - zero) * s))
                o[2 * j + 1] = _bf16(_f32_bits(np.float32((v >> 4) - zero) * s))
        if full < nb:  # the last, zero-padded block: only its first hidden - 32 * full values
            k = t * nb + full
            s = _bits_f32(np.uint32(scales[k]) << np.uint32(16))
            for j in range(hidden - 32 * full):
                v = np.int32(codes[k * 16 + j // 2])
                v = (v >> 4) if j % 2 else (v & 15)
                out[row + 32 * full + j] = _bf16(_f32_bits(np.float32(v - zero) * s))
    return True
