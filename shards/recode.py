"""``capture shards recode SRC DST --codec C``: the same run, its states stored with another codec.

E.g. keep a lossless archive (``bf16-split``) and train from ``fp8-e4m3``. Rows keep their order, ids,
tokens, masks, argmax and finish reasons; only the state cells change. DST is a run folder of its own
(header equal to SRC's but for the codec, same commit protocol), so an interrupted recode resumes by
rerunning it.
Recoding a lossy run into a lossless codec stores the lossy values losslessly (logged as a warning).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pyarrow as pa

from capture.errors import CaptureError
from shards import codecs
from shards import manifest as manifest_mod
from shards.format import STATE_TYPE, schema
from shards.reader import read_table, state_tensor
from shards.writer import Row, ShardWriter

log = logging.getLogger(__name__)


def recode(src: str | os.PathLike, dst: str | os.PathLike, codec: str, *, shard_size: int = 512 * 2**20,
           threads: int = 2) -> dict:
    """Recode every committed row of ``src`` into ``dst``. Returns counts (rows, shards, bytes).

    Raises CaptureError when ``src`` is no run, or ``dst`` holds a run with another identity.
    """
    from filelock import FileLock, Timeout

    codecs.check(codec)
    m = manifest_mod.read(src)
    if m.header is None:
        raise CaptureError(f"{src}: no capture run here ({manifest_mod.MANIFEST} missing)")
    header = {k: v for k, v in m.header.items() if k != "kind"} | {"codec": codec, "lossless": codecs.LOSSLESS[codec]}
    if not codecs.LOSSLESS[m.header["codec"]] and codecs.LOSSLESS[codec]:
        log.warning("%s is %s (lossy): %s stores those lossy values, it does not restore the originals",
                    src, m.header["codec"], codec)
    Path(dst).mkdir(parents=True, exist_ok=True)
    lock = FileLock(Path(dst) / manifest_mod.LOCK)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        raise CaptureError(f"another process is writing to {dst}") from None
    try:
        writer, existing = manifest_mod.ManifestWriter.open(dst, header)
        done = existing.sample_ids()
        out = ShardWriter(dst, schema(header), shard_size, threads=threads)
        counts = {"rows": 0, "shards": 0, "bytes": 0, "already": len(done)}

        def commit(infos):
            for info in infos:
                writer.commit(info)
                counts["shards"] += 1
                counts["bytes"] += info.bytes

        for entry in m.shards:
            table = read_table(Path(src) / entry["path"])
            rows = [_row(table, i) for i in range(table.num_rows) if table["sample_id"][i].as_py() not in done]
            commit(out.write(rows))
            counts["rows"] += len(rows)
        commit(out.close())
        last = {k: v for k, v in (m.completions[-1] if m.completions else {}).items() if k != "kind"}
        writer.complete(last | {"recoded_from": str(Path(src).resolve()), "codec": codec})
        return counts
    finally:
        lock.release()


def _row(table: pa.Table, i: int) -> Row:
    def values(name):
        return table[name][i].values.to_numpy(zero_copy_only=False)

    states = {f.name: state_tensor(table, f.name, i) for f in table.schema if f.type == STATE_TYPE}
    return Row(
        sample_id=table["sample_id"][i].as_py(),
        source=table["source"][i].as_py(),
        row_index=table["row_index"][i].as_py(),
        input_ids=values("input_ids"),
        loss_mask=values("loss_mask"),
        argmax=values("argmax") if "argmax" in table.column_names else None,
        states=states,
        token_sha256=table["token_sha256"][i].as_py(),
        finish_reasons=_finish_reasons(table, i),
    )


def _finish_reasons(table: pa.Table, i: int) -> tuple[str, ...] | None:
    """A row's finish reasons (None in dataset mode and in shards from before the column existed)."""
    if "finish_reasons" not in table.column_names:
        return None
    reasons = table["finish_reasons"][i].as_py()
    return None if reasons is None else tuple(reasons)
