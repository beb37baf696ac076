"""The engine contract (:class:`Engine`, :class:`Capabilities`), the run settings an engine takes
(:class:`EngineOption`) and what every engine returns: captured states of a prefill, and generated answers.

Light on purpose (no torch or numpy at import): the CLI and :class:`capture.config.RunConfig` read the
engines' option declarations from :mod:`capture.engines` without loading an engine.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, Sequence

if TYPE_CHECKING:
    import numpy as np
    import torch


@dataclasses.dataclass
class Captured:
    """States of one sequence. ``states``: column name → bf16 tensor ``[T, H]``; ``argmax``: int32 ``[T]``;
    ``topk_ids`` int32 ``[T, K]`` / ``topk_logprobs`` float32 ``[T, K]``: the K most likely next tokens at
    each position and their log-probabilities over the full vocabulary, descending, ties to the lower id
    (an engine built with ``topk=K > 0``; else None)."""

    states: dict[str, torch.Tensor]
    argmax: np.ndarray | None
    topk_ids: np.ndarray | None = None
    topk_logprobs: np.ndarray | None = None


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


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class EngineOption:
    """A run setting only some engines take, declared once where the engine is registered
    (:data:`capture.engines.REGISTRY`): the ``RunConfig`` field and YAML key, the ``capture run`` flag, its
    help, and what values it takes. :class:`capture.config.RunConfig` validates it with :meth:`problem`,
    the CLI makes its click option from it, and :func:`capture.plan.prepare` refuses it, when
    :meth:`given`, for an engine that does not declare it.

    ``name``: the ``RunConfig`` field (and YAML key). ``flag``: the command-line flag (``--dtype`` for
    ``compute_dtype``). ``type``: ``str``, ``int`` or ``float`` (of each value). ``default``: the field's
    default (None: left to the engine); the option counts as given when the value differs from it.
    ``choices``: the values it takes, when a fixed list. ``minimum`` / ``maximum``: bounds of an ``int`` or
    ``float`` (``exclusive_minimum``: the minimum itself is refused). ``multiple``: a repeatable
    ``KEY=VALUE`` flag, stored as ``(key, value)`` pairs (:func:`capture.config.parse_pairs`)."""

    name: str
    flag: str
    type: type
    default: Any
    help: str
    choices: tuple[str, ...] | None = None
    minimum: float | None = None
    maximum: float | None = None
    exclusive_minimum: bool = False
    multiple: bool = False

    def given(self, value) -> bool:
        """Whether ``value`` asks for something (differs from the default)."""
        return value != self.default

    def problem(self, value) -> str | None:
        """What ``value`` should be when it is not a value of this option (``"one of auto, cpu, cuda"``,
        ``"an integer >= 1"``), else None. None is a value where the default is None."""
        if value is None and self.default is None:
            return None
        if self.multiple:
            ok = isinstance(value, tuple) and all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str)
                                                  for p in value)
            return None if ok else "KEY=VALUE pairs"
        if self.choices is not None:
            return None if value in self.choices else "one of " + ", ".join(self.choices)
        if self.type is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
            want = "an integer"
        elif self.type is float:
            ok, want = _is_number(value), "a number"
        else:
            return None if isinstance(value, self.type) else f"a {self.type.__name__}"
        lo, hi = self.minimum, self.maximum
        if ok and lo is not None:
            ok = value > lo if self.exclusive_minimum else value >= lo
        if ok and hi is not None:
            ok = value <= hi
        if ok:
            return None
        if lo is not None and hi is not None:
            return f"{want} in {'(' if self.exclusive_minimum else '['}{lo}, {hi}]"
        if lo is not None:
            return f"{want} {'>' if self.exclusive_minimum else '>='} {lo}"
        return want if hi is None else f"{want} <= {hi}"


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What an engine can do, declared by the engine class (``capabilities``); the driver and replicas
    branch on these, never on engine names.

    ``generates``: it implements ``generate`` (``--responses regenerate``). ``own_batching``: it schedules
    its own batches (vLLM's ``max_num_batched_tokens``), so a replica hands it a whole work unit at once
    instead of ``--batch-tokens`` batches. ``state_dtype``: the dtype its states come in when that is not
    the target's (exllamav3 exports float16), recorded as the run's dtype. ``finals``: the final-state
    conventions it captures. ``topk``: it can give the target's top-K next-token log-probabilities
    (``--topk K``; the driver refuses K > 0 for an engine without). ``devices``: where it runs
    (``cpu``, ``cuda``). ``gpus_per_tp_rank``: a replica reserves ``tp`` GPUs from Ray when the cluster
    has GPUs. ``options``: the names of the run settings (:class:`EngineOption`, ``RunConfig`` fields)
    this engine declares in :data:`capture.engines.REGISTRY` (the class passes
    :func:`capture.engines.option_names`); the plan refuses them for the others. ``in_process``: ``--executor auto`` runs one replica of it in the
    driver's process (no Ray). ``self_check``: rows ``--self-check`` rechecks by default (states from code
    paths other than a plain HF forward are worth rechecking; 0: off).
    """

    generates: bool
    own_batching: bool = False
    state_dtype: str | None = None
    finals: tuple[str, ...] = ("none", "post-norm", "pre-norm")
    topk: bool = False
    devices: tuple[str, ...] = ("cpu",)
    gpus_per_tp_rank: bool = False
    options: tuple[str, ...] = ()
    in_process: bool = False
    self_check: int = 0


class Engine(Protocol):
    """The engine contract (vLLM's connector interfaces are the model: small and role-split). A target
    model loaded for capture: ``forward`` prefills token ids and returns the tapped states, ``generate``
    answers prompts (self-distillation; engines whose capabilities say ``generates=False`` raise
    CaptureError). Tap k is the output of 0-based decoder layer k (HF ``hidden_states[k+1]``, vLLM aux
    id k+1); ``final`` follows the run's convention (see :class:`capture.targets.Taps`)."""

    name: str
    capabilities: ClassVar[Capabilities]

    def forward(self, batch: Sequence[np.ndarray]) -> list[Captured]:
        """Prefill each int32 ``[T_i]`` id array; one :class:`Captured` each, in order (states ``[T_i, H]``)."""
        ...

    def generate(self, prompts: Sequence[np.ndarray], sampling: Sampling, stop_ids: Sequence[int]) -> list[Generated]:
        """Continue each int32 prompt until a token of ``stop_ids`` or ``sampling.max_new_tokens``."""
        ...
