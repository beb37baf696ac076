"""Codec table on real hidden states: ratio to raw bf16, encode / decode MB/s on one core, fidelity.

States: SmolLM2-135M (bf16) over real ShareGPT conversations through its chat template, taps 3/15/27,
each conversation cut to --max-tokens. MB/s are raw bf16 megabytes (1e6) per second of one thread.

    .venv/bin/pip install -e ".[bench]"   # pcodec for the lossless comparison
    python bench/codecs.py [--tokens 13600] [--max-tokens 1024]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import pyarrow as pa
import torch

from harness import encoded, header, interleaved, smollm2, smollm2_taps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=13600)
    ap.add_argument("--max-tokens", type=int, default=1024)
    ap.add_argument("--passes", type=int, default=3)
    args = ap.parse_args()
    header()
    torch.set_num_threads(1)

    from capture.engines.hf import HFEngine
    from shards import codecs
    from shards.format import FORMAT_VERSION

    mdir = smollm2()
    engine = HFEngine(str(mdir), smollm2_taps((3, 15, 27)), argmax=False, threads=2)
    states, tokens = [], 0
    for _, rec in encoded(mdir, specials=True):
        if isinstance(rec, str):
            continue
        cap = engine.forward([rec.input_ids[: args.max_tokens]])[0]
        states += list(cap.states.values())
        tokens += cap.states["tap_3"].shape[0]
        if tokens >= args.tokens:
            break
    torch.set_num_threads(1)
    raw = sum(x.numel() * 2 for x in states)
    print(f"{tokens:,} tokens of real SmolLM2 states (taps 3/15/27, hidden 576, bf16), {raw / 1e6:.1f} MB raw; "
          "one thread")
    print()
    print(f"cells as a capture writes them (format {FORMAT_VERSION}: with their XXH3-64, checked when decoding); "
          f"median of {args.passes} passes\n")
    print("| codec | lossless | bytes vs raw bf16 | encode MB/s | decode MB/s | per-token cosine (mean / min) |")
    print("|---|---|---|---|---|---|")
    cos = torch.nn.functional.cosine_similarity
    for codec in codecs.CODECS:
        t_enc, t_dec = [], []
        for _ in range(args.passes):  # the median pass: a first pass also pays page faults of fresh buffers
            t = time.perf_counter()
            cells = [codecs.encode(codec, x, check="xxh3_64") for x in states]
            t_enc.append(time.perf_counter() - t)
            bufs = [pa.py_buffer(c) for c in cells]
            t = time.perf_counter()
            out = [codecs.decode(codec, b, *x.shape, check="xxh3_64") for b, x in zip(bufs, states)]
            t_dec.append(time.perf_counter() - t)
        t_enc, t_dec = statistics.median(t_enc), statistics.median(t_dec)
        size = sum(len(c) for c in cells)
        if codecs.LOSSLESS[codec]:
            assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(states, out))
            fidelity = "bit-exact"
        else:
            sims = torch.cat([cos(a.float(), b.float(), dim=-1) for a, b in zip(states, out)])
            fidelity = f"{sims.mean():.5f} / {sims.min():.5f}"
        print(f"| {codec} | {'yes' if codecs.LOSSLESS[codec] else 'no'} | {size / raw:.3f}x | "
              f"{raw / 1e6 / t_enc:,.0f} | {raw / 1e6 / t_dec:,.0f} | {fidelity} |")
    # the alternative layout for bf16-split: high bytes channel-major ([H, T]) before zstd
    import zstandard

    zc, zd = zstandard.ZstdCompressor(level=codecs.ZSTD_LEVEL), zstandard.ZstdDecompressor()
    t = time.perf_counter()
    cells = []
    for x in states:
        pairs = x.view(torch.int16).numpy().view(np.uint8).reshape(*x.shape, 2)
        cells.append((zc.compress(np.ascontiguousarray(pairs[..., 1].T)), np.ascontiguousarray(pairs[..., 0])))
    t_enc = time.perf_counter() - t
    t = time.perf_counter()
    for (high, low), x in zip(cells, states):
        tokens, hidden = x.shape
        pairs = np.empty((tokens, hidden, 2), dtype=np.uint8)
        pairs[..., 0] = low
        pairs[..., 1] = np.frombuffer(zd.decompress(high), dtype=np.uint8).reshape(hidden, tokens).T
    t_dec = time.perf_counter() - t
    size = sum(len(h) + lo.nbytes for h, lo in cells)
    print(f"| (bf16-split, high bytes channel-major; not used) | yes | {size / raw:.3f}x | {raw / 1e6 / t_enc:,.0f} | "
          f"{raw / 1e6 / t_dec:,.0f} | bit-exact |")
    # the floor for a coder that sees one byte at a time with per-channel statistics (FIELD-NOTES)
    entropy, channels = 0.0, 0
    for tap in range(3):  # states alternate tap 3, 15, 27 per conversation
        bits = np.concatenate([x.view(torch.int16).numpy().view(np.uint16) for x in states[tap::3]])
        high = (bits >> 8).astype(np.uint8)
        for j in range(high.shape[1]):
            p = np.bincount(high[:, j], minlength=256) / high.shape[0]
            p = p[p > 0]
            entropy += float(-(p * np.log2(p)).sum())
            channels += 1
    floor = (entropy / channels / 8 + 1) / 2
    print()
    print(f"order-0 floor with per-channel statistics (high byte {entropy / channels:.2f} bits, low byte "
          f"stored raw): {floor:.3f}x")
    cell_checks(states, args.passes)
    zstd_contexts(states, args.passes)
    lossless_stretch(states, raw)


def cell_checks(states: list, passes: int) -> None:
    """Format 1.3's CRC-32 (zlib) against 1.4's XXH3-64 over the bf16-split cells: GB/s of cell."""
    import zlib

    import xxhash

    from shards import codecs

    cells = [codecs.encode("bf16-split", x, check="xxh3_64") for x in states]
    cell_bytes = sum(len(c) for c in cells)
    speeds = {}
    for name, fn in (("crc32 (zlib, format 1.3)", zlib.crc32), ("xxh3_64 (xxhash, format 1.4)", xxhash.xxh3_64_intdigest)):
        def check_all() -> None:
            for c in cells:
                fn(c)

        runs, _ = interleaved({name: check_all}, passes)
        speeds[name] = cell_bytes / 1e9 / statistics.median(runs[name])
    print("\ncell checks over the bf16-split cells (GB/s of cell, one thread): "
          + ", ".join(f"{k} {v:,.1f}" for k, v in speeds.items()))


def zstd_contexts(states: list, passes: int) -> None:
    """The zstd frames of the bf16-split cells decompressed with a fresh ZstdDecompressor per cell (the
    codecs before 2026-12-03) and with one reused per thread (shards.codecs.decompressor): MB/s of bf16."""
    import zstandard

    from shards import codecs

    frames = []
    for x in states:
        cell = codecs.encode("bf16-split", x)
        frames.append((memoryview(cell)[: len(cell) - x.numel()], x.numel()))
    raw = sum(2 * n for _, n in frames)
    speeds = {}
    for name, get in (("a fresh context per cell", zstandard.ZstdDecompressor), ("one per thread", codecs.decompressor)):
        def decompress_all() -> None:
            for frame, n in frames:
                get().decompress(frame, max_output_size=n)

        runs, _ = interleaved({name: decompress_all}, passes)
        speeds[name] = raw / 1e6 / statistics.median(runs[name])
    print("zstd part of a bf16-split decode (MB/s of bf16, one thread): "
          + ", ".join(f"{k} {v:,.0f}" for k, v in speeds.items()))


def lossless_stretch(states: list, raw: int) -> None:
    """Issue 16 part 2: does any lossless coder beat bf16-split by >= 0.02x at >= 300 MB/s encode per core?
    Tried: context modelling of the high (sign+exponent) byte from the previous token's (XOR, same
    channel) and from the neighbouring tap's (XOR, same token and channel; a cell would then hold all
    taps of a row), zstd-19 on the byte planes, and pcodec (a numeric codec, if installed) on the 16-bit
    words, token- and channel-major. The low bytes stay raw in every variant but pcodec's."""
    import zstandard

    print("\n## Lossless stretch (bytes vs raw bf16; encode MB/s of raw bf16, one thread)\n")
    print("| variant | bytes vs raw bf16 | encode MB/s |\n|---|---|---|")

    def planes(x):
        pairs = x.view(torch.int16).numpy().view(np.uint8).reshape(*x.shape, 2)
        return np.ascontiguousarray(pairs[..., 1]), np.ascontiguousarray(pairs[..., 0])

    def row(name, fn):
        t = time.perf_counter()
        size = sum(fn(i, x) for i, x in enumerate(states))
        print(f"| {name} | {size / raw:.3f}x | {raw / 1e6 / (time.perf_counter() - t):,.0f} |", flush=True)

    z1, z19 = zstandard.ZstdCompressor(level=1), zstandard.ZstdCompressor(level=19)
    row("bf16-split (high bytes zstd-1, low raw)", lambda i, x: len(z1.compress(planes(x)[0])) + x.numel())

    def prev_token(i, x):
        high = planes(x)[0]
        ctx = np.vstack([np.zeros((1, high.shape[1]), np.uint8), high[:-1]])
        return len(z1.compress(high ^ ctx)) + x.numel()

    row("high byte XOR previous token's, zstd-1", prev_token)

    def prev_tap(i, x):  # states alternate tap 3, 15, 27 per conversation: i % 3 == 0 has no neighbour
        high = planes(x)[0]
        ctx = planes(states[i - 1])[0] if i % 3 else np.zeros_like(high)
        return len(z1.compress(high ^ ctx)) + x.numel()

    row("high byte XOR neighbouring tap's, zstd-1", prev_tap)
    row("byte planes, zstd-19 (both planes)", lambda i, x: sum(len(z19.compress(p)) for p in planes(x)))
    try:
        from pcodec import ChunkConfig, standalone
    except ImportError:
        print("| pcodec | (not installed: pip install pcodec) | |")
        return
    words = lambda x: x.view(torch.int16).numpy().view(np.uint16)  # noqa: E731
    config = ChunkConfig()
    row("pcodec, uint16 words token-major", lambda i, x: len(standalone.simple_compress(words(x).reshape(-1), config)))
    row("pcodec, uint16 words channel-major",
        lambda i, x: len(standalone.simple_compress(np.ascontiguousarray(words(x).T).reshape(-1), config)))


if __name__ == "__main__":
    main()
