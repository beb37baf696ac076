"""Where one reader core's time goes, stage by stage, for a run's codec, against the goal of 1.5 GB/s of
bf16 per core.

    python bench/reader_stages.py RUN [RUN ...] [--passes 5]

Each RUN is a capture run folder (its codec from its header; ``bf16-split`` and the block codecs
``int*-b32`` / ``fp4-b32`` are broken down). Make them as bench/reader.py says, then e.g.::

    capture shards recode /tmp/reader-bench-run /tmp/reader-bench-int4 --codec int4-b32

Stages, each over every state cell of the run (taps and final), one thread (``torch.set_num_threads(1)``),
CPU seconds (``time.process_time``), warm page cache, median (and range) of ``--passes`` interleaved passes;
"GB/s" counts the bf16 bytes the stage stands for (T * H * 2 per cell), so the rows compare directly:

- ``zstd stage alone``: only the cell's zstd frame decompressed (bf16-split: the high-byte plane; block
  codecs: scales and codes), with python-zstandard (the reader's) and with pyarrow's own zstd: the
  ceiling of any reader of this codec, whatever it does after.
- ``codec decode, every cell``: :func:`shards.codecs.decode` of every cell into a new ``[T, H]`` tensor
  (checksum, zstd, then the interleave / dequantize pass).
- ``codec decode into [T, L, H] samples``: each row's taps decoded into their slices of one ``[T, L, H]``
  tensor (``out=``), the final state alone: what the stream does with the states.
- ``ShardStream``: the finished samples (ids, mask, argmax, taps, final).

The last lines say how fast everything after zstd would have to run for 1.5 GB/s end to end.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import pyarrow as pa
import torch
import zstandard

from harness import header, interleaved
from shards import codecs
from shards.manifest import read as read_manifest
from shards.reader import read_table, shard_paths
from shards.rows import cell_check, state_columns
from shards.stream import ShardStream

GOAL = 1.5  # GB/s of bf16 per core (issue 17)


def load_cells(run: Path) -> tuple[list[tuple[int, list[pa.Buffer]]], str | None]:
    """Every row's state cells, ``(tokens, [cell per state column])``, copied out of the shards once."""
    rows, check = [], None
    for path in shard_paths(run):
        table = read_table(path)
        check = cell_check(table.schema)
        columns = state_columns(table)
        tokens = table.column("num_tokens").to_pylist()
        for i, t in enumerate(tokens):
            rows.append((t, [table.column(c)[i].as_buffer() for c in columns]))
    return rows, check


def frame(codec: str, cell: pa.Buffer, tokens: int, hidden: int, check: str | None) -> tuple[memoryview, int]:
    """The zstd frame of a cell and its decompressed size (see the table in :mod:`shards.codecs`)."""
    body = memoryview(cell)[: len(cell) - (codecs.CHECKS[check][0] if check else 0)]
    if codec == "bf16-split":
        body = body[: len(body) - tokens * hidden]
    return body, zstandard.frame_content_size(body)


def stages(run: Path, rows, check: str | None, hidden: int) -> dict:
    codec = read_manifest(run).header.codec
    frames = [[frame(codec, c, t, hidden, check) for c in cells] for t, cells in rows]
    zd = codecs.decompressor()
    arrow = pa.Codec("zstd")
    arrow_frames = [[(pa.py_buffer(f), n) for f, n in fs] for fs in frames]

    def zstd_alone():
        for fs in frames:
            for f, n in fs:
                zd.decompress(f, max_output_size=n)

    def zstd_arrow():
        for fs in arrow_frames:
            for f, n in fs:
                arrow.decompress(f, decompressed_size=n)

    def decode():
        for t, cells in rows:
            for c in cells:
                codecs.decode(codec, c, t, hidden, check=check)

    def decode_into():
        for t, cells in rows:
            taps = torch.empty(t, len(cells) - 1, hidden, dtype=torch.bfloat16)
            for i, c in enumerate(cells[:-1]):
                codecs.decode(codec, c, t, hidden, check=check, out=taps[:, i])
            codecs.decode(codec, cells[-1], t, hidden, check=check)

    def stream():
        for _ in ShardStream(run):
            pass

    return {"zstd stage alone (python-zstandard)": zstd_alone, "zstd stage alone (pyarrow's zstd)": zstd_arrow,
            "codec decode, every cell": decode, "codec decode into [T, L, H] samples": decode_into,
            "ShardStream samples": stream}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--passes", type=int, default=5)
    args = parser.parse_args()
    header()
    torch.set_num_threads(1)
    for run in args.runs:
        run_header = read_manifest(run).header
        hidden = run_header.hidden_size
        rows, check = load_cells(run)
        nbytes = sum(t * hidden * 2 * len(cells) for t, cells in rows)
        fns = stages(run, rows, check, hidden)
        for fn in fns.values():  # warm up: imports, page cache, allocator
            fn()
        _, secs = interleaved(fns, args.passes)
        print(f"\n{run}: codec {run_header.codec}, {len(rows)} rows, {sum(t for t, _ in rows):,} tokens, "
              f"{len(rows[0][1])} state columns x hidden {hidden}, {nbytes / 1e6:,.0f} MB of bf16; one thread, "
              f"CPU time, median (min-max) of {args.passes} interleaved passes")
        print(f"| stage | GB/s of bf16 per core |\n|---|---|")
        rate = {}
        for name, s in secs.items():
            rate[name] = nbytes / statistics.median(s) / 1e9
            print(f"| {name} | {rate[name]:.2f} ({nbytes / max(s) / 1e9:.2f}-{nbytes / min(s) / 1e9:.2f}) |")
        z = rate["zstd stage alone (python-zstandard)"]
        if z > GOAL:
            need = 1 / (1 / GOAL - 1 / z)
            print(f"for {GOAL} GB/s end to end, everything after zstd must run at >= {need:.1f} GB/s; "
                  f"it runs at {1 / (1 / rate['ShardStream samples'] - 1 / z):.1f} in ShardStream")
        else:
            print(f"the zstd stage alone is below {GOAL} GB/s: no reader of this codec reaches it on this CPU")


if __name__ == "__main__":
    main()
