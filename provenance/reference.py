"""The reference index of ``capture audit``: hashes of a public dataset's token sequences, built streaming.

Each reference row is normalized and tokenized exactly as the run did (the run's chat template text
from the shard header, its tokenizer, system prompt, special-text policy, alternation and template
kwargs), then reduced to 64-bit keys; no token sequence is kept. A key is the first 8 bytes (big-endian)
of the SHA-256 of the little-endian int32 token bytes, so a whole row's key is the first 16 hex digits of
its ``token_sha256`` (:func:`common.hashing.token_sha256`, the shard column).

Two tables, each a pair of numpy arrays sorted by key:

* ``whole``: every tokenized row, ``(key of all its tokens, row)``, duplicates kept (exact matches are
  counted as a multiset);
* ``prefix``: the keys of the row's prefixes that end at every answer start and end (rising and falling
  edges of the loss mask), at every power-of-two length, at each truncation length given (the run's
  ``--max-tokens``/context limit) and at its full length, one row per distinct key (the first row that
  has it). Answer-start prefixes find regenerated rows (same prompt, new answer), truncation lengths find
  truncated rows, and the longest indexed prefix a captured row shares with any reference row names the
  candidate for a diagnosis.

Memory model: 12 bytes (uint64 key + uint32 row) per distinct prefix key and per row in ``whole``, plus 3
bytes per reference row (source id, captured flag), on top of the imports and tokenizer and the
transient tokenization of one row (the chat encoder's offset maps: measured ~375 bytes per token of the
longest row, 87 MB for ShareGPT's longest, 231k tokens). A row of T tokens and k answers adds at most
``2k + log2(T) + 2`` prefix keys, fewer once shared prefixes (a system prompt) are merged; pending keys
are merged into the sorted tables every :data:`COMPACT_EVERY` keys, so the peak is the tables plus one
pending batch. ``bench/audit.out`` measures it. With 64-bit keys the chance that two different sequences
among n keys collide is about n²/2⁶⁵ (3·10⁻⁵ at 30 M keys).
"""

from __future__ import annotations

import array
import collections
import dataclasses
import hashlib
import logging
from typing import Callable, Iterable

import numpy as np

from capture.chat import ChatEncoder
from capture.conversation import iter_conversations
from capture.dataset import DatasetRef, ReadStats

log = logging.getLogger(__name__)

COMPACT_EVERY = 1 << 22  # pending prefix keys merged into the sorted table at this many
NO_SOURCE = np.iinfo(np.uint16).max  # row_source of a row that never became a conversation


def key_of(digest: bytes) -> int:
    return int.from_bytes(digest[:8], "big")


def prefix_keys(ids: np.ndarray, cuts: Iterable[int]) -> dict[int, int]:
    """``{length: key}`` of the prefixes ``ids[:length]`` for each cut (0 < length <= T), one SHA-256 pass."""
    data = np.ascontiguousarray(ids, dtype="<i4").tobytes()
    h, pos, out = hashlib.sha256(), 0, {}
    for cut in sorted({c for c in cuts if 0 < c <= len(ids)}):
        h.update(data[pos * 4 : cut * 4])
        out[cut] = key_of(h.copy().digest())
        pos = cut
    return out


def cut_points(loss_mask: np.ndarray, extra: Iterable[int] = ()) -> set[int]:
    """Prefix lengths indexed for a row: every answer start and end (loss-mask edges), every power of two
    below T, the ``extra`` lengths below T, and T itself."""
    t = len(loss_mask)
    m = np.asarray(loss_mask, dtype=np.int8)
    edges = np.flatnonzero(np.diff(m, prepend=0, append=0)) if t else np.array([], dtype=np.int64)
    cuts = {int(e) for e in edges} | {t} | {c for c in extra if c < t}
    p = 1
    while p < t:
        cuts.add(p)
        p *= 2
    return cuts


@dataclasses.dataclass
class ReferenceIndex:
    """The index of one reference dataset (see the module docstring). Row numbers are dataset rows."""

    whole_keys: np.ndarray  # uint64 [R_tok], sorted
    whole_rows: np.ndarray  # uint32 [R_tok]
    prefix_keys: np.ndarray  # uint64 [P], sorted, distinct
    prefix_rows: np.ndarray  # uint32 [P]
    sources: list[str]  # source id -> name
    row_source: np.ndarray  # uint16 [R]; NO_SOURCE for rows that never became a conversation
    tokenized: np.ndarray  # bool [R]: the row was tokenized (it is in `whole`)
    rows_read: int
    skipped: dict[str, int]  # reason -> rows that never became a tokenized conversation
    truncated: str | None  # the reference file ends mid-record (message)
    tokens: int
    longest: int  # tokens of the longest row (its tokenization is the largest transient allocation)
    peak_index_bytes: int  # largest size of the key tables plus pending keys while building

    def whole(self, key: int) -> np.ndarray:
        """Rows whose whole token sequence has ``key`` (uint32, ascending)."""
        k = np.uint64(key)
        return self.whole_rows[np.searchsorted(self.whole_keys, k, "left"):np.searchsorted(self.whole_keys, k, "right")]

    def prefix(self, key: int) -> int | None:
        """The first row with a prefix (or whole sequence) of this ``key``, or None."""
        i = int(np.searchsorted(self.prefix_keys, np.uint64(key)))
        if i < len(self.prefix_keys) and int(self.prefix_keys[i]) == key:
            return int(self.prefix_rows[i])
        return None

    @property
    def index_bytes(self) -> int:
        return sum(a.nbytes for a in (self.whole_keys, self.whole_rows, self.prefix_keys, self.prefix_rows,
                                      self.row_source, self.tokenized))


def build(ref: DatasetRef, encoder: ChatEncoder, *, alternation: str = "normalize", source_column: str = "source",
          truncation_lengths: Iterable[int] = (), on_row: Callable[[], None] | None = None) -> ReferenceIndex:
    """Stream ``ref`` once and index every row (see the module docstring). ``on_row`` is called per row
    read (a progress bar). Rows that do not become a tokenized conversation are counted in ``skipped``
    by their reason (:func:`capture.conversation.iter_conversations`'s reasons, ``special_token_text``, or
    ``template_error`` when the chat template cannot render the row). Raises CaptureError when the
    reference cannot be read."""
    from common.errors import CaptureError

    stats = ReadStats()
    extra = sorted(set(truncation_lengths))
    specials = encoder.special_strings()
    whole_k, whole_r = array.array("Q"), array.array("I")
    pend_k, pend_r = array.array("Q"), array.array("I")
    table_k, table_r = np.zeros(0, np.uint64), np.zeros(0, np.uint32)
    sources: dict[str, int] = {}
    row_source = array.array("H")
    tokenized = array.array("b")
    skipped: collections.Counter = collections.Counter()
    tokens, peak, longest = 0, 0, 0

    def compact():
        nonlocal table_k, table_r, pend_k, pend_r
        k = np.concatenate([table_k, np.frombuffer(pend_k, np.uint64)])
        r = np.concatenate([table_r, np.frombuffer(pend_r, np.uint32)])
        order = np.argsort(k, kind="stable")  # the table's (earlier) rows first among equal keys
        k, r = k[order], r[order]
        first = np.ones(len(k), bool)
        first[1:] = k[1:] != k[:-1]
        table_k, table_r = k[first], r[first]
        pend_k, pend_r = array.array("Q"), array.array("I")

    def grow(upto: int) -> None:  # rows skipped by iter_conversations leave gaps in row indices
        while len(row_source) < upto:
            row_source.append(NO_SOURCE)
            tokenized.append(0)

    for conv in iter_conversations(ref, stats, alternation=alternation, source_column=source_column):
        grow(conv.row_index)
        if on_row:
            on_row()
        row_source.append(sources.setdefault(conv.source, len(sources)))
        try:
            rec = encoder.encode(conv, specials)
        except CaptureError as e:
            log.debug("reference %s: %s", conv.sample_id, e)
            rec = "template_error"
        if isinstance(rec, str):
            skipped[rec] += 1
            tokenized.append(0)
            continue
        tokenized.append(1)
        tokens += rec.num_tokens
        longest = max(longest, rec.num_tokens)
        keys = prefix_keys(rec.input_ids, cut_points(rec.loss_mask, extra))
        whole_k.append(keys[rec.num_tokens])
        whole_r.append(conv.row_index)
        pend_k.extend(keys.values())
        pend_r.extend([conv.row_index] * len(keys))
        peak = max(peak, table_k.nbytes + table_r.nbytes + len(pend_k) * 12 + len(whole_k) * 12)
        if len(pend_k) >= COMPACT_EVERY:
            compact()
    grow(stats.rows_read)
    compact()
    for reason, n in stats.skipped.items():
        skipped[reason] += n
    wk, wr = np.frombuffer(whole_k, np.uint64), np.frombuffer(whole_r, np.uint32)
    order = np.argsort(wk, kind="stable")
    return ReferenceIndex(
        whole_keys=wk[order], whole_rows=wr[order], prefix_keys=table_k, prefix_rows=table_r,
        sources=list(sources), row_source=np.frombuffer(row_source, np.uint16).copy(),
        tokenized=np.frombuffer(tokenized, np.int8).astype(bool), rows_read=stats.rows_read,
        skipped=dict(skipped), truncated=stats.truncated, tokens=tokens, longest=longest,
        peak_index_bytes=max(peak, table_k.nbytes + table_r.nbytes + wk.nbytes + wr.nbytes),
    )
