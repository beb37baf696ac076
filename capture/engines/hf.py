"""HF transformers engine: batched prefill that keeps only the tapped layers.

Taps are taken with forward hooks on the decoder layers (never ``output_hidden_states`` for every layer):
tap k is the output of ``model.layers[k]`` (in transformers 5 a decoder layer returns a Tensor; older
versions return a tuple whose first item is the hidden state). The final state is the output of the
final norm (``post-norm``) or of layer L-1 (``pre-norm``); see :mod:`capture.targets` for the convention.

Batches are right-padded: with causal attention a real token never attends to a later pad, so padding
does not change a real token's states beyond bf16 kernel differences between batch shapes (the tests
measure them against an unpadded reference). When neither ``argmax`` nor the post-norm final state is
needed, the forward stops right after the last tapped layer.

``argmax[t]`` is the target's greedy prediction for token t+1: ``argmax(lm_head(norm(h_{L-1}))[t])``,
computed in chunks over the real tokens only, so a ``[T, vocab]`` logits tensor never exists.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np
import torch

from capture.targets import Taps


@dataclasses.dataclass
class Captured:
    """States of one sequence. ``states``: column name → bf16 tensor ``[T, H]``; ``argmax``: int32 ``[T]``."""

    states: dict[str, torch.Tensor]
    argmax: np.ndarray | None


class _StopForward(Exception):
    pass


class HFEngine:
    """Load ``model_dir`` and capture ``taps``. ``threads`` sets torch's intra-op threads (None: unchanged)."""

    name = "hf"

    def __init__(self, model_dir: str, taps: Taps, *, argmax: bool = True, dtype: str = "bfloat16", threads: int | None = None):
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # one progress bar per run (the driver's), not one per replica
        if threads:
            torch.set_num_threads(threads)
        self.taps = taps
        self.want_argmax = argmax
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
        self.decoder = self.model.get_decoder()
        self.layers = self.decoder.layers
        self.num_layers = len(self.layers)
        self.pad_id = 0
        self._saved: dict[str, torch.Tensor] = {}
        self._stop_after = self._last_needed_layer()
        self._hooks = [self.layers[k].register_forward_hook(self._saver(f"tap_{k}", k)) for k in taps.layers]
        if taps.final == "pre-norm":
            self._hooks.append(self.layers[-1].register_forward_hook(self._saver("final", self.num_layers - 1)))
        elif taps.final == "post-norm":
            self._hooks.append(self.decoder.norm.register_forward_hook(self._saver("final", None)))

    def _last_needed_layer(self) -> int | None:
        """Layer after which the forward can stop, or None when the norm / LM head are needed."""
        if self.want_argmax or self.taps.final == "post-norm":
            return None
        return self.num_layers - 1 if self.taps.final == "pre-norm" else max(self.taps.layers)

    def _saver(self, column: str, layer: int | None):
        def hook(_module, _inputs, output):
            self._saved[column] = output[0] if isinstance(output, tuple) else output
            if layer is not None and layer == self._stop_after:
                raise _StopForward

        return hook

    @torch.inference_mode()
    def forward(self, batch: Sequence[np.ndarray]) -> list[Captured]:
        """Prefill a batch of token id arrays (int32 ``[T_i]``) and return one :class:`Captured` each."""
        lengths = [len(ids) for ids in batch]
        width = max(lengths)
        input_ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(batch), width), dtype=torch.long)
        for i, ids in enumerate(batch):
            input_ids[i, : lengths[i]] = torch.from_numpy(np.asarray(ids, dtype=np.int64))
            attention[i, : lengths[i]] = 1
        self._saved.clear()
        last = None
        try:
            last = self.decoder(input_ids=input_ids, attention_mask=attention, use_cache=False).last_hidden_state
        except _StopForward:
            pass
        columns = self.taps.columns
        out = []
        for i, n in enumerate(lengths):
            states = {c: self._saved[c][i, :n].contiguous() for c in columns}
            argmax = self._argmax(last[i, :n]) if self.want_argmax else None
            out.append(Captured(states, argmax))
        self._saved.clear()
        return out

    def _argmax(self, normed: torch.Tensor, chunk: int = 1024) -> np.ndarray:
        head = self.model.get_output_embeddings()
        parts = [head(normed[s : s + chunk]).argmax(dim=-1) for s in range(0, normed.shape[0], chunk)]
        return torch.cat(parts).to(torch.int32).numpy()
