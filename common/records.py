"""The record types every stage passes along: a tokenized conversation and a prompt to regenerate.

A leaf module (numpy and :mod:`common.hashing` only): :mod:`capture.chat` makes these records,
:mod:`filters` drops or truncates them, a replica (:mod:`capture.replica`) prefills them and the shard
writer stores them as :class:`shards.rows.Row`. Nothing here imports the pipeline.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from common.hashing import token_sha256


@dataclasses.dataclass(frozen=True)
class Tokenized:
    """One conversation, tokenized. ``input_ids`` int32 ``[T]``, ``loss_mask`` bool ``[T]``."""

    sample_id: str
    row_index: int
    source: str
    input_ids: np.ndarray
    loss_mask: np.ndarray
    finish_reasons: tuple[str, ...] | None = None  # regenerate mode: "stop" | "length" per generated turn

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())

    @functools.cached_property
    def token_sha256(self) -> str:
        """Computed once per record (dedup and the shard writer both need it)."""
        return token_sha256(self.input_ids)


@dataclasses.dataclass(frozen=True)
class Prompt:
    """A conversation whose assistant turns the target regenerates (``--responses regenerate``).

    ``segments``: int32 token-id arrays that do not depend on the answers. ``segments[0]`` is the
    conversation up to and including the first regenerated turn's generation prompt; ``segments[j]``
    (j >= 1) is the template's text between the end-of-turn token that closes answer j-1 and the
    generation prompt of answer j (ChatML: ``\\n<|im_start|>user\\n…<|im_end|>\\n<|im_start|>assistant\\n``).
    The record is ``segments[0] + answer_0 + segments[1] + answer_1 + …``, each answer ending with the
    stop token the target generated. ``turn_ends[j]`` (j < turns - 1) is the end-of-turn token the
    template closes answer j with; the conversation goes on to ``segments[j+1]`` only when the target
    ended answer j with exactly that token.
    """

    sample_id: str
    row_index: int
    source: str
    segments: tuple[np.ndarray, ...]
    turn_ends: tuple[int, ...]

    @property
    def turns(self) -> int:
        """Assistant turns to generate."""
        return len(self.segments)

    @property
    def num_tokens(self) -> int:
        """Tokens that do not depend on the answers (the record has these plus the generated ones)."""
        return sum(len(s) for s in self.segments)

    @functools.cached_property
    def token_sha256(self) -> str:
        """Hash of the concatenated segments (``--dedup`` of identical prompts)."""
        return token_sha256(np.concatenate(self.segments))
