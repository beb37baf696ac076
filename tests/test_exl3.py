"""EXL3 engine without a GPU: the refusal is one line and exit 2, before anything is written; the check
script fails the same way; the tap → block mapping and the run header entries. (The comparison against
the HF engine needs CUDA: bench/exl3_check.py.) Also the GLM presets' engine defaults and MTP handling."""

from __future__ import annotations

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
    from capture.errors import CaptureError
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
