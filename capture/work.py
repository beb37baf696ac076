"""Dataset rows → kept records → work units, in dataset order: the driver's feed.

:func:`records` streams the dataset (never holding it), skips rows a resumed run already holds, applies
the chat template (:mod:`capture.chat`) and the filters (:mod:`filters`), and counts every dropped row
by reason; :func:`units` groups the kept records into work units for the replicas.
"""

from __future__ import annotations

import collections
import logging

from capture.config import RunConfig
from capture.chat import ChatEncoder
from capture.conversation import iter_conversations
from capture.dataset import DatasetRef, ReadStats
from capture.summary import Summary
from common.records import Tokenized
from filters import apply_filters, filter_prompt

log = logging.getLogger(__name__)


def records(cfg: RunConfig, encoder: ChatEncoder, dataset: DatasetRef, context_len: int | None, summary: Summary,
            done: set[str], seen: set[str]):
    """Stream the kept records of ``dataset`` in dataset order (:class:`common.records.Tokenized`; regenerate
    mode: :class:`common.records.Prompt`, filtered by :func:`filters.filter_prompt`), skipping sample ids in
    ``done``; every other row is counted by reason in ``summary.skipped``. ``seen``: the dedup filter's token
    hashes (updated); ``context_len``: the longest record the engine takes (None: no limit)."""
    stats = ReadStats()
    skipped: collections.Counter = collections.Counter()
    specials = encoder.special_strings()
    convs = iter_conversations(dataset, stats, limit=cfg.limit, skip=cfg.skip, sources=cfg.sources,
                               exclude_sources=cfg.exclude_sources, source_caps=dict(cfg.source_caps) or None,
                               alternation=cfg.alternation)
    try:
        for conv in convs:
            if conv.sample_id in done:
                summary.already_committed += 1
                continue
            if cfg.responses == "regenerate":
                rec = encoder.encode_prompt(conv, cfg.regenerate_policy, specials)
            else:
                rec = encoder.encode(conv, specials)
            if isinstance(rec, str):
                skipped[rec] += 1
                continue
            if cfg.responses == "regenerate":
                reason = filter_prompt(rec, cfg.filters, seen, context_len, cfg.max_new_tokens)
            else:
                rec, reason = apply_filters(rec, cfg.filters, seen, context_len)
            if reason:
                skipped[reason] += 1
                log.debug("%s dropped: %s", conv.sample_id, reason)
                continue
            summary.kept += 1
            summary.rows_read = stats.rows_read  # live, for the progress bar's ETA
            yield rec
    finally:
        summary.rows_read = stats.rows_read
        summary.skipped = dict(stats.skipped + skipped)
        summary.normalized = dict(stats.normalized)
        summary.truncated_input = stats.truncated


def units(records, unit_tokens: int, first: int = 0, first_tokens: int = 0):
    """Work units of about ``unit_tokens`` tokens (a unit ends with the record that reaches the size); the
    first ``first`` units hold about ``first_tokens`` (one per replica: each replica's first shard commits
    early)."""
    unit: list[Tokenized] = []
    size = 0
    sent = 0
    for rec in records:
        unit.append(rec)
        size += rec.num_tokens
        if size >= (min(first_tokens, unit_tokens) if sent < first else unit_tokens):
            yield unit
            unit, size, sent = [], 0, sent + 1
    if unit:
        yield unit
