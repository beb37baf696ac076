"""What ``capture shards ls|stat|head`` print: per-shard lines, run totals, first rows."""

from __future__ import annotations

import collections
import os

import numpy as np
import pyarrow.compute as pc
import torch

from shards import manifest as manifest_mod
from shards import topk as topk_mod
from shards.rows import read_row
from shards.run import Location, as_location


def ls(run: str | os.PathLike | Location) -> list[dict]:
    """One dict per committed shard, in commit order (path, rows, tokens, loss_tokens, bytes, sha256)."""
    keys = ("path", "rows", "tokens", "loss_tokens", "bytes", "sha256")
    return [{k: s[k] for k in keys} for s in manifest_mod.read(run).shards]


def stat(run: str | os.PathLike | Location) -> dict:
    """Run totals: rows, tokens, supervised tokens, bytes, bytes per token against raw bf16, per source.

    Counts the shards on disk; ``removed`` (only when there are any) the shards a ``--retain`` run deleted
    after its readers consumed them: shards, rows, tokens.

    Reads only the ``source``, token-count, (regenerate runs) ``finish_reasons`` and (``--topk`` runs) the
    top-K columns of each shard (no cell is decompressed); ``finish_reasons`` counts generated turns by
    reason. ``bytes_per_token`` counts whole shard files; ``topk_bytes_per_token`` the two top-K cells
    alone (``topk`` K > 0 only); ``ratio_to_raw_states`` is all bytes over the raw bf16 state bytes.
    """
    loc = as_location(run)
    m = manifest_mod.read(loc)
    if m.header is None:
        return {"run": str(run), "shards": 0}
    h = m.header
    per_source: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    regenerated = h.mode == "regenerate"
    finished: collections.Counter = collections.Counter()
    topk_bytes = 0
    for shard in m.shards:
        t = loc.read_table(shard["path"], ["source", "num_tokens", "num_loss_tokens"]
                           + (["finish_reasons"] if regenerated else []) + (list(topk_mod.COLUMNS) if h.topk else []), shard["rows"])
        if h.topk:
            topk_bytes += sum(int(pc.sum(pc.binary_length(t[c])).as_py() or 0) for c in topk_mod.COLUMNS)
        for src, n, k in zip(t["source"].to_pylist(), t["num_tokens"].to_pylist(), t["num_loss_tokens"].to_pylist()):
            per_source[src].update(rows=1, tokens=n, loss_tokens=k)
        if regenerated:
            finished.update(r for reasons in t["finish_reasons"].to_pylist() for r in reasons or ())
    rows, tokens = sum(s["rows"] for s in m.shards), sum(s["tokens"] for s in m.shards)
    nbytes = sum(s["bytes"] for s in m.shards)
    return {
        "run": str(run),
        "target": h.target["name"],
        "columns": list(h.columns),
        "hidden_size": h.hidden_size,
        "codec": h.codec,
        "engine": " ".join(str(v) for v in h.engine.values()),
        "responses": h.mode,
        **({"finish_reasons": dict(finished)} if regenerated else {}),
        "complete": m.complete,
        "last_completion": {k: v for k, v in m.completions[-1].items() if k != "kind"} if m.completions else None,
        "shards": len(m.shards),
        **({"removed": {"shards": len(m.removed), "rows": sum(s["rows"] for s in m.removed.values()),
                        "tokens": sum(s["tokens"] for s in m.removed.values())}} if m.removed else {}),
        "rows": rows,
        "tokens": tokens,
        "loss_tokens": sum(s["loss_tokens"] for s in m.shards),
        "bytes": nbytes,
        "bytes_per_token": round(nbytes / tokens, 1) if tokens else None,
        "raw_state_bytes_per_token": h.raw_bytes_per_token,
        **({"topk": h.topk, "topk_bytes_per_token": round(topk_bytes / tokens, 1) if tokens else None}
           if h.topk else {}),
        "ratio_to_raw_states": round(nbytes / (tokens * h.raw_bytes_per_token), 4) if tokens else None,
        "sources": {s: dict(c) | {"token_share": round(c["tokens"] / tokens, 4)}
                    for s, c in sorted(per_source.items(), key=lambda kv: -kv[1]["tokens"])},
    }


def head(run: str | os.PathLike | Location, n: int = 5) -> list[dict]:
    """The first ``n`` committed rows: ids, lengths, the first token ids, per-column state norms; for a
    ``--topk`` run the top-5 ids at position 0 and the mean top-K probability mass (``sum exp`` over K)."""
    loc = as_location(run)
    out = []
    for shard in manifest_mod.read(loc).shards:
        table = loc.read_table(shard["path"], rows=shard["rows"])
        for i in range(min(n - len(out), table.num_rows)):
            r = read_row(table, i)
            out.append({
                "sample_id": r.sample_id,
                "source": r.source,
                "num_tokens": r.num_tokens,
                "num_loss_tokens": r.num_loss_tokens,
                "input_ids[:12]": r.input_ids[:12].tolist(),
                "token_sha256": r.token_sha256[:16],
                **({"finish_reasons": list(r.finish_reasons)} if r.finish_reasons is not None else {}),
                **{f"|{c}| mean": round(float(torch.linalg.vector_norm(t.float(), dim=-1).mean()), 2)
                   for c, t in r.states.items()},
                **({"topk_ids[0][:5]": r.topk_ids[0, :5].tolist(),
                    "topk mass mean": round(float(np.exp(r.topk_logprobs.astype(np.float64)).sum(1).mean()), 4)}
                   if r.topk_ids is not None else {}),
            })
        if len(out) >= n:
            break
    return out
