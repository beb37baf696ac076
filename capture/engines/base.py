"""What every engine returns: captured states of a prefill, and generated answers."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch


@dataclasses.dataclass
class Captured:
    """States of one sequence. ``states``: column name → bf16 tensor ``[T, H]``; ``argmax``: int32 ``[T]``."""

    states: dict[str, torch.Tensor]
    argmax: np.ndarray | None


@dataclasses.dataclass(frozen=True)
class Sampling:
    """Generation parameters for self-distillation (temperature 0 = greedy)."""

    temperature: float = 0.0
    top_p: float = 1.0
    max_new_tokens: int = 512
    seed: int = 0


@dataclasses.dataclass
class Generated:
    """One generated answer: int32 ``[N]`` new token ids (including the stop token when
    ``finish_reason == "stop"``); ``finish_reason`` is ``"stop"`` or ``"length"``."""

    token_ids: np.ndarray
    finish_reason: str
