"""Offline score of a drafter, as the GLM-5.3-Flash DSpine drafter's model card defines it.

**Acceptance length** of one block: the number of leading drafted slots (``1 … B-1``, see
:mod:`drafter.blocks`) whose draft equals the target's greedy token ``argmax[a+j-1]``, stopping at the
first miss (or at the first invalid slot), i.e. *accepted drafted tokens*, 0 … B-1. The score is its
mean over anchors, teacher-forced against the target's greedy output: the draft of slot j is compared
with what the target would have produced after the true prefix, not after the drafter's own earlier
tokens.

Convention: no bonus token. The model card reports 1.313 accepted tokens per block with first-token
accuracy 0.62 (FIELD-NOTES); with a +1 bonus token the mean would be at least 1 + 0.62 = 1.62, so its
number counts drafted tokens only. Its drafter reads the final state too, so its "first token" cannot
be the target's own next token (``lm_head(norm(final))`` would give it ~100% of the time): it is the
token after the anchor, slot 1 here, DFlash's convention. ``accept_len_with_bonus`` (= +1, the tokens a
speculative decoding step commits, including the target's own next token) is reported beside it.

**First-token accuracy**: fraction of anchors whose slot-1 draft equals ``argmax[a]``.
**Position accuracy**: per slot, hits among valid slots, not conditioned on earlier hits.
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
    split: bool = False  # ``add`` was told which anchors have a prompt-lookup match
    matched_blocks: int = 0
    matched_accepted: int = 0

    def add(self, pred: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor,
            matched: torch.Tensor | None = None) -> None:
        """Add blocks: pred, labels int64 [A, B-1] (drafted slots 1 … B-1), valid bool [A, B-1] (slot 1
        must be valid: it is, at every anchor); ``matched`` bool [A]: the anchors where prompt lookup has a
        match (:func:`lookup_draft`), to split the score by it."""
        self.blocks += pred.shape[0]
        accepted = acceptance_length(pred, labels, valid)
        self.accepted += int(accepted.sum())
        if matched is not None:
            self.split = True
            self.matched_blocks += int(matched.sum())
            self.matched_accepted += int(accepted[matched].sum())
        self.first_correct += int((pred[:, 0] == labels[:, 0]).sum())
        hits = ((pred == labels) & valid).sum(0).tolist()
        n = valid.sum(0).tolist()
        if not self.position_correct:
            self.position_correct, self.position_valid = [0] * len(hits), [0] * len(n)
        self.position_correct = [a + b for a, b in zip(self.position_correct, hits)]
        self.position_valid = [a + b for a, b in zip(self.position_valid, n)]

    def as_dict(self) -> dict:
        """``accept_len`` (mean accepted drafted tokens per block, no bonus), ``accept_len_with_bonus``,
        ``first_token_acc``, ``position_acc`` (per drafted slot, among valid slots; not conditioned on
        earlier hits), ``blocks``; where ``add`` was given ``matched``, ``by_lookup_match``: the share of
        blocks whose anchor has a prompt-lookup match and the mean accepted drafted tokens on those blocks
        and on the others (the split that tells a drafter that copies from one that does not)."""
        b = max(self.blocks, 1)
        out = {
            "accept_len": self.accepted / b,
            "accept_len_with_bonus": self.accepted / b + 1,
            "first_token_acc": self.first_correct / b,
            "position_acc": [c / max(v, 1) for c, v in zip(self.position_correct, self.position_valid)],
            "blocks": self.blocks,
        }
        if self.split:
            rest = self.blocks - self.matched_blocks
            out["by_lookup_match"] = {
                "share": self.matched_blocks / b,
                "accept_len_matched": self.matched_accepted / max(self.matched_blocks, 1),
                "accept_len_unmatched": (self.accepted - self.matched_accepted) / max(rest, 1),
            }
        return out


class BigramCounts:
    """Running (token, greedy next token) pair counts over ``vocab_size`` ids, kept sparse: pairs are
    appended and merged (``torch.unique``) whenever more than ``compact_at`` wait, so memory is the
    number of distinct pairs seen, not the number of anchors."""

    def __init__(self, vocab_size: int, compact_at: int = 1 << 20):
        self.vocab_size, self.compact_at = vocab_size, compact_at
        self.pairs, self.counts = torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)
        self.waiting: list[torch.Tensor] = []
        self.n_waiting = 0

    def add(self, cur: torch.Tensor, nxt: torch.Tensor) -> None:
        """Count pairs ``(cur[i], nxt[i])``; both int64 [N]."""
        self.waiting.append(cur.long() * self.vocab_size + nxt.long())
        self.n_waiting += len(cur)
        if self.n_waiting > self.compact_at:
            self._compact()

    def _compact(self) -> None:
        keys = torch.cat([self.pairs, *self.waiting])
        weights = torch.cat([self.counts, *(torch.ones_like(w) for w in self.waiting)])
        self.pairs, inverse = torch.unique(keys, return_inverse=True)
        self.counts = torch.zeros(len(self.pairs), dtype=torch.long).index_add_(0, inverse, weights)
        self.waiting, self.n_waiting = [], 0

    def state(self) -> dict[str, torch.Tensor]:
        """The counts as two int64 tensors (``pairs``: ``token * V + next``, ``counts``), for a checkpoint."""
        self._compact()
        return {"pairs": self.pairs, "counts": self.counts, "vocab_size": torch.tensor(self.vocab_size)}

    @classmethod
    def from_state(cls, state: dict[str, torch.Tensor]) -> "BigramCounts":
        out = cls(int(state["vocab_size"]))
        out.pairs, out.counts = state["pairs"], state["counts"]
        return out

    def table(self) -> torch.Tensor:
        """int64 [V]: ``table[c]`` = the most frequent next token after ``c`` (ties: the smaller id); a
        token never seen maps to the most frequent next token overall."""
        self._compact()
        V = self.vocab_size
        pairs, counts = self.pairs, self.counts
        nxt = pairs % V
        overall = torch.zeros(V, dtype=torch.long).index_add_(0, nxt, counts).argmax() if len(pairs) else 0
        table = torch.full((V,), int(overall), dtype=torch.long)
        if not len(pairs):
            return table
        cur_u, nxt_u = pairs // V, nxt
        c = int(counts.max()) + 1
        key = cur_u * (c * V) + (c - counts) * V + nxt_u  # (token asc, count desc, next asc)
        order = torch.argsort(key)
        cur_s = cur_u[order]
        first = torch.ones_like(cur_s, dtype=torch.bool)
        first[1:] = cur_s[1:] != cur_s[:-1]
        table[cur_s[first]] = nxt_u[order][first]
        return table


def fit_bigram(input_ids: torch.Tensor, argmax: torch.Tensor, positions: torch.Tensor, vocab_size: int
               ) -> torch.Tensor:
    """Bigram baseline over the target's greedy tokens: int64 [V] table, ``table[c]`` = the most frequent
    ``argmax[t]`` among ``positions`` t whose token ``input_ids[t]`` is c (ties: the smaller id); a
    token never seen maps to the most frequent greedy token overall. input_ids, argmax int64 [N];
    positions int64 [P] (the train anchors). :class:`BigramCounts` over one set."""
    counts = BigramCounts(vocab_size)
    counts.add(input_ids[positions], argmax[positions])
    return counts.table()


def bigram_draft(table: torch.Tensor, tokens: torch.Tensor, block_size: int) -> torch.Tensor:
    """Chain the bigram ``block_size`` steps from the anchor tokens: int64 [A] → [A, B]
    (``draft[:, 0] = table[x_a]``, ``draft[:, j] = table[draft[:, j-1]]``)."""
    out, cur = [], tokens
    for _ in range(block_size):
        cur = table[cur]
        out.append(cur)
    return torch.stack(out, dim=1)


def lookup_draft(input_ids: torch.Tensor, anchors: torch.Tensor, block_size: int, n: int = 2) -> torch.Tensor:
    """Prompt-lookup baseline (training-free n-gram copying, as in prompt lookup decoding): int64
    [A, B-1] drafts for ``anchors`` (int64 [A], increasing) of one conversation ``input_ids`` [T].

    For anchor ``a`` find the latest ``p < a`` whose ``n`` tokens ending at ``p`` equal those ending at
    ``a``; slot ``k`` drafts ``input_ids[p + 1 + (k-1) mod (a-p)]`` (the tokens that followed the match,
    repeated with period ``a-p`` where they run past ``a``: only tokens up to ``a`` are known). No match:
    ``-1`` (no draft, never accepted)."""
    ids = input_ids.tolist()
    latest: dict[tuple, int] = {}
    out = torch.full((len(anchors), block_size - 1), -1, dtype=torch.long)
    want = iter(enumerate(anchors.tolist()))
    i, a = next(want, (None, None))
    while a is not None and a < n - 1:  # no n tokens end there
        i, a = next(want, (None, None))
    for t in range(n - 1, len(ids)):
        key = tuple(ids[t - n + 1:t + 1])
        while a is not None and a == t:
            p = latest.get(key)
            if p is not None:
                out[i] = torch.tensor([ids[p + 1 + (k % (a - p))] for k in range(block_size - 1)])
            i, a = next(want, (None, None))
        latest[key] = t
    return out
