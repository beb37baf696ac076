"""What ``capture shards ls|stat|head`` print: per-shard lines, run totals, first rows."""

from __future__ import annotations

import collections
import os
from pathlib import Path

import torch

from shards import manifest as manifest_mod
from shards.fs import as_location
from shards.reader import read_table, state_tensor


def ls(run_dir: str | os.PathLike) -> list[dict]:
    """One dict per committed shard, in commit order (path, rows, tokens, loss_tokens, bytes, sha256)."""
    keys = ("path", "rows", "tokens", "loss_tokens", "bytes", "sha256")
    return [{k: s[k] for k in keys} for s in manifest_mod.read(run_dir).shards]


def stat(run_dir: str | os.PathLike) -> dict:
    """Run totals: rows, tokens, supervised tokens, bytes, bytes per token against raw bf16, per source.

    Reads only the ``source``, token-count and (regenerate runs) ``finish_reasons`` columns of each shard
    (no state is decompressed); ``finish_reasons`` counts generated turns by reason.
    """
    loc = as_location(run_dir)
    m = manifest_mod.read(loc)
    if m.header is None:
        return {"run": str(run_dir), "shards": 0}
    per_source: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    regenerated = (m.header.get("responses") or {}).get("mode") == "regenerate"
    finished: collections.Counter = collections.Counter()
    fs = None if loc.local else loc.filesystem
    for path in (Path(loc.path) / s["path"] if loc.local else loc.join(s["path"]) for s in m.shards):
        t = read_table(path, ["source", "num_tokens", "num_loss_tokens"] + (["finish_reasons"] if regenerated else []),
                       filesystem=fs)
        for src, n, k in zip(t["source"].to_pylist(), t["num_tokens"].to_pylist(), t["num_loss_tokens"].to_pylist()):
            per_source[src].update(rows=1, tokens=n, loss_tokens=k)
        if regenerated:
            finished.update(r for reasons in t["finish_reasons"].to_pylist() for r in reasons or ())
    rows = sum(s["rows"] for s in m.shards)
    tokens = sum(s["tokens"] for s in m.shards)
    nbytes = sum(s["bytes"] for s in m.shards)
    raw_per_token = len(m.header["columns"]) * m.header["hidden_size"] * 2
    return {
        "run": str(run_dir),
        "target": m.header["target"]["name"],
        "columns": m.header["columns"],
        "hidden_size": m.header["hidden_size"],
        "codec": m.header["codec"],
        "engine": " ".join(str(v) for v in (m.header.get("engine") or {"name": "hf"}).values()),
        "responses": (m.header.get("responses") or {}).get("mode", "dataset"),
        **({"finish_reasons": dict(finished)} if regenerated else {}),
        "complete": m.complete,
        "last_completion": {k: v for k, v in m.completions[-1].items() if k != "kind"} if m.completions else None,
        "shards": len(m.shards),
        "rows": rows,
        "tokens": tokens,
        "loss_tokens": sum(s["loss_tokens"] for s in m.shards),
        "bytes": nbytes,
        "bytes_per_token": round(nbytes / tokens, 1) if tokens else None,
        "raw_state_bytes_per_token": raw_per_token,
        "ratio_to_raw_states": round(nbytes / (tokens * raw_per_token), 4) if tokens else None,
        "sources": {s: dict(c) | {"token_share": round(c["tokens"] / tokens, 4)}
                    for s, c in sorted(per_source.items(), key=lambda kv: -kv[1]["tokens"])},
    }


def head(run_dir: str | os.PathLike, n: int = 5) -> list[dict]:
    """The first ``n`` committed rows: ids, lengths, the first token ids, per-column state norms."""
    out = []
    for path in (Path(run_dir) / s["path"] for s in manifest_mod.read(run_dir).shards):
        table = read_table(path)
        states = [f.name for f in table.schema if f.name.startswith("tap_") or f.name == "final"]
        for i in range(min(n - len(out), table.num_rows)):
            ids = table["input_ids"][i].values.to_numpy()
            out.append({
                "sample_id": table["sample_id"][i].as_py(),
                "source": table["source"][i].as_py(),
                "num_tokens": table["num_tokens"][i].as_py(),
                "num_loss_tokens": table["num_loss_tokens"][i].as_py(),
                "input_ids[:12]": ids[:12].tolist(),
                "token_sha256": table["token_sha256"][i].as_py()[:16],
                **({"finish_reasons": r} if "finish_reasons" in table.column_names
                   and (r := table["finish_reasons"][i].as_py()) is not None else {}),
                **{f"|{c}| mean": round(float(torch.linalg.vector_norm(state_tensor(table, c, i).float(), dim=-1).mean()), 2)
                   for c in states},
            })
        if len(out) >= n:
            break
    return out
