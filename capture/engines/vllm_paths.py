"""Which vLLM capture path serves a target: ``extract`` (vLLM's ``extract_hidden_states`` method) or
``hooks`` (forward hooks, :mod:`capture.engines.vllm_hooks`). Decided from the installed vLLM's model
class for the target's architecture, before any weights load.

The extract path stores what the model's own ``forward`` appends for each id in
``aux_hidden_state_layers`` (aux id ``i`` = the residual stream entering decoder layer ``i`` = the
output of layer ``i-1``: vLLM ``SupportsEagle3``). Two things can make that wrong or impossible:

* the class does not implement ``SupportsEagle3`` (no aux hidden states at all);
* the final state is wanted (aux id ``L`` = the output of the last layer, before the final norm) and the
  model's forward never appends id ``L``: models that record "entering layer ``idx``" inside the layer
  loop see ``idx`` only up to ``L-1`` and need an explicit ``end_layer`` check after it. Without one,
  vLLM hands over one state fewer than asked: speculators #705 got ``[2443, 5, 6144]`` for six ids from
  GLM-5.2-FP8, the final id 78 never matched. In vLLM 0.32 the generic ``DeepseekV2Model`` (GLM-5.x on
  CPU/XPU) has the check; the CUDA ``DeepseekV32Model`` that serves ``glm_moe_dsa`` on NVIDIA GPUs
  (``vllm/models/deepseek_v32/nvidia/model.py``) does not, so on a GPU with that vLLM GLM-5.3 with a
  final state takes the hooks path.

``auto`` picks ``extract`` when neither applies and the target has one residual stream, else
``hooks``; several residual streams (``glm5_next``) always take ``hooks`` under ``auto``, whose
start-up check (:func:`capture.engines.vllm_hooks.check_streams`) verifies, on the live module, the
method that completes and averages the streams (vLLM PR #55682). An explicit ``extract`` that cannot
serve the run is refused in one line.
"""

from __future__ import annotations

import inspect
import re
import sys

from common.errors import CaptureError

PATHS = ("auto", "extract", "hooks")

# the two ways a vLLM model's forward appends aux id L (the last layer's output): a check after the
# layer loop (DeepseekV2Model, Glm5Next) or recording after each layer at idx + 1 (LlamaModel, Qwen2Model)
_EMITS_LAST = (re.compile(r"end_layer\s+in\s+self\.aux_hidden_state_layers"),
               re.compile(r"_maybe_add_hidden_state\(\s*aux_hidden_states,\s*idx\s*\+\s*1"))


def model_class(model_config: dict):
    """The installed vLLM's model class for ``model_config["architectures"]`` (the first one vLLM
    registers), or None when vLLM has none or it cannot be imported here (e.g. a CUDA-only module)."""
    from vllm.model_executor.models import ModelRegistry

    for arch in model_config.get("architectures") or ():
        registered = ModelRegistry.models.get(arch)
        if registered is None:
            continue
        try:
            return registered.load_model_cls()
        except Exception:  # noqa: BLE001 - an import that fails on this platform: the class is unknown here
            return None
    return None


def emits_last_layer(model_cls) -> bool:
    """Whether ``model_cls``'s forward appends aux id ``L`` (the output of the last decoder layer) when
    asked. Reads the source of its inner model's ``forward`` (``model_cls.model_cls``, the DeepSeek
    family's attribute) or else of the module that defines the class, for one of :data:`_EMITS_LAST`."""
    inner = getattr(model_cls, "model_cls", None)
    source = inspect.getsource(inner.forward if inner is not None else sys.modules[model_cls.__module__])
    return any(p.search(source) for p in _EMITS_LAST)


def choose(path: str, model_config: dict, final: bool, model_cls=None) -> tuple[str, str]:
    """Resolve ``--vllm-path`` for a target → ``(path, why)``. ``final``: the run stores a final state
    (aux id ``L``); ``model_cls``: the installed vLLM's class (None: :func:`model_class` finds it).
    Raises CaptureError for an unknown path or an ``extract`` the class cannot serve."""
    if path not in PATHS:
        raise CaptureError(f"--vllm-path {path!r}: not one of {', '.join(PATHS)}")
    if path == "hooks":
        return "hooks", "asked for"
    text = model_config.get("text_config", model_config)
    streams = int(text.get("hc_mult") or 1)
    if path == "auto" and streams > 1:
        return "hooks", f"{streams} residual streams: the hooks path checks the stream-completing method at start"
    cls = model_cls if model_cls is not None else model_class(model_config)
    name = getattr(cls, "__name__", "?")
    problem = None
    if cls is None:
        problem = "this vLLM has no model class for the target's architectures it can import here"
    elif not callable(getattr(cls, "set_aux_hidden_state_layers", None)):
        problem = f"this vLLM's {name} has no aux hidden states (not SupportsEagle3)"
    elif final and not emits_last_layer(cls):
        layers = int(text.get("num_hidden_layers") or 0)
        problem = (f"this vLLM's {name} never emits aux id {layers} (the last layer's output, wanted for the "
                   "final state): vLLM would return one state fewer than asked (speculators #705)")
    if problem is None:
        return "extract", f"{name} emits every asked aux id"
    if path == "extract":
        raise CaptureError(f"--vllm-path extract: {problem}; use --vllm-path hooks (or auto)"
                           + (" or --final none" if "#705" in problem else ""))
    return "hooks", problem
