"""Who owns what: the bottom layer loads no front end, and every engine and codec is declared in its registry.

Checked in fresh interpreters (``sys.modules`` after one import), so nothing an earlier test imported counts.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO

FRONT_END = ("capture.config", "capture.data", "capture.chat", "capture.driver", "filters", "yaml")


def loaded_after(statement: str) -> set[str]:
    code = f"import json, sys\n{statement}\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    return set(json.loads(out.stdout.splitlines()[-1]))


@pytest.mark.parametrize("statement", ["import shards.stream", "import shards.verify", "import shards.recode",
                                       "import shards.export", "import shards.summary", "import drafter.data",
                                       "import shards.retain", "import shards.online"])
def test_the_shard_layer_loads_no_front_end(statement):
    loaded = loaded_after(statement)
    assert not loaded & set(FRONT_END), sorted(loaded & set(FRONT_END))
    assert "shards.run" in loaded and "capture.errors" in loaded  # the shared leaf modules, nothing more


def test_filters_load_only_leaf_modules():
    loaded = loaded_after("import filters")
    assert {m for m in loaded if m.startswith("capture")} <= {"capture", "capture.errors", "capture.hashing",
                                                              "capture.records"}
    assert "capture.records" in loaded  # the record types filters take
    assert "yaml" not in loaded and "torch" not in loaded


def test_the_cli_starts_without_torch():
    assert "torch" not in loaded_after("import cli")


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
