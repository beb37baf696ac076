"""Pack samples into flat, unpadded batches of at most a token budget (varlen / FlashAttention style).

A packed batch of B samples and N tokens::

    {"input_ids": int64 [N], "loss_mask": bool [N], "argmax": int64 [N] (if the samples have it),
     "taps": bf16 [N, L, H], "final": bf16 [N, H] (if the samples have it),
     "topk_ids": int64 [N, K], "topk_logprobs": float32 [N, K] (if the samples have them),
     "position_ids": int64 [N] (0, 1, ... restarting at every sample),
     "cu_seqlens": int32 [B+1] (sample b is tokens cu_seqlens[b]:cu_seqlens[b+1]),
     "sample_ids": list[str] (B ids, in order)}

Rules: samples keep their order; a batch takes samples while their tokens fit ``max_tokens``; a sample
is never split across batches and nothing is padded (so no pad token is ever in the loss). A sample
longer than ``max_tokens``: ``oversize="alone"`` (default) puts it whole into a batch of its own, which
is then larger than the budget; ``"truncate"`` keeps its first ``max_tokens`` tokens (ids, mask, argmax,
top-K and states cut together; the rest is dropped, not carried into the next batch); ``"error"`` raises
CaptureError. The last, partial batch is always emitted.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch

from common.errors import CaptureError

OVERSIZE = ("alone", "truncate", "error")
TOKEN_KEYS = ("input_ids", "loss_mask", "argmax", "taps", "final", "topk_ids", "topk_logprobs")  # per-token, first dim T


def pack(samples: Iterable[dict], max_tokens: int, oversize: str = "alone") -> Iterator[dict]:
    """Packed batches of ``samples`` (dicts from :class:`shards.stream.ShardStream`); see the module
    docstring for the layout and the oversize rule. Raises CaptureError for a budget below 1 or an
    unknown ``oversize``, and (``oversize="error"``) for a sample longer than the budget."""
    if max_tokens < 1:
        raise CaptureError(f"max_tokens must be at least 1, got {max_tokens}")
    if oversize not in OVERSIZE:
        raise CaptureError(f"unknown oversize rule {oversize!r}; one of {', '.join(OVERSIZE)}")
    batch, tokens = [], 0
    for sample in samples:
        n = len(sample["input_ids"])
        if n > max_tokens:
            if oversize == "error":
                raise CaptureError(f"sample {sample['sample_id']} has {n} tokens, over the budget of {max_tokens}")
            if oversize == "truncate":
                sample = {k: (v[:max_tokens] if k in TOKEN_KEYS else v) for k, v in sample.items()}
                n = max_tokens
        if batch and tokens + n > max_tokens:
            yield collate(batch)
            batch, tokens = [], 0
        batch.append(sample)
        tokens += n
    if batch:
        yield collate(batch)


def collate(samples: list[dict]) -> dict:
    """Concatenate ``samples`` into one packed batch (the module docstring's layout), whatever their
    total length."""
    lengths = torch.tensor([len(s["input_ids"]) for s in samples], dtype=torch.int32)
    cu = torch.zeros(len(samples) + 1, dtype=torch.int32)
    torch.cumsum(lengths, 0, out=cu[1:])
    starts = torch.repeat_interleave(cu[:-1].long(), lengths.long())
    out = {k: torch.cat([s[k] for s in samples]) for k in TOKEN_KEYS if k in samples[0]}
    out["position_ids"] = torch.arange(int(cu[-1]), dtype=torch.long) - starts
    out["cu_seqlens"] = cu
    out["sample_ids"] = [s["sample_id"] for s in samples]
    return out
