"""Who owns what: the bottom layer loads no front end, and every engine and codec is declared in its registry.

Checked in fresh interpreters (``sys.modules`` after one import), so nothing an earlier test imported counts.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO

FRONT_END = ("capture.config", "capture.dataset", "capture.conversation", "capture.chat", "capture.driver", "filters", "yaml")


SHARD_LAYER = ["import shards.stream", "import shards.verify", "import shards.recode", "import shards.export",
               "import shards.summary", "import drafter.data", "import shards.retain", "import shards.online"]


@pytest.fixture(scope="module")
def loaded() -> dict[str, set[str]]:
    """``sys.modules`` after each statement, each in a fresh interpreter; the interpreters run side by side
    (each is one core's import work)."""
    code = "import json, sys\n{}\nprint(json.dumps(sorted(sys.modules)))"
    procs = {s: subprocess.Popen([sys.executable, "-c", code.format(s)], cwd=REPO, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
             for s in [*SHARD_LAYER, "import filters", "import cli"]}
    out = {}
    for statement, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr[-2000:]
        out[statement] = set(json.loads(stdout.splitlines()[-1]))
    return out


@pytest.mark.parametrize("statement", SHARD_LAYER)
def test_the_shard_layer_loads_no_front_end(loaded, statement):
    assert not loaded[statement] & set(FRONT_END), sorted(loaded[statement] & set(FRONT_END))
    assert "shards.run" in loaded[statement] and "common.errors" in loaded[statement]  # the shared leaf modules, nothing more


def test_filters_load_only_leaf_modules(loaded):
    assert {m for m in loaded["import filters"] if m.startswith("capture")} <= {"capture", "common.errors",
                                                                              "common.hashing", "common.records"}
    assert "common.records" in loaded["import filters"]  # the record types filters take
    assert "yaml" not in loaded["import filters"] and "torch" not in loaded["import filters"]


def test_the_cli_starts_without_torch(loaded):
    assert "torch" not in loaded["import cli"]


def test_every_registered_engine_declares_its_capabilities():
    from capture.engines import NAMES, REGISTRY, engine_class
    from capture.engines.base import Capabilities

    assert NAMES == ("auto", *REGISTRY)
    caps = {name: engine_class(name).capabilities for name in REGISTRY}
    assert all(isinstance(c, Capabilities) for c in caps.values())
    assert {n for n, c in caps.items() if c.generates} == {"hf", "vllm"}  # exl3 captures prefills only
    assert {n for n, c in caps.items() if c.own_batching} == {"vllm"}
    assert caps["exl3"].state_dtype == "float16" and caps["hf"].state_dtype is None
    assert "tp" in caps["vllm"].options and caps["hf"].options == ("compute_dtype", "device", "gpus_per_replica")


def test_every_registered_codec_is_a_cli_choice():
    from click.testing import CliRunner

    from cli import main
    from shards.codecs import CODECS, REGISTRY

    assert CODECS == tuple(REGISTRY)
    help_text = CliRunner().invoke(main, ["shards", "recode", "--help"]).output
    assert f"[{'|'.join(CODECS)}]" in help_text
