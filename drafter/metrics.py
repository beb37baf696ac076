"""Offline score of a drafter, as the GLM-5.3-Flash DSpine drafter's model card defines it.

**Acceptance length** of one block: the number of leading block positions whose draft equals the
target's greedy token ``argmax[a+j]``, stopping at the first miss (or at the first invalid position,
see :mod:`drafter.blocks`), i.e. *accepted drafted tokens*, 0 … B. The score is its mean over anchors,
teacher-forced against the target's greedy output: the draft of position j is compared with what the
target would have produced after the true prefix, not after the drafter's own earlier tokens.

Convention: no bonus token. The model card reports 1.313 accepted tokens per block with first-token
accuracy 0.62 (FIELD-NOTES); with a +1 bonus token the mean would be at least 1 + 0.62 = 1.62, so its
number counts drafted tokens only. ``accept_len_with_bonus`` (= +1, the tokens a speculative decoding
step commits, including the target's own next token) is reported beside it.

**First-token accuracy**: fraction of anchors whose position-0 draft equals ``argmax[a]``.
"""

from __future__ import annotations

import dataclasses

import torch


def acceptance_length(pred: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """int64 [A]: leading positions with ``pred == labels`` and ``valid``, per row. All [A, B]."""
    hit = (pred == labels) & valid
    return torch.cumprod(hit.long(), dim=1).sum(dim=1)


@dataclasses.dataclass
class Score:
    """Running sums over blocks; :meth:`as_dict` gives the means."""

    blocks: int = 0
    accepted: int = 0
    first_correct: int = 0
    position_correct: list[int] = dataclasses.field(default_factory=list)  # per j, hits among valid
    position_valid: list[int] = dataclasses.field(default_factory=list)

    def add(self, pred: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor) -> None:
        """Add blocks: pred, labels int64 [A, B], valid bool [A, B] (position 0 must be valid)."""
        self.blocks += pred.shape[0]
        self.accepted += int(acceptance_length(pred, labels, valid).sum())
        self.first_correct += int((pred[:, 0] == labels[:, 0]).sum())
        hits = ((pred == labels) & valid).sum(0).tolist()
        n = valid.sum(0).tolist()
        if not self.position_correct:
            self.position_correct, self.position_valid = [0] * len(hits), [0] * len(n)
        self.position_correct = [a + b for a, b in zip(self.position_correct, hits)]
        self.position_valid = [a + b for a, b in zip(self.position_valid, n)]

    def as_dict(self) -> dict:
        """``accept_len`` (mean accepted drafted tokens per block, no bonus), ``accept_len_with_bonus``,
        ``first_token_acc``, ``position_acc`` (per block position, among valid positions; not
        conditioned on earlier hits), ``blocks``."""
        b = max(self.blocks, 1)
        return {
            "accept_len": self.accepted / b,
            "accept_len_with_bonus": self.accepted / b + 1,
            "first_token_acc": self.first_correct / b,
            "position_acc": [c / max(v, 1) for c, v in zip(self.position_correct, self.position_valid)],
            "blocks": self.blocks,
        }


def fit_bigram(input_ids: torch.Tensor, argmax: torch.Tensor, positions: torch.Tensor, vocab_size: int
               ) -> torch.Tensor:
    """Bigram baseline over the target's greedy tokens: int64 [V] table, ``table[c]`` = the most frequent
    ``argmax[t]`` among ``positions`` t whose token ``input_ids[t]`` is c (ties: the smaller id); a
    token never seen maps to the most frequent greedy token overall. input_ids, argmax int64 [N];
    positions int64 [P] (the train anchors)."""
    cur, nxt = input_ids[positions], argmax[positions]
    pairs, counts = torch.unique(cur * vocab_size + nxt, return_counts=True)
    overall = torch.bincount(nxt, minlength=vocab_size).argmax()
    table = torch.full((vocab_size,), int(overall), dtype=torch.long)
    cur_u, nxt_u = pairs // vocab_size, pairs % vocab_size
    c = int(counts.max()) + 1
    key = cur_u * (c * vocab_size) + (c - counts) * vocab_size + nxt_u  # (token asc, count desc, next asc)
    order = torch.argsort(key)
    cur_s = cur_u[order]
    first = torch.ones_like(cur_s, dtype=torch.bool)
    first[1:] = cur_s[1:] != cur_s[:-1]
    table[cur_s[first]] = nxt_u[order][first]
    return table


def bigram_draft(table: torch.Tensor, tokens: torch.Tensor, block_size: int) -> torch.Tensor:
    """Chain the bigram ``block_size`` steps from the anchor tokens: int64 [A] → [A, B]
    (``draft[:, 0] = table[x_a]``, ``draft[:, j] = table[draft[:, j-1]]``)."""
    out, cur = [], tokens
    for _ in range(block_size):
        cur = table[cur]
        out.append(cur)
    return torch.stack(out, dim=1)
