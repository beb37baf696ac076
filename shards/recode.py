"""``capture shards recode SRC DST --codec C``: the same run, its states stored with another codec.

E.g. keep a lossless archive (``bf16-split``) and train from ``fp8-e4m3``. Rows keep their order, ids,
tokens, masks, argmax, top-K cells (decoded and encoded again: the same values, bit for bit) and finish
reasons; only the state cells change. DST is a run folder of its own
(header equal to SRC's but for the codec, same commit protocol), so an interrupted recode resumes by
rerunning it.
Recoding a lossy run into a lossless codec stores the lossy values losslessly (logged as a warning).
DST gets SRC's ``provenance.json`` (target, weights, tokenizer, dataset: what its rows were made from)
with a ``recoded`` entry added (source run, codec, format version, time), so a trainer finds the target
folder and ``capture provenance verify`` checks the weights as for SRC.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import time

from common.errors import CaptureError
from shards import codecs
from shards import manifest as manifest_mod
from shards.format import FORMAT_VERSION, schema
from shards.rows import read_row
from shards.run import LOCK, Location, as_location
from shards.writer import ShardWriter

log = logging.getLogger(__name__)


def recode(src: str | os.PathLike | Location, dst: str | os.PathLike | Location, codec: str, *,
           shard_size: int = 512 * 2**20, threads: int = 2) -> dict:
    """Recode every committed row of ``src`` into ``dst`` (each a path, a URI or a Location). Returns
    counts (rows, shards, bytes, already).

    Raises CaptureError when ``src`` is no run, ``dst`` holds a run with another identity or other files
    but no run, or another process writes ``dst``.
    """
    codecs.check(codec)
    source, target = as_location(src), as_location(dst)
    m = manifest_mod.read(source)
    if m.header is None:
        raise CaptureError(f"{src}: no capture run here ({source.manifest_name} missing)")
    header = m.header.replace(codec=codec, format_version=FORMAT_VERSION)  # the copy is this version's
    if not m.header.lossless and header.lossless:
        log.warning("%s is %s (lossy): %s stores those lossy values, it does not restore the originals",
                    src, m.header.codec, codec)
    if target.is_folder() and manifest_mod.read(target).header is None and \
            [e for e in target.entries() if e != LOCK]:
        raise CaptureError(f"{dst} is not empty and holds no capture run; recode into a new or empty folder")
    with target.lock(busy=f"another process is writing to {dst}"):
        writer, existing = manifest_mod.ManifestWriter.open(target, header)
        done = existing.sample_ids()
        out = ShardWriter(target, schema(header), shard_size, threads=threads)
        counts = {"rows": 0, "shards": 0, "bytes": 0, "already": len(done)}

        def commit(infos):
            for info in infos:
                writer.commit(info)
                counts["shards"] += 1
                counts["bytes"] += info.bytes

        try:
            for entry in m.shards:
                table = source.read_table(entry["path"], rows=entry["rows"])
                rows = [read_row(table, i) for i in range(table.num_rows) if table["sample_id"][i].as_py() not in done]
                commit(out.write(rows))
                counts["rows"] += len(rows)
            commit(out.close())
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
            out.abort()  # its open shard was never committed
            written = sum(s["rows"] for s in manifest_mod.read(target).all_shards)
            raise CaptureError(f"the disk at {dst} is full ({e.strerror}): stopped cleanly, {written} of {m.rows} rows "
                               "recoded and committed, nothing half-written; free space and rerun the same command "
                               "to recode the rest") from None
        last = {k: v for k, v in (m.completions[-1] if m.completions else {}).items() if k != "kind"}
        writer.complete(last | {"recoded_from": str(source.absolute()), "codec": codec})
        _copy_provenance(source, target, codec)
        return counts


def _copy_provenance(source: Location, target: Location, codec: str) -> None:
    """SRC's ``provenance.json`` into DST with ``recoded: {"from", "codec", "format_version", "time"}`` (a
    recode of a recode keeps the first source's record and names the last). Nothing when SRC has none."""
    if not source.exists("provenance.json"):
        log.warning("%s has no provenance.json; the recoded run has none either", source.path)
        return
    data = json.loads(source.read_bytes("provenance.json"))
    data["recoded"] = {"from": str(source.absolute()), "codec": codec, "format_version": FORMAT_VERSION,
                       "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    target.write_bytes("provenance.json", json.dumps(data, indent=1, sort_keys=True).encode() + b"\n")
