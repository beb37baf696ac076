"""A replica whose model files or code differ from the driver's refuses before it writes a row (issue 33
part 3): the fingerprint on real files (a model folder built here), and a real two-node Ray cluster whose
worker node sees another config.json at the model's path (its own mount namespace, as a node set up by
hand would), where `capture run` stops with one line and commits nothing."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from capture import identity
from common.errors import CaptureError
from conftest import REPO, forget_ray_head, free_port, kill_tagged, start_ray_head, start_ray_worker


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


@pytest.mark.ray
def test_a_worker_node_with_another_model_config_stops_the_run_before_any_row(tmp_path, smol_dir, sample_jsonl):
    """A head with no CPU (the driver's node) and one worker node whose processes see a copy of SmolLM2's
    folder with another config.json at the same path: the replica lands there, refuses, and the run ends
    with exit 2, one line, and no shard committed."""
    other = smol_dir.parent / f".mismatch-{uuid.uuid4().hex[:8]}"  # beside it: hard links to the same weights
    other.mkdir()
    tag, port = uuid.uuid4().hex, free_port()
    env = {**os.environ, "RAY_AUTH_MODE": "token", "CAPTURE_TEST_TAG": tag}
    ray_bin = str(Path(sys.executable).with_name("ray"))
    try:
        for f in smol_dir.iterdir():
            os.link(f, other / f.name) if f.name != "config.json" else None
        config = json.loads((smol_dir / "config.json").read_text())
        (other / "config.json").write_text(json.dumps({**config, "edited_by_hand": True}))  # still loads
        subprocess.run([ray_bin, "get-auth-token", "--generate"], capture_output=True, timeout=120, check=True)
        head = start_ray_head(port, env, num_cpus=0)
        assert head.returncode == 0, head.stderr[-2000:]
        worker = start_ray_worker(f"127.0.0.1:{port}", env, 2, bind=(other, smol_dir))
        assert worker.returncode == 0, worker.stderr[-2000:]
        out = tmp_path / "run"
        proc = subprocess.run([sys.executable, "-m", "cli", "run", "--out", str(out), "--dataset", str(sample_jsonl),
                               "--limit", "4", "--max-tokens", "128", "--overlength", "truncate", "--no-progress",
                               "--ray-address", f"127.0.0.1:{port}", "--replicas", "1"],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 2, proc.stderr[-3000:]
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "config.json differ; it wrote nothing" in errors[0], proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr
        assert not list(out.glob("shard-*.arrow")) and '"kind": "shard"' not in (out / "manifest.jsonl").read_text()
    finally:
        kill_tagged(tag)
        forget_ray_head(port)
        shutil.rmtree(other, ignore_errors=True)
