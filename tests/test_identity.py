"""A replica whose model files or code differ from the driver's refuses before it writes a row (issue 33
part 3): the fingerprint on real files (a model folder built here). A worker node that sees another
config.json at the model's path, where `capture run` stops with one line and commits nothing:
tests/test_cluster.py."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from capture import identity
from common.errors import CaptureError


def model_folder(path: Path, seed: int = 0) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    (path / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"a": 0, "b": 1}}}))
    torch.manual_seed(seed)
    save_file({"w": torch.randn(1024, 1024), "v": torch.randn(512, 512)}, str(path / "model.safetensors"))
    return path


def test_the_fingerprint_names_what_differs(tmp_path):
    a = model_folder(tmp_path / "a")
    want = identity.of(a)
    same = shutil.copytree(a, tmp_path / "same")
    identity.check(same, want)  # a copy is the same model

    cases = {
        "config.json": lambda p: (p / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 65})),
        "tokenizer or chat template files": lambda p: (p / "tokenizer_config.json").write_text("{}"),
        "weights (model.safetensors)": lambda p: shutil.copy(model_folder(tmp_path / f"other-{p.name}", seed=1)
                                                             / "model.safetensors", p),  # same shapes, other values
    }
    for i, (field, change) in enumerate(cases.items()):
        other = shutil.copytree(a, tmp_path / f"b{i}")
        change(other)
        with pytest.raises(CaptureError, match=rf"finds .* unlike the driver's: {field.replace('(', '.').replace(')', '.')} differ; it wrote nothing"):
            identity.check(other, want)
    assert (tmp_path / "b2" / "model.safetensors").stat().st_size == (a / "model.safetensors").stat().st_size
    with pytest.raises(CaptureError, match=r"capture's code \(another version or an edited checkout\) differ"):
        identity.check(a, dataclasses.replace(want, code="0" * 64))
