"""Offline scores on a held-out set, streamed: the drafter, the bigram and the prompt-lookup baselines.

A held-out set is a split of a run (:func:`drafter.data.heldout`) or every row of another run. Its
conversations stream one at a time from a :class:`shards.stream.ShardStream` (manifest order, one
process), so scoring holds one batch of ``rows_per_batch`` rows, never the set. The anchors scored are
the held-out set's valid anchors numbered globally in that order, ``limit`` of them evenly spaced
(:func:`select_anchors`; the numbering comes from a :class:`drafter.data.Scan` of the same set), in rows
of at most ``per_row`` anchors of one conversation. Scores: :class:`drafter.metrics.Score`.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import numpy as np
import torch

from common import cpu
from drafter import blocks, data, metrics
from drafter.model import Drafter
from shards.stream import ShardStream


# The block-level choices between a drafter's own draft and prompt lookup's (a model with a lookup input),
# each a whole block's draft taken from one of the two:
# - "hybrid": lookup's where it has a match, the drafter's elsewhere (the rule of serving systems that pair
#   suffix or n-gram drafting with a model drafter, e.g. Arctic Inference);
# - "commit": lookup's where the drafter's own slot-1 token is lookup's (the drafter, fed the copy, chose
#   it), the drafter's elsewhere: the drafter's first choice decides for the block, so a copy it takes is
#   taken to the end of the block (per slot, its argmaxes leave the copy in the middle of a run);
# - "oracle": lookup's where it accepts more drafted tokens than the drafter's, against the labels: the
#   ceiling of any block-level choice between the two (not a drafter: it reads the answers).
BLOCK_CHOICES = ("hybrid", "commit", "oracle")


def resolve_precision(precision: str, features: set[str] | None = None, max_isa: str | None = None,
                      machine: str | None = None) -> str:
    """The autocast dtype a TrainConfig ``precision`` means on this CPU: ``bfloat16`` or ``float32`` as
    given; ``auto``: ``bfloat16`` unless the CPU is known to lack native bf16 dot products
    (:func:`common.cpu.native`; ``features``, ``max_isa``, ``machine`` default to this machine's), then
    ``float32``: emulated bf16 matmuls run several times slower than float32 there."""
    if precision != "auto":
        return precision
    return "float32" if cpu.native("bfloat16", features, max_isa, machine) is False else "bfloat16"


def autocast(precision: str):
    """The CPU autocast context of a TrainConfig ``precision`` (:func:`resolve_precision`: ``bfloat16``;
    ``float32``: none)."""
    if resolve_precision(precision) == "bfloat16":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def select_anchors(anchors_each: Sequence[int], limit: int = 0) -> list[torch.Tensor]:
    """Per conversation, the indices (int64, increasing) into its valid anchors that are scored: all of
    them (``limit`` 0 or at least the total), else global anchor numbers ``i * total // limit`` for
    ``i < limit``."""
    counts = np.asarray(anchors_each, dtype=np.int64)
    total = int(counts.sum())
    if not limit or total <= limit:
        return [torch.arange(int(c)) for c in counts]
    pick = torch.arange(limit, dtype=torch.long) * total // limit
    starts = np.concatenate([[0], np.cumsum(counts)])
    return [pick[(pick >= s) & (pick < s + c)] - int(s) for s, c in zip(starts[:-1].tolist(), counts.tolist())]


def heldout_rows(run: str, split: str, fraction: float, scan: "data.Scan", per_row: int, limit: int,
                 exclude: dict | None = None) -> Iterator[tuple[dict, torch.Tensor]]:
    """``(conversation, anchors int64 [<= per_row])`` rows of the held-out set that ``scan`` was made of
    (the same ``run``, ``split``, ``fraction`` and ``exclude``), conversations :func:`drafter.data.prepare`'d
    one at a time."""
    picks = iter(select_anchors(scan.anchors_each, limit))
    stream = ShardStream(run, split=split, heldout_fraction=fraction, final=False, topk=False, rank=0, world_size=1)
    for sample in stream:
        conv = data.prepare(sample)
        if exclude is not None and data.seen(conv, exclude):
            continue
        anchors = blocks.valid_anchors(conv["loss_mask"])[next(picks)]
        for row in blocks.rows_of(anchors, per_row):
            yield conv, row


def _batched(rows: Iterator[tuple[dict, torch.Tensor]], n: int) -> Iterator[list[tuple[dict, torch.Tensor]]]:
    part = []
    for row in rows:
        part.append(row)
        if len(part) == n:
            yield part
            part = []
    if part:
        yield part


@torch.no_grad()
def score(rows: Iterator[tuple[dict, torch.Tensor]], block_size: int, model: Drafter | None = None,
          bigram: torch.Tensor | None = None, lookup: int = 0, rows_per_batch: int = 8,
          precision: str = "float32") -> dict[str, dict]:
    """Score blocks of ``block_size``, in one pass over ``rows``: ``model`` (``"drafter"``), the ``bigram``
    table (:meth:`drafter.metrics.BigramCounts.table`, chained from the anchor token) and prompt lookup
    of n-gram ``lookup`` (``"lookup"``; 0: not scored), each against the target's greedy tokens. A model
    with a lookup input also gives the block-level choices between its draft and prompt lookup's (:data:`BLOCK_CHOICES`),
    and its ``"drafter"`` and ``"lookup"`` scores are split by whether the anchor has a lookup match
    (``by_lookup_match``). Returns name → :meth:`drafter.metrics.Score.as_dict`."""
    hybrid = model is not None and bool(model.cfg.lookup)
    scores = {name: metrics.Score() for name, on in (("drafter", model is not None), ("bigram", bigram is not None),
                                                     ("lookup", lookup > 0)) if on}
    scores.update({name: metrics.Score() for name in BLOCK_CHOICES if hybrid})
    if model is not None:
        model.eval()
    for part in _batched(rows, rows_per_batch):
        for conv, a in part:
            if bigram is None and not lookup:
                break
            labels, valid = blocks.block_targets(conv, a, block_size, "argmax")
            if bigram is not None:
                scores["bigram"].add(metrics.bigram_draft(bigram, conv["input_ids"][a], block_size - 1), labels, valid)
            if lookup:
                copy = metrics.lookup_draft(conv["input_ids"], a, block_size, lookup)
                scores["lookup"].add(copy, labels, valid, matched=copy[:, 0] >= 0)
        if model is not None:
            batch = blocks.make_batch([c for c, _ in part], [a for _, a in part], block_size, lookup=model.cfg.lookup)
            real = batch.anchors >= 0
            with autocast(precision):
                pred = model.vocab[model.logits(model(batch), batch.lookup).float().argmax(-1)]
            if not hybrid:
                scores["drafter"].add(pred[real], batch.labels[real], batch.valid[real])
                continue
            copy, own, labels, valid = batch.lookup[real], pred[real], batch.labels[real], batch.valid[real]
            matched = copy[:, 0] >= 0
            scores["drafter"].add(own, labels, valid, matched)
            better = metrics.acceptance_length(copy, labels, valid) > metrics.acceptance_length(own, labels, valid)
            for name, take_copy in (("hybrid", matched), ("commit", matched & (own[:, 0] == copy[:, 0])),
                                    ("oracle", better)):
                scores[name].add(torch.where(take_copy[:, None], copy, own), labels, valid, matched)
    return {name: s.as_dict() for name, s in scores.items()}
