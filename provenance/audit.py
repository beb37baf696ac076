"""``capture audit``: match every captured conversation, token by token, against the public dataset.

The reference (a local file or a hub id) is tokenized with the run's own chat template (its text is in
the shard header), tokenizer (its hash must equal the header's), system prompt, special-text policy,
alternation and template kwargs (from ``provenance.json`` and the header), and indexed by hashes
(:mod:`provenance.reference`). Then each captured row falls in exactly one category, tried in this order:

=======================  ==========================================================================
category                 the captured ``input_ids``...
=======================  ==========================================================================
exact                    equal a whole reference row (duplicates matched as a multiset)
truncated                equal a prefix of a reference row (``--overlength truncate``, context limit)
regenerated              start with a reference prompt up to an answer start, and the run regenerated
                         its answers (``responses.mode == "regenerate"``); only the prompt before the
                         first generated token is compared
engine_health_check      match nothing and their prompt asks for "OK" (:data:`HEALTH_CHECK`) within
                         :data:`HEALTH_CHECK_MAX_TOKENS` tokens: a serving engine's own health check
engine_random_tokens     match nothing, do not start with the template's first token, and do not
                         survive decode → encode: token ids drawn at random (an engine's timing request)
unmatched                none of the above; diagnosed (below)
=======================  ==========================================================================

A diagnosis names the reference row sharing the longest indexed prefix with the captured row, the exact
number of shared tokens, and the first differing token: its position, both token ids, and the reference
message it falls in (index with the system turn as 0, and role). Candidates come from the prefix index
(answer edges and powers of two), so the row named shares at least half of the longest shared prefix any
reference row has; the shared-token count is exact for that row. Diagnoses need the candidate rows'
tokens: a second pass over the reference tokenizes only those rows.

Greedy agreement: over the supervised positions ``t >= 1`` of matched rows (exact, truncated,
regenerated), the share where ``input_ids[t] == argmax[t-1]``: the dataset's token equals the target's
greedy prediction for it (``argmax[t]`` is the prediction for token ``t+1``, see :mod:`shards.format`).
Per source, the source is the reference row's ``--source-column``.

Memory: the reference index (see :mod:`provenance.reference`), one captured shard's id columns at a
time, 3 bytes per reference row, and the token ids of at most ``max_diagnoses`` unmatched rows.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import re
from typing import Iterator
from pathlib import Path

import numpy as np

from capture.chat import ChatEncoder, load_encoder
from capture.conversation import Conversation, iter_conversations
from capture.dataset import ReadStats, resolve_dataset
from common.errors import CaptureError
from common.hashing import tokenizer_sha256
from provenance import reference as ref_index
from provenance.record import PROVENANCE
from provenance.record import read as read_provenance
from shards import manifest as manifest_mod
from shards.format import RunHeader
from shards.rows import Row, read_row
from shards.run import Location, as_location

log = logging.getLogger(__name__)

CATEGORIES = ("exact", "truncated", "regenerated", "engine_health_check", "engine_random_tokens", "unmatched")
MATCHED = ("exact", "truncated", "regenerated")
# a prompt asking for "OK": "Say OK", "Reply with just OK.", "respond only with 'OK'"
HEALTH_CHECK = re.compile(r"\b(say|reply|respond|answer|return|output|print|write)\b[^\n]{0,40}?\bOK\b", re.I)
HEALTH_CHECK_MAX_TOKENS = 256


@dataclasses.dataclass
class Diagnosis:
    """Why one captured row matches no reference row. ``first_difference``: token position, ``None`` when
    the captured row is a prefix of the candidate (the shorter one ends there)."""

    sample_id: str
    shard: str
    row: int
    tokens: int
    nearest_row: int | None = None  # reference row index (dataset row, 0-based)
    nearest_source: str | None = None
    shared_prefix_tokens: int = 0
    first_difference: int | None = None
    message: int | None = None  # reference message the first difference falls in (system turn = 0)
    role: str | None = None
    captured_token: int | None = None
    reference_token: int | None = None


@dataclasses.dataclass
class Report:
    """The audit (JSON with :func:`dataclasses.asdict`; Markdown with :func:`markdown`)."""

    run: str
    complete: bool  # the run has its completion record (else: a capture may still be writing it)
    reference: dict  # name, path, revision, rows_read, conversations, tokenized, skipped, truncated
    captured: dict  # rows, tokens, loss_tokens
    categories: dict  # category -> {rows, tokens, loss_tokens}
    sources: dict  # reference source -> matched rows: rows, tokens, loss_tokens, token_share, per category, greedy
    coverage: dict  # reference source -> conversations, captured, never_captured
    greedy: dict  # positions, agree, agreement (matched rows)
    engine_rows: dict  # category -> sample ids
    unmatched: list  # Diagnosis dicts
    undiagnosed: int  # unmatched rows beyond max_diagnoses
    index: dict  # memory: keys, bytes, peak bytes
    removed: dict = dataclasses.field(default_factory=dict)  # --retain: shards, rows deleted after reading (not audited)

    @property
    def ok(self) -> bool:
        return self.categories["unmatched"]["rows"] == 0


def audit(run_dir: str | os.PathLike | Location, reference: str, *, source_column: str = "source", split: str = "train",
          model_path: str | None = None, max_diagnoses: int = 1000, progress: bool = False) -> Report:
    """Audit ``run_dir`` against ``reference`` (a dataset spec as ``capture run --dataset`` takes).

    ``model_path``: the folder of the run's tokenizer (default: ``model_dir`` in ``provenance.json``).
    Raises CaptureError when ``run_dir`` holds no run, the tokenizer cannot be found or differs from the
    run's (hash), or the reference cannot be read.
    """
    loc = as_location(run_dir)
    manifest = manifest_mod.read(loc)
    if manifest.header is None:
        raise CaptureError(f"{run_dir} holds no capture run ({loc.manifest_name} with a header)")
    header = manifest.header
    prov = read_provenance(loc) if loc.exists(PROVENANCE) else {}
    filters = prov.get("filters") or {}
    encoder = _encoder(header, prov, model_path, filters)
    shards = [s["path"] for s in manifest.shards]
    lengths = _truncation_lengths(loc, shards, filters)
    ref = resolve_dataset(reference, split)
    alternation = filters.get("alternation", "normalize")

    with _bar(progress, "index reference", "row") as bar:
        index = ref_index.build(ref, encoder, alternation=alternation, source_column=source_column,
                                truncation_lengths=lengths, on_row=bar.update)
    if index.rows_read == 0:
        raise CaptureError(f"reference {reference} has no rows")
    if source_column != "source" and index.sources == [ref.name]:
        raise CaptureError(f"no row of reference {reference} has a string column {source_column!r}")
    regenerated_run = header.mode == "regenerate"
    first_token = int(encoder.encode(Conversation("probe:0", 0, "probe", (("user", "Hi"), ("assistant", "Hello"))))
                      .input_ids[0])
    captured = np.zeros(len(index.row_source), dtype=bool)
    cats = {c: collections.Counter() for c in CATEGORIES}
    per_source: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    engine_rows: dict[str, list[str]] = {c: [] for c in CATEGORIES if c.startswith("engine_")}
    pending: list[tuple[Diagnosis, np.ndarray]] = []
    undiagnosed = 0
    totals = collections.Counter()

    with _bar(progress, "match captured", "row") as bar:
        for shard in shards:
            for i, row in enumerate(_rows(loc, shard)):
                bar.update()
                n, k = len(row.input_ids), int(row.loss_mask.sum())
                totals.update(rows=1, tokens=n, loss_tokens=k)
                cuts = ref_index.cut_points(row.loss_mask)
                keys = ref_index.prefix_keys(row.input_ids, cuts)
                category, matched = _classify(row, keys, index, captured, regenerated_run)
                if category is None:
                    category = _engine_category(row, encoder, first_token)
                cats[category].update(rows=1, tokens=n, loss_tokens=k)
                if matched is not None:
                    captured[matched] = True
                    src = index.sources[index.row_source[matched]]
                    g_pos, g_agree = greedy_counts(row.input_ids, row.loss_mask, row.argmax)
                    per_source[src].update({"rows": 1, "tokens": n, "loss_tokens": k, category: 1,
                                            "greedy_positions": g_pos, "greedy_agree": g_agree})
                elif category in engine_rows:
                    engine_rows[category].append(row.sample_id)
                elif len(pending) < max_diagnoses:
                    d = Diagnosis(row.sample_id, shard, i, n)
                    d.nearest_row = next((r for c in sorted(keys, reverse=True)
                                          if (r := index.prefix(keys[c])) is not None), None)
                    pending.append((d, row.input_ids))
                else:
                    undiagnosed += 1
    _diagnose(pending, ref, encoder, alternation, source_column, index)

    matched_tokens = sum(c["tokens"] for c in per_source.values())
    sources = {s: {**{k: c[k] for k in ("rows", "tokens", "loss_tokens", *MATCHED)},
                   "token_share": round(c["tokens"] / matched_tokens, 4) if matched_tokens else 0.0,
                   **_greedy(c["greedy_positions"], c["greedy_agree"])}
               for s, c in sorted(per_source.items(), key=lambda kv: -kv[1]["tokens"])}
    coverage = {}
    for sid, name in enumerate(index.sources):
        rows = index.row_source == sid
        coverage[name] = {"conversations": int(rows.sum()), "tokenized": int((rows & index.tokenized).sum()),
                          "captured": int((rows & captured).sum()), "never_captured": int((rows & ~captured).sum())}
    g_pos = sum(c["greedy_positions"] for c in per_source.values())
    g_agree = sum(c["greedy_agree"] for c in per_source.values())
    return Report(
        run=str(run_dir),
        complete=manifest.complete,
        reference={"name": ref.name, "path": ref.path, "revision": ref.revision, "rows_read": index.rows_read,
                   "conversations": int((index.row_source != ref_index.NO_SOURCE).sum()),
                   "tokenized": int(index.tokenized.sum()), "tokens": index.tokens, "longest_tokens": index.longest,
                   "skipped": index.skipped,
                   "truncated": index.truncated, "source_column": source_column},
        captured=dict(totals) or {"rows": 0, "tokens": 0, "loss_tokens": 0},
        categories={c: {k: cats[c][k] for k in ("rows", "tokens", "loss_tokens")} for c in CATEGORIES},
        sources=sources,
        coverage=coverage,
        greedy=_greedy(g_pos, g_agree) if header.argmax else {"greedy_positions": 0, "greedy_agree": 0,
                                                                     "greedy_agreement": None},
        engine_rows=engine_rows,
        unmatched=[dataclasses.asdict(d) for d, _ in pending],
        undiagnosed=undiagnosed,
        removed={"shards": len(manifest.removed), "rows": sum(s["rows"] for s in manifest.removed.values())},
        index={"whole_keys": len(index.whole_keys), "prefix_keys": len(index.prefix_keys),
               "bytes": index.index_bytes, "peak_bytes": index.peak_index_bytes},
    )


def greedy_counts(ids: np.ndarray, mask: np.ndarray, argmax: np.ndarray | None) -> tuple[int, int]:
    """``(positions, agreements)``: supervised positions ``t >= 1`` and how many have
    ``ids[t] == argmax[t-1]``; ``(0, 0)`` without argmax."""
    if argmax is None or len(ids) < 2:
        return 0, 0
    sup = np.asarray(mask[1:], dtype=bool)
    return int(sup.sum()), int((sup & (ids[1:] == argmax[:-1])).sum())


def _greedy(positions: int, agree: int) -> dict:
    return {"greedy_positions": positions, "greedy_agree": agree,
            "greedy_agreement": round(agree / positions, 4) if positions else None}


def _classify(row: Row, keys: dict[int, int], index: ref_index.ReferenceIndex, captured: np.ndarray,
              regenerated_run: bool) -> tuple[str | None, int | None]:
    """``(category, reference row)`` for the matched categories, ``(None, None)`` otherwise."""
    n = len(row.input_ids)
    if n == 0:
        return None, None
    rows = index.whole(keys[n])
    if len(rows):
        free = rows[~captured[rows]]
        return "exact", int(free[0] if len(free) else rows[0])
    r = index.prefix(keys[n])
    if r is not None:
        return "truncated", r
    sup = np.flatnonzero(row.loss_mask)
    if regenerated_run and len(sup) and int(sup[0]) in keys:
        r = index.prefix(keys[int(sup[0])])
        if r is not None:
            return "regenerated", r
    return None, None


def _engine_category(row: Row, encoder: ChatEncoder, first_token: int) -> str:
    """``engine_health_check``, ``engine_random_tokens`` or ``unmatched`` for a row matching nothing."""
    tok = encoder.tokenizer
    sup = np.flatnonzero(row.loss_mask)
    prompt = row.input_ids[: int(sup[0])] if len(sup) else row.input_ids
    if len(prompt) <= HEALTH_CHECK_MAX_TOKENS and HEALTH_CHECK.search(tok.decode(prompt, skip_special_tokens=True)):
        return "engine_health_check"
    if len(row.input_ids) and int(row.input_ids[0]) != first_token:
        again = tok(tok.decode(row.input_ids), add_special_tokens=False)["input_ids"]
        if list(again) != row.input_ids.tolist():
            return "engine_random_tokens"
    return "unmatched"


def _diagnose(pending: list[tuple[Diagnosis, np.ndarray]], ref, encoder: ChatEncoder, alternation: str,
              source_column: str, index: ref_index.ReferenceIndex) -> None:
    """Second pass: tokenize the candidate reference rows and fill in each diagnosis."""
    wanted = collections.defaultdict(list)
    for d, ids in pending:
        if d.nearest_row is not None:
            wanted[d.nearest_row].append((d, ids))
    if not wanted:
        return
    specials = encoder.special_strings()
    for conv in iter_conversations(ref, ReadStats(), alternation=alternation, source_column=source_column):
        if conv.row_index not in wanted:
            continue
        rec = encoder.encode(conv, specials)
        if isinstance(rec, str):  # skipped by the run's special-text policy: nothing to compare with
            continue
        ref_ids = rec.input_ids
        starts = encoder.message_starts(conv, specials)
        for d, ids in wanted.pop(conv.row_index):
            n = min(len(ids), len(ref_ids))
            diff = np.flatnonzero(ids[:n] != ref_ids[:n])
            d.nearest_source = conv.source
            d.shared_prefix_tokens = int(diff[0]) if len(diff) else n
            if len(diff) or len(ids) > len(ref_ids):
                p = d.shared_prefix_tokens
                d.first_difference = p
                before = [j for j, (_, start) in enumerate(starts) if start <= p]
                if before:
                    d.message, d.role = before[-1], starts[before[-1]][0]
                d.captured_token = int(ids[p]) if p < len(ids) else None
                d.reference_token = int(ref_ids[p]) if p < len(ref_ids) else None
        if not wanted:
            break


def _rows(loc: Location, shard: str) -> Iterator[Row]:
    """The captured rows of one shard (:func:`shards.rows.read_row`), states and top-K not decoded."""
    table = loc.read_table(shard)
    for i in range(table.num_rows):
        yield read_row(table, i, states=[], topk=False)


def _truncation_lengths(loc: Location, shards: list[str], filters: dict) -> list[int]:
    """Lengths a run may have cut rows to: ``--max-tokens`` under ``--overlength truncate``, and the
    longest captured row (rows cut to the model's context are the longest)."""
    out = set()
    if filters.get("overlength") == "truncate" and filters.get("max_tokens"):
        out.add(int(filters["max_tokens"]))
    longest = max((max(loc.read_table(p, ["num_tokens"])["num_tokens"].to_pylist(), default=0) for p in shards),
                  default=0)
    if longest:
        out.add(longest)
    return sorted(out)


def _encoder(header: RunHeader, prov: dict, model_path: str | None, filters: dict) -> ChatEncoder:
    model_dir = model_path or prov.get("model_dir")
    if not model_dir:
        raise CaptureError("the run has no provenance.json naming its model folder; pass --model-path")
    if not Path(model_dir).is_dir():
        raise CaptureError(f"model folder {model_dir} does not exist; pass --model-path (the run's tokenizer)")
    kwargs = tuple(sorted((header.responses.get("chat_template_kwargs") or {}).items()))
    try:
        enc = load_encoder(str(model_dir), template_kwargs=kwargs)
    except (OSError, ValueError) as e:
        raise CaptureError(f"cannot load a tokenizer from {model_dir}: {' '.join(str(e).split())[:160]}; "
                           "pass --model-path with the run's model folder") from None
    found = tokenizer_sha256(enc.tokenizer)
    if found != header.tokenizer_sha256:
        raise CaptureError(f"the tokenizer in {model_dir} (sha256 {found[:12]}) is not the run's "
                           f"({header.tokenizer_sha256[:12]}); pass --model-path with the run's tokenizer")
    return dataclasses.replace(enc, template=header.chat_template, system_prompt=filters.get("system_prompt"),
                               special_text=filters.get("special_text", "drop"))


def _bar(enabled: bool, desc: str, unit: str):
    from tqdm import tqdm

    return tqdm(desc=desc, unit=unit, disable=not enabled, dynamic_ncols=True)


def markdown(r: Report) -> str:
    """The audit as Markdown (for a model card)."""
    ref, cap = r.reference, r.captured
    pct = lambda a, b: f"{100 * a / b:.1f}%" if b else "–"  # noqa: E731
    out = [f"## Data audit: `{r.run}` against `{ref['name']}`", "",
           f"Reference: {ref['rows_read']:,} rows read ({ref['revision'][:64]}), {ref['conversations']:,} "
           f"conversations, {ref['tokenized']:,} tokenized with the run's chat template."
           + (f" The file ends mid-record: {ref['truncated']}" if ref["truncated"] else ""),
           f"Captured: {cap['rows']:,} conversations, {cap['tokens']:,} tokens ({cap['loss_tokens']:,} supervised)."
           + ("" if r.complete else " The run has no completion record yet: this covers the rows committed so far.")
           + (f" Not audited: {r.removed['rows']:,} rows in {r.removed['shards']:,} shard(s) that the run removed after "
              "its readers consumed them (--retain)." if r.removed.get("rows") else ""),
           "", "| category | conversations | tokens | supervised tokens |", "|---|---:|---:|---:|"]
    out += [f"| {c} | {v['rows']:,} | {v['tokens']:,} | {v['loss_tokens']:,} |" for c, v in r.categories.items()]
    g = r.greedy
    if g["greedy_agreement"] is not None:
        out += ["", f"Greedy agreement (matched rows, supervised t ≥ 1, `input_ids[t] == argmax[t-1]`): "
                    f"**{pct(g['greedy_agree'], g['greedy_positions'])}** of {g['greedy_positions']:,} positions."]
    out += ["", "### Matched conversations by source", "",
            "| source | conversations | exact | truncated | regenerated | tokens | supervised tokens | share of tokens "
            "| greedy agreement |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    out += [f"| {s} | {v['rows']:,} | {v['exact']:,} | {v['truncated']:,} | {v['regenerated']:,} | {v['tokens']:,} "
            f"| {v['loss_tokens']:,} | {100 * v['token_share']:.1f}% | "
            f"{pct(v['greedy_agree'], v['greedy_positions'])} |" for s, v in r.sources.items()] or ["| (none) |"]
    out += ["", "### Reference rows never captured (beyond --limit, filtered, capped or not in the run)", "",
            "| source | reference conversations | tokenized | captured | never captured |", "|---|---:|---:|---:|---:|"]
    out += [f"| {s} | {v['conversations']:,} | {v['tokenized']:,} | {v['captured']:,} | {v['never_captured']:,} |"
            for s, v in r.coverage.items()]
    if ref["skipped"]:
        out += ["", "Reference rows that are no conversation for this run: "
                + ", ".join(f"{k} {v:,}" for k, v in sorted(ref["skipped"].items()))]
    for c, ids in r.engine_rows.items():
        if ids:
            out += ["", f"{c}: " + ", ".join(f"`{i}`" for i in ids[:20]) + (" …" if len(ids) > 20 else "")]
    if r.unmatched:
        out += ["", "### Unmatched captured rows", "",
                "| sample_id | tokens | nearest reference row | shared prefix | first difference | message (role) "
                "| captured / reference token |", "|---|---:|---|---:|---:|---|---|"]
        for d in r.unmatched:
            near = f"{d['nearest_row']} ({d['nearest_source']})" if d["nearest_row"] is not None else "none"
            msg = f"{d['message']} ({d['role']})" if d["message"] is not None else "–"
            out.append(f"| `{d['sample_id']}` | {d['tokens']:,} | {near} | {d['shared_prefix_tokens']:,} | "
                       f"{d['first_difference'] if d['first_difference'] is not None else '–'} | {msg} | "
                       f"{_or_dash(d['captured_token'])} / {_or_dash(d['reference_token'])} |")
        if r.undiagnosed:
            out.append(f"\n{r.undiagnosed:,} more unmatched rows not diagnosed (--max-diagnoses).")
    return "\n".join(out) + "\n"


def _or_dash(value) -> str:
    return "–" if value is None else str(value)


def as_json(r: Report) -> str:
    return json.dumps({**dataclasses.asdict(r), "ok": r.ok}, indent=1)
