"""EXL3 engine (``--engine exl3``): prefill through exllamav3 on a CUDA GPU and keep the tapped layers'
states, for EXL3-quantized targets (GLM-5.3-Flash at 4 bpw on one small box).

exllamav3 (``pip install 'capture[exl3]'``, CUDA only) is imported lazily: without it, or without a CUDA
device, :func:`check_exl3` raises a one-line :class:`CaptureError` (exit 2) before anything is written.

API used (exllamav3, the DFlash-era ``export_state_layers`` interface): ``Config.from_directory(dir)``,
``Model.from_config(config)``, ``model.load()``, ``Tokenizer.from_config(config)`` (not needed for a
prefill of ids), and ``model.forward(input_ids [1, T] int64 CPU, params)`` with
``params["export_state_layers"] = {block indices}``: every transformer block whose index is in that set
appends its output (the residual after the block; for hyper-connection models the mean over the
residual streams, the same reduction as :func:`capture.targets.reduce_streams`, in the exllamav3 source
read for this work: bench/exl3_check.py confirms it on a GPU) to
``params["export_states"]`` as fp16 ``[1, T, H]``, in block order, **clamped to ±65504** by the library.
``params["export_state_norm_keys"] = {"model.norm"}`` appends the final norm's output (post-norm).

Layer numbering: exllamav3 block index k is decoder layer k (its embedding is a separate module), so
tap k = export index k (FIELD-NOTES "Layer numbering"); the pre-norm final state is block L-1.
States are stored as float16 (the shard field's ``dtype`` is ``float16``; the run header's engine entry
records ``"clamp": 65504``): converting to bf16 would round them a second time.
``argmax`` comes from the logits ``model.forward`` returns (float32 ``[1, T, vocab]``, one record at a
time, so at most one record's logits exist).
"""

from __future__ import annotations

import importlib.util
from typing import Sequence

import numpy as np

from capture.engines.registry import option_names
from capture.engines.base import Capabilities, Captured, Generated, Sampling
from common.errors import CaptureError
from capture.targets import Taps
from shards.format import tap_column

FP16_CLAMP = 65504.0


def check_exl3() -> None:
    """Raise CaptureError (one line) unless exllamav3 is installed and a CUDA device is visible."""
    import torch

    if not torch.cuda.is_available():
        raise CaptureError("--engine exl3 needs a CUDA GPU (exllamav3 has CUDA kernels only); none is visible here")
    if importlib.util.find_spec("exllamav3") is None:
        raise CaptureError("--engine exl3: exllamav3 is not installed (pip install 'capture[exl3]')")


def export_indices(taps: Taps, num_layers: int) -> dict[str, int]:
    """Column → exllamav3 block index: tap k → k; ``final`` pre-norm → L-1 (post-norm comes from the
    final norm's export key instead and is not in this map)."""
    out = {tap_column(k): k for k in taps.layers}
    if taps.final == "pre-norm":
        out["final"] = num_layers - 1
    return out


class EXL3Engine:
    """Load an EXL3 model folder and capture ``taps``; fp16 states ``[T, H]`` per column."""

    name = "exl3"
    capabilities = Capabilities(generates=False, state_dtype="float16", devices=("cuda",), options=option_names("exl3"))

    def __init__(self, model_dir: str, taps: Taps, *, argmax: bool = True, num_layers: int):
        check_exl3()
        from exllamav3 import Config, Model

        self.taps = taps
        self.want_argmax = argmax
        self.config = Config.from_directory(model_dir)
        self.model = Model.from_config(self.config)
        self.model.load()
        self.num_layers = num_layers
        self.index = export_indices(taps, num_layers)

    def forward(self, batch: Sequence[np.ndarray]) -> list[Captured]:
        """Prefill each record (int32 ``[T_i]``) alone; one :class:`Captured` each, fp16 states."""
        import torch

        out = []
        blocks = sorted(set(self.index.values()))
        for ids in batch:
            params: dict = {"export_state_layers": set(blocks)}
            if self.taps.final == "post-norm":
                params["export_state_norm_keys"] = {"model.norm"}
            input_ids = torch.from_numpy(np.asarray(ids, dtype=np.int64))[None]
            with torch.inference_mode():
                logits = self.model.forward(input_ids, params)
            exported = params.get("export_states") or []
            want = len(blocks) + (self.taps.final == "post-norm")
            if len(exported) != want:
                raise RuntimeError(f"exllamav3 exported {len(exported)} states, expected {want} "
                                   f"(blocks {blocks}{' + model.norm' if want > len(blocks) else ''})")
            by_block = {b: exported[i][0].to("cpu", torch.float16) for i, b in enumerate(blocks)}
            states = {col: by_block[b] for col, b in self.index.items()}
            if self.taps.final == "post-norm":
                states["final"] = exported[-1][0].to("cpu", torch.float16)
            for col, s in states.items():
                if s.shape[0] != len(ids):
                    raise RuntimeError(f"exllamav3 returned {s.shape[0]} positions for {col}, sent {len(ids)}")
            arg = logits[0].argmax(-1).to("cpu", torch.int32).numpy() if self.want_argmax else None
            out.append(Captured({c: states[c] for c in self.taps.columns}, arg))
        return out

    def generate(self, prompts: Sequence[np.ndarray], sampling: Sampling, stop_ids: Sequence[int]) -> list[Generated]:
        raise CaptureError("--engine exl3 does not generate (--responses regenerate): use the hf or vllm engine")
