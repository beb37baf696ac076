"""Record filters, applied in the driver after tokenization and before the engine.

Order: model context and ``max_tokens`` (drop or truncate), ``min_tokens``, ``min_loss_tokens``, the
validity rule (at least one supervised token, always on), exact duplicates by ``token_sha256``. Each
dropped record gets exactly one reason:

=====================  ==============================================================
reason                 meaning
=====================  ==============================================================
over_context           longer than the model's ``max_position_embeddings`` (drop policy)
over_max_tokens        longer than ``max_tokens`` (drop policy)
under_min_tokens       shorter than ``min_tokens`` (after truncation)
under_min_loss_tokens  fewer supervised tokens than ``min_loss_tokens``
no_loss_tokens         no supervised token at all (validity; e.g. truncated before the first answer)
duplicate              same ``token_sha256`` as a record already kept or committed
=====================  ==============================================================

In regenerate mode (``--responses regenerate``) the driver applies :func:`filter_prompt` to the prompt
before generation and the replica applies :func:`apply_filters` (without dedup) to the generated record.

No filter is on by default except the model context and validity. The GLM-5.3-Flash DSpine drafter's
data kept only conversations of about 1,000 tokens or more: ``min_tokens=1000``.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import numpy as np

from common.records import Prompt, Tokenized


@dataclasses.dataclass(frozen=True)
class FilterConfig:
    min_tokens: int | None = None
    max_tokens: int | None = None
    min_loss_tokens: int | None = None
    overlength: Literal["drop", "truncate"] = "drop"
    dedup: bool = False

    def __post_init__(self) -> None:
        from common.errors import CaptureError

        for name in ("min_tokens", "max_tokens", "min_loss_tokens"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, int) and not isinstance(v, bool) and v >= 0):
                raise CaptureError(f"{name.replace('_', '-')}: {v!r} is not an integer >= 0")
        if self.overlength not in ("drop", "truncate"):
            raise CaptureError(f"overlength: {self.overlength!r} is not one of drop, truncate")
        if not isinstance(self.dedup, bool):
            raise CaptureError(f"dedup: {self.dedup!r} is not true or false")


def _truncate(rec: Tokenized, limit: int) -> Tokenized:
    """The first ``limit`` tokens of ``rec``; regenerated records keep the finish reasons of the answers
    still in it (each answer is one run of supervised tokens)."""
    mask = rec.loss_mask[:limit]
    reasons = rec.finish_reasons
    if reasons is not None:
        answers = int(np.count_nonzero(mask[1:] & ~mask[:-1])) + int(bool(mask[:1].any()))
        reasons = tuple(reasons[:answers])
    return dataclasses.replace(rec, input_ids=rec.input_ids[:limit], loss_mask=mask, finish_reasons=reasons)


def apply_filters(
    rec: Tokenized, cfg: FilterConfig, seen: set[str], context_len: int | None = None
) -> tuple[Tokenized | None, str | None]:
    """Returns ``(record, None)`` to keep (maybe truncated) or ``(None, reason)`` to drop.

    ``seen`` holds the token hashes already kept; a kept record's hash is added when ``cfg.dedup``.
    """
    for limit, reason in ((context_len, "over_context"), (cfg.max_tokens, "over_max_tokens")):
        if limit is not None and rec.num_tokens > limit:
            if cfg.overlength == "drop":
                return None, reason
            rec = _truncate(rec, limit)
    if cfg.min_tokens is not None and rec.num_tokens < cfg.min_tokens:
        return None, "under_min_tokens"
    if cfg.min_loss_tokens is not None and rec.num_loss_tokens < cfg.min_loss_tokens:
        return None, "under_min_loss_tokens"
    if rec.num_loss_tokens == 0:
        return None, "no_loss_tokens"
    if cfg.dedup:
        digest = rec.token_sha256
        if digest in seen:
            return None, "duplicate"
        seen.add(digest)
    return rec, None


def filter_prompt(prompt: Prompt, cfg: FilterConfig, seen: set[str], context_len: int | None,
                  max_new_tokens: int) -> str | None:
    """Regenerate mode, before generation: the drop reason for a :class:`capture.chat.Prompt`, or None.

    ``over_context``: its fixed tokens plus ``max_new_tokens`` per generated turn may not fit the model's
    context (always dropped: the engine cannot generate past it). ``over_max_tokens`` (drop policy):
    its fixed tokens alone exceed ``max_tokens``. ``duplicate`` (``cfg.dedup``): the same prompt tokens
    as a prompt already kept. Every filter that depends on the answers (``max_tokens`` again, with
    drop or truncate, ``min_tokens``, ``min_loss_tokens``) runs after generation, in the replica.
    """
    if context_len is not None and prompt.num_tokens + prompt.turns * max_new_tokens > context_len:
        return "over_context"
    if cfg.max_tokens is not None and cfg.overlength == "drop" and prompt.num_tokens > cfg.max_tokens:
        return "over_max_tokens"
    if cfg.dedup:
        if prompt.token_sha256 in seen:
            return "duplicate"
        seen.add(prompt.token_sha256)
    return None
