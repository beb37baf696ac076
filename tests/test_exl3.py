"""EXL3 engine without a GPU: the refusal is one line and exit 2, before anything is written; the check
script fails the same way; the tap → block mapping and the run header entries. (The comparison against
the HF engine needs CUDA: bench/exl3_check.py.) Also the GLM presets' engine defaults and MTP handling."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

from conftest import REPO, capture_inproc
from glm_fixtures import build_fixture

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_fixture("glm_moe_dsa", tmp_path_factory.mktemp("exl3") / "model", layers=3)


@no_cuda
def test_engine_exl3_refused_without_cuda(tiny, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}\n')
    out = tmp_path / "run"
    res = capture_inproc("run", "--target", str(tiny), "--dataset", str(data), "--engine", "exl3", "--out", str(out))
    assert res.exit_code == 2
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and "--engine exl3 needs a CUDA GPU" in lines[0], res.output
    assert not out.exists()


@no_cuda
def test_check_script_fails_clearly_without_cuda():
    proc = subprocess.run([sys.executable, "bench/exl3_check.py", "--exl3", "x", "--hf", "y"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == "exl3_check: --engine exl3 needs a CUDA GPU (exllamav3 has CUDA kernels only); none is visible here"


def test_exl3_block_indices_and_header():
    from capture.engines import EngineSpec
    from capture.engines.exl3 import export_indices
    from capture.targets import PRESETS, make_taps

    flash = PRESETS["glm-5.3-flash"]
    assert export_indices(make_taps(flash, None, None), 45) == {f"tap_{k}": k for k in (5, 14, 24, 33, 42)}
    assert export_indices(make_taps(flash, (5,), "pre-norm"), 45) == {"tap_5": 5, "final": 44}
    assert EngineSpec("exl3").describe() == {"name": "exl3", "fp16_clamp": 65504.0}


def test_glm_presets():
    from common.errors import CaptureError
    from capture.targets import PRESETS, make_taps

    glm, flash = PRESETS["glm-5.3"], PRESETS["glm-5.3-flash"]
    assert (glm.engine, glm.tp, glm.quantization, glm.mtp_layers) == ("vllm", 8, "fp8", 1)
    assert (flash.engine, flash.quantization, flash.residual_streams) == ("exl3", "exl3 4 bpw", 4)
    assert make_taps(flash, None, None).describe()["residual_streams"] == 4
    assert "stream_reduction" not in make_taps(glm, None, None).describe()
    with pytest.raises(CaptureError, match=r"taps are 0\.\.77 \(its 1 MTP layer\(s\) after them are not taps\)"):
        make_taps(glm, (5, 78), None)


def test_fixture_folder_reads_as_target(tiny):
    from capture.targets import resolve_target

    t = resolve_target(str(tiny))
    assert (t.architecture, t.num_layers, t.hidden_size, t.mtp_layers, t.residual_streams) == ("glm_moe_dsa", 3, 64, 1, 1)


class _FakeExl3:
    """Stands in for the ``exllamav3`` module, emulating the interface capture uses on top of a tiny HF
    model (float16, CPU): ``Model.forward(ids, params)`` appends, for each block in
    ``params["export_state_layers"]`` (ascending), its output (streams averaged) as fp16 ``[1, T, H]``
    clamped to ±65504 to ``params["export_states"]``, then the final norm's output when
    ``params["export_state_norm_keys"]`` holds ``"model.norm"``; it returns float32 logits."""

    def __init__(self, model_dir):
        from capture.engines.hf import load_causal_lm

        outer = self

        class Config:
            @staticmethod
            def from_directory(path):
                assert str(path) == str(model_dir)
                return path

        class Model:
            loaded = False

            @staticmethod
            def from_config(config):
                return Model()

            def load(self):
                self.hf = load_causal_lm(str(config_dir), torch.float32)
                self.loaded = True

            def forward(self, input_ids, params):
                assert self.loaded and input_ids.dtype == torch.int64 and input_ids.shape[0] == 1
                states, seen = params.setdefault("export_states", []), {}
                hooks = [layer.register_forward_hook(lambda _m, _i, out, k=k: seen.__setitem__(k, out[0]))
                         for k, layer in enumerate(self.hf.get_decoder().layers)]
                try:
                    out = self.hf(input_ids=input_ids, output_hidden_states=True)
                finally:
                    for h in hooks:
                        h.remove()
                for k in sorted(params.get("export_state_layers", ())):
                    x = seen[k].mean(dim=2) if seen[k].dim() == 4 else seen[k]
                    states.append(x.half().clamp_(-65504.0, 65504.0))
                if "model.norm" in params.get("export_state_norm_keys", ()):
                    states.append(out.hidden_states[-1].half())
                outer.calls += 1
                return out.logits.float()

        config_dir = model_dir
        self.calls = 0
        self.Config, self.Model = Config, Model


@pytest.mark.parametrize("final", ["post-norm", "pre-norm"])
def test_exl3_engine_plumbing_with_a_stand_in_library(tmp_path, monkeypatch, final):
    """EXL3Engine's own code (block mapping, export order, fp16 storage, final state, argmax) against the
    HF engine on the tiny glm5_next fixture, with exllamav3 replaced by :class:`_FakeExl3` (the real
    library needs CUDA: bench/exl3_check.py)."""
    import types

    import numpy as np

    from capture.engines.exl3 import EXL3Engine
    from capture.engines.hf import HFEngine
    from capture.targets import make_taps, resolve_target

    model_dir = build_fixture("glm5_next", tmp_path / "m")
    fake = _FakeExl3(model_dir)
    monkeypatch.setitem(sys.modules, "exllamav3", types.SimpleNamespace(Config=fake.Config, Model=fake.Model))
    monkeypatch.setattr("capture.engines.exl3.check_exl3", lambda: None)
    taps = make_taps(resolve_target(str(model_dir)), (1, 3), final)
    ids = [np.arange(5, 45, dtype=np.int32), np.arange(100, 130, dtype=np.int32)]
    got = EXL3Engine(str(model_dir), taps, argmax=True, num_layers=5).forward(ids)
    ref = HFEngine(str(model_dir), taps, argmax=True, dtype="float32").forward(ids)
    assert fake.calls == 2  # one record per forward
    for g, r in zip(got, ref):
        assert list(g.states) == list(taps.columns)
        for col in taps.columns:
            assert g.states[col].dtype == torch.float16
            torch.testing.assert_close(g.states[col].float(), r.states[col], rtol=2e-3, atol=2e-3)
        assert (g.argmax == r.argmax).mean() > 0.95


def test_exl3_run_header_stores_fp16(tmp_path, monkeypatch):
    """``--engine exl3`` runs store float16 fields and record the clamp (run header, built before any
    engine starts); regenerate mode is refused."""
    from capture.config import RunConfig
    from capture.plan import prepare
    from common.errors import CaptureError

    model_dir = build_fixture("glm_moe_dsa", tmp_path / "m", layers=3)
    monkeypatch.setattr("capture.engines.exl3.check_exl3", lambda: None)
    data = tmp_path / "d.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}\n')
    cfg = RunConfig(out=str(tmp_path / "out"), target=str(model_dir), dataset=str(data), engine="exl3",
                    chat_template=str(REPO / "capture" / "templates" / "glm.jinja"))
    prep = prepare(cfg)
    assert prep.header.dtype == "float16"
    assert prep.header.engine == {"name": "exl3", "fp16_clamp": 65504.0}
    with pytest.raises(CaptureError, match="--engine exl3 captures prefills only"):
        prepare(dataclasses.replace(cfg, responses="regenerate"))
