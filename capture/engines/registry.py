"""The one list of engines and the run settings each declares (:class:`~capture.engines.base.EngineOption`):
``RunConfig``'s engine fields take their defaults from here and check values against these declarations,
``capture run`` makes its engine flags from them, the plan refuses an option for an engine that does not
declare it, and each engine class names them in its ``Capabilities.options``. Light: the standard library
and two light modules of this package; no engine, no torch (the CLI reads it to build ``capture run``).
"""

from __future__ import annotations

import dataclasses

from capture.engines.vllm_paths import PATHS
from capture.engines.base import EngineOption
from common.errors import CaptureError


@dataclasses.dataclass(frozen=True)
class Registered:
    """One engine of :data:`REGISTRY`. ``cls``: ``"module:class"``, imported when first needed;
    ``package``: the module (and distribution) it runs on, whose presence means it is installed;
    ``options``: the run settings it takes (declared here, once; an option two engines take is the same
    declaration in both); ``an_option``: how ``--engine auto`` names one of them in its reason;
    ``check``: ``"module:function"`` raising CaptureError when the engine cannot run on this machine,
    called before anything is loaded (None: nothing to check that early)."""

    cls: str
    package: str
    options: tuple[EngineOption, ...] = ()
    an_option: str = ""
    check: str | None = None


_COMPUTE_DTYPE = EngineOption(
    "compute_dtype", "--dtype", str, "auto", choices=("auto", "float32", "bfloat16", "float16"),
    help="The engine's arithmetic (hf, vllm); states are stored in the target's dtype either way (default auto: the "
         "target's dtype where the CPU computes it natively or on cuda, else float32; a resume keeps the run's).")
_HF = (
    _COMPUTE_DTYPE,
    EngineOption("device", "--device", str, "auto", choices=("auto", "cpu", "cuda"),
                 help="Where the hf engine runs (default auto: cuda when a CUDA device is visible, else cpu)."),
    EngineOption("gpus_per_replica", "--gpus-per-replica", int, None, minimum=1,
                 help="GPUs each cuda hf replica reserves on Ray (default 1; the model is spread over them with "
                      "transformers' device_map=auto). In process (--executor local) it spreads over every visible "
                      "GPU: limit them with CUDA_VISIBLE_DEVICES."),
)
_VLLM = (
    _COMPUTE_DTYPE,
    EngineOption("vllm_path", "--vllm-path", str, "auto", choices=PATHS,
                 help="vLLM capture path: extract_hidden_states + KV connector, or worker-extension hooks (auto: "
                      "extract where the installed vLLM's model class emits every asked layer, incl. the last one "
                      "for the final state; else hooks, the reason logged)."),
    EngineOption("tp", "--tp", int, 1, minimum=1, help="vLLM tensor-parallel size."),
    EngineOption("max_model_len", "--max-model-len", int, None, minimum=1, help="vLLM context length."),
    EngineOption("gpu_memory_utilization", "--gpu-memory-utilization", float, None, minimum=0, maximum=1,
                 exclusive_minimum=True, help="vLLM GPU memory fraction."),
    EngineOption("vllm_args", "--vllm-arg", str, (), multiple=True,
                 help="KEY=VALUE passed to vllm.LLM (repeatable)."),
)
# name → the engine (its class imported when first needed)
REGISTRY = {
    "hf": Registered("capture.engines.hf:HFEngine", "transformers", _HF, "an hf-engine option"),
    "vllm": Registered("capture.engines.vllm:VLLMEngine", "vllm", _VLLM, "a vLLM option"),
    "exl3": Registered("capture.engines.exl3:EXL3Engine", "exllamav3", check="capture.engines.exl3:check_exl3"),
}
NAMES = ("auto", *REGISTRY)


def options() -> tuple[EngineOption, ...]:
    """Every engine option once, in registry order (an option two engines share: its one declaration).
    Raises CaptureError when two engines declare one name differently."""
    seen: dict[str, EngineOption] = {}
    for name, entry in REGISTRY.items():
        for opt in entry.options:
            if seen.setdefault(opt.name, opt) != opt:
                raise CaptureError(f"engine option {opt.name!r}: {name} declares it unlike another engine")
    return tuple(seen.values())


def option(name: str) -> EngineOption:
    """The declaration of the engine option ``name`` (a ``RunConfig`` field)."""
    return next(o for o in options() if o.name == name)


def option_names(engine: str) -> tuple[str, ...]:
    """The ``RunConfig`` fields ``engine`` takes (its :attr:`Capabilities.options <capture.engines.base.Capabilities>`)."""
    return tuple(o.name for o in REGISTRY[engine].options)


def takers(option_name: str) -> tuple[str, ...]:
    """The engines that take the option ``option_name``, in registry order."""
    return tuple(n for n, entry in REGISTRY.items() if any(o.name == option_name for o in entry.options))
