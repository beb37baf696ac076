"""Anchors, block labels and context windows over a packed batch (see :mod:`drafter.data`).

Conventions (positions are rows of the packed batch, N in all):

* **Anchor** ``a``: ``x_a`` and its successor ``x_{a+1}`` are both supervised (``loss_mask[a]`` and
  ``loss_mask[a+1]``) and in the same conversation: the drafter runs right after an assistant token and
  its first draft is an assistant token (DFlash's anchor rule, FIELD-NOTES "What drafters need").
* **Block position** ``j`` (0-based, ``j < B``) of anchor ``a`` drafts ``x_{a+j+1}``. Its label is the
  target's greedy token ``argmax[a+j]`` (``argmax[t]`` is the target's prediction of token ``t+1``
  given the true prefix, i.e. teacher-forced against the target's greedy output). The alternative,
  ``labels="dataset"``, is the dataset's token ``input_ids[a+j+1]`` (what the conversation says, not
  what the target would say; they agree on a fraction of tokens only, ~68% for GLM-5.3-Flash).
* **Valid** block position: ``x_{a+1} … x_{a+j+1}`` all exist in the anchor's conversation and are all
  supervised. A block ends at the end of the assistant turn; positions past it are not trained and a
  draft cannot be accepted there.
"""

from __future__ import annotations

import torch


def valid_anchors(loss_mask: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """int64 [A]: packed rows ``a`` with ``loss_mask[a] & loss_mask[a+1]`` and ``a+1`` in the same
    sample (``position_ids[a+1] == position_ids[a] + 1``). loss_mask bool [N], position_ids int [N]."""
    same = position_ids[1:] == position_ids[:-1] + 1
    ok = loss_mask[:-1] & loss_mask[1:] & same
    return torch.nonzero(ok, as_tuple=False).flatten()


def block_targets(batch: dict, anchors: torch.Tensor, block_size: int,
                  labels: str = "argmax") -> tuple[torch.Tensor, torch.Tensor]:
    """(labels int64 [A, B], valid bool [A, B]) for ``anchors`` of a packed ``batch``; invalid
    positions hold label 0. ``labels``: ``"argmax"`` (the target's greedy token, default) or
    ``"dataset"`` (the dataset's next token). Raises ValueError for another value."""
    if labels not in ("argmax", "dataset"):
        raise ValueError(f"labels must be 'argmax' or 'dataset', not {labels!r}")
    n = batch["input_ids"].shape[0]
    j = torch.arange(block_size)
    nxt = anchors[:, None] + j + 1  # row of x_{a+j+1}
    inside = nxt < n
    nxt_c = nxt.clamp(max=n - 1)
    pos = batch["position_ids"]
    same = inside & (pos[nxt_c] == pos[anchors][:, None] + j + 1)
    valid = torch.cumprod((same & batch["loss_mask"][nxt_c]).long(), dim=1).bool()
    source = batch["argmax"][(nxt_c - 1)] if labels == "argmax" else batch["input_ids"][nxt_c]
    return torch.where(valid, source, torch.zeros_like(source)), valid


def context_window(anchors: torch.Tensor, position_ids: torch.Tensor, context: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(index int64 [A, C], keep bool [A, C]): rows ``a-C+1 … a`` (oldest first, the anchor last) and
    whether each lies in the anchor's conversation; rows before its start are clamped to ``a`` and
    masked out."""
    back = torch.arange(context - 1, -1, -1)  # C-1 … 0
    keep = position_ids[anchors][:, None] >= back
    index = torch.where(keep, anchors[:, None] - back, anchors[:, None])
    return index, keep
