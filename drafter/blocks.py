"""Anchors, block labels and the padded batches the drafter trains and scores on.

Conventions (DFlash's; positions index one conversation, ``T`` tokens):

* **Anchor** ``a``: the block's first token ``x_a`` is known (at serving time: the token the target has
  just emitted, its bonus token) and the target's states are known at every position ``p < a`` (the
  verified prefix). An anchor needs ``loss_mask[a]`` and ``loss_mask[a+1]``: the block starts on an
  assistant token and its first draft is one (DFlash's anchor rule, FIELD-NOTES "What drafters need").
* **Block slot** ``j`` (``0 ≤ j < B``): slot 0 holds ``x_a``; slot ``j ≥ 1`` drafts ``x_{a+j}``, so a
  block of ``B`` drafts ``B-1`` tokens. Its label is the target's greedy token ``argmax[a+j-1]``
  (``argmax[t]`` is the target's prediction of token ``t+1`` after the true prefix: teacher-forced
  against the target's greedy output). ``labels="dataset"`` trains on the dataset's token
  ``input_ids[a+j]`` instead (they agree on a share of tokens only, ~68% for GLM-5.3-Flash's data).
* **Valid** slot ``j``: ``a+j < T`` and ``x_{a+1} … x_{a+j}`` are all supervised. A block ends where the
  assistant turn ends; slots past it are not trained and a draft cannot be accepted there.
* **Context**: slot queries see the target's fused states at ``a-window ≤ p < a`` (a sliding window)
  and the whole block (bidirectional inside it).

A :class:`Batch` holds ``S`` rows, each one conversation (padded to the longest) with up to ``M``
anchors of it (``-1`` pads); one conversation may fill several rows when it has more anchors than ``M``.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from drafter.metrics import lookup_draft

LABELS = ("argmax", "dataset")


def valid_anchors(loss_mask: torch.Tensor) -> torch.Tensor:
    """int64 [A]: positions ``a`` of one conversation with ``loss_mask[a] & loss_mask[a+1]``
    (loss_mask bool [T])."""
    return torch.nonzero(loss_mask[:-1] & loss_mask[1:], as_tuple=False).flatten()


def block_targets(seq: dict, anchors: torch.Tensor, block_size: int, labels: str = "argmax"
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(labels int64 [A, B-1], valid bool [A, B-1]) of slots ``1 … B-1`` for ``anchors`` (int64 [A]) of
    one conversation ``seq`` (``input_ids``, ``loss_mask``, ``argmax`` [T]). Column ``j-1`` is slot
    ``j``; invalid slots hold label 0. Raises ValueError for an unknown ``labels``."""
    if labels not in LABELS:
        raise ValueError(f"labels must be 'argmax' or 'dataset', not {labels!r}")
    T = seq["input_ids"].shape[0]
    pos = anchors[:, None] + torch.arange(1, block_size)  # row of x_{a+j}
    inside = pos < T
    pos_c = pos.clamp(max=T - 1)
    valid = torch.cumprod((inside & seq["loss_mask"][pos_c]).long(), dim=1).bool()
    source = seq["argmax"][pos_c - 1] if labels == "argmax" else seq["input_ids"][pos_c]
    return torch.where(valid, source, torch.zeros_like(source)), valid


def teacher_topk(seq: dict, anchors: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's top-K next-token distribution for slots ``1 … B-1``: (ids int64 [A, B-1, K],
    logprobs float32 [A, B-1, K]) taken at position ``a+j-1`` (the distribution of ``x_{a+j}``), from a
    run captured with ``--topk K``. Positions past the conversation are clamped (mask them with
    :func:`block_targets`' ``valid``)."""
    T = seq["input_ids"].shape[0]
    at = (anchors[:, None] + torch.arange(block_size - 1)).clamp(max=T - 1)
    return seq["topk_ids"][at], seq["topk_logprobs"][at]


@dataclasses.dataclass
class Batch:
    """``S`` rows of (conversation, up to ``M`` anchors), padded.

    ``feats`` [S, T, F] normalized taps (bf16; see :func:`drafter.data.fuse_ready`), ``ids`` int64
    [S, T], ``anchors`` int64 [S, M] (``-1``: no anchor), ``labels`` int64 and ``valid`` bool
    [S, M, B-1]; with top-K, ``topk_ids`` int64 and ``topk_logprobs`` float32 [S, M, B-1, K]; with
    ``lookup`` n, the prompt-lookup drafts (:func:`drafter.metrics.lookup_draft`) int64 [S, M, B-1]
    (``-1``: no match). ``T`` is
    cut to the last anchor of the batch (no slot sees a later position)."""

    feats: torch.Tensor
    ids: torch.Tensor
    anchors: torch.Tensor
    labels: torch.Tensor
    valid: torch.Tensor
    topk_ids: torch.Tensor | None = None
    topk_logprobs: torch.Tensor | None = None
    lookup: torch.Tensor | None = None


def make_batch(seqs: Sequence[dict], anchors: Sequence[torch.Tensor], block_size: int,
               labels: str = "argmax", topk: bool = False, lookup: int = 0) -> Batch:
    """One :class:`Batch` from conversations ``seqs`` (dicts of :func:`drafter.data.prepare`) and, per
    row, its anchors (int64 [A_i], A_i ≥ 1). Rows are padded to the longest context and anchor count."""
    S, M = len(seqs), max(len(a) for a in anchors)
    T = max(int(a.max()) for a in anchors) + 1
    F = seqs[0]["feats"].shape[1]
    feats = torch.zeros(S, T, F, dtype=seqs[0]["feats"].dtype)
    ids = torch.zeros(S, T, dtype=torch.long)
    anc = torch.full((S, M), -1, dtype=torch.long)
    lab = torch.zeros(S, M, block_size - 1, dtype=torch.long)
    val = torch.zeros(S, M, block_size - 1, dtype=torch.bool)
    tk_ids = tk_lp = None
    if topk:
        K = seqs[0]["topk_ids"].shape[1]
        tk_ids = torch.zeros(S, M, block_size - 1, K, dtype=torch.long)
        tk_lp = torch.full((S, M, block_size - 1, K), -float("inf"))
    look = torch.full((S, M, block_size - 1), -1, dtype=torch.long) if lookup else None
    for i, (seq, a) in enumerate(zip(seqs, anchors)):
        n = min(T, seq["input_ids"].shape[0])
        feats[i, :n] = seq["feats"][:n]
        ids[i, :n] = seq["input_ids"][:n]
        anc[i, : len(a)] = a
        lab[i, : len(a)], val[i, : len(a)] = block_targets(seq, a, block_size, labels)
        if topk:
            tk_ids[i, : len(a)], tk_lp[i, : len(a)] = teacher_topk(seq, a, block_size)
        if lookup:
            look[i, : len(a)] = lookup_draft(seq["input_ids"], a, block_size, lookup)
    return Batch(feats, ids, anc, lab, val, tk_ids, tk_lp, look)


def rows_of(anchors: torch.Tensor, per_row: int) -> list[torch.Tensor]:
    """Split one conversation's anchors (int64 [A]) into consecutive groups of at most ``per_row``."""
    return list(anchors.split(per_row)) if len(anchors) else []
