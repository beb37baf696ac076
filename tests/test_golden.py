"""A fixed small capture, decoded the same way before and after any refactor (issue 30's acceptance).

``tests/golden/run/`` is a committed run: the first 6 ShareGPT rows (3 kept) through SmolLM2-135M (:data:`ARGS`:
taps 3 and 15, the post-norm final state, argmax, top-4, float32 arithmetic stored as bf16, at most 48
tokens per row, two shards). ``tests/golden/decoded.json`` holds, per row, the SHA-256 of every decoded
field (ids, loss mask, argmax, top-K ids and log-probabilities, each state cell's bf16 bits) as
:func:`digest` computes it from :func:`shards.rows.read_row`, and the CPU capability that computed the
states. Remake both (only when the stored bytes are meant to change) with
``.venv/bin/python tests/test_golden.py``.

- :func:`test_committed_run_decodes_to_the_golden_digests` (fast lane): every decoder of a run
  (``read_row``, ``ShardStream``, the HF ``datasets`` transform) gives exactly the recorded values.
- :func:`test_capture_today_gives_the_golden_rows` (model lane): the same capture made now gives the same
  rows; states, argmax and top-K bit for bit where torch dispatches the CPU capability that made them
  (another capability, e.g. AVX2 against AVX512, rounds float32 matmuls differently: there states must
  agree to one bf16 step and ids and masks exactly).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
if __name__ == "__main__":
    sys.path.insert(0, str(REPO))

from shards import manifest as manifest_mod  # noqa: E402
from shards.hf import hf_dataset  # noqa: E402
from shards.rows import read_row  # noqa: E402
from shards.run import resolve  # noqa: E402
from shards.stream import ShardStream  # noqa: E402

GOLDEN = Path(__file__).parent / "golden"
ARGS = ("run", "--target", "smollm2-135m", "--dataset", "sharegpt", "--limit", "6", "--layers", "3,15",
        "--final", "post-norm", "--topk", "4", "--dtype", "float32", "--max-tokens", "48", "--overlength",
        "truncate", "--unit-tokens", "96", "--first-unit-tokens", "96", "--shard-size", "1KiB",
        "--executor", "local", "--no-progress")


def _sha(a: np.ndarray | torch.Tensor) -> str:
    if isinstance(a, torch.Tensor):
        a = a.contiguous().view(torch.int16).numpy() if a.dtype == torch.bfloat16 else a.numpy()
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def rows_of(run: Path) -> list:
    """Every committed row of ``run`` in manifest order, decoded by :func:`shards.rows.read_row`."""
    loc = resolve(str(run))
    rows = []
    for shard in manifest_mod.read(loc).shards:
        table = loc.read_table(shard["path"])
        rows += [read_row(table, i) for i in range(table.num_rows)]
    return rows


def digest(row) -> dict:
    """One row's fields as SHA-256 hex digests of their bytes (ids and argmax int32, mask bool, top-K ids
    int32 and log-probabilities float32, states bf16 bits as int16)."""
    return {"sample_id": row.sample_id, "source": row.source, "row_index": row.row_index,
            "tokens": row.num_tokens, "token_sha256": row.token_sha256,
            "input_ids": _sha(row.input_ids), "loss_mask": _sha(row.loss_mask), "argmax": _sha(row.argmax),
            "topk_ids": _sha(row.topk_ids), "topk_logprobs": _sha(row.topk_logprobs),
            "states": {c: _sha(t) for c, t in sorted(row.states.items())}}


def golden() -> dict:
    return json.loads((GOLDEN / "decoded.json").read_text())


def test_committed_run_decodes_to_the_golden_digests():
    want = golden()
    rows = rows_of(GOLDEN / "run")
    assert [digest(r) for r in rows] == want["rows"]
    assert len(rows) == 3 and sum(r.num_tokens for r in rows) == want["tokens"]
    assert len(manifest_mod.read(resolve(str(GOLDEN / "run"))).shards) >= 2  # a run of several shards

    stream = list(ShardStream(GOLDEN / "run"))  # the trainer's decoder: taps stacked [T, L, H]
    assert [s["sample_id"] for s in stream] == [r.sample_id for r in rows]
    for s, r in zip(stream, rows):
        assert _sha(s["input_ids"].to(torch.int32)) == _sha(r.input_ids)
        assert _sha(s["loss_mask"]) == _sha(r.loss_mask)
        assert _sha(s["argmax"].to(torch.int32)) == _sha(r.argmax)
        assert _sha(s["taps"][:, 0]) == _sha(r.states["tap_3"]) and _sha(s["taps"][:, 1]) == _sha(r.states["tap_15"])
        assert _sha(s["final"]) == _sha(r.states["final"])
        assert _sha(s["topk_ids"].to(torch.int32)) == _sha(r.topk_ids)
        assert _sha(s["topk_logprobs"]) == _sha(r.topk_logprobs)

    ds = hf_dataset(GOLDEN / "run", states=True)  # the datasets transform: the same contract
    assert len(ds) == len(rows)
    for i, r in enumerate(rows):
        s = ds[i]
        assert s["sample_id"] == r.sample_id
        assert _sha(s["input_ids"].to(torch.int32)) == _sha(r.input_ids)
        assert _sha(s["taps"][:, 1]) == _sha(r.states["tap_15"]) and _sha(s["final"]) == _sha(r.states["final"])
        assert _sha(s["topk_logprobs"]) == _sha(r.topk_logprobs)


@pytest.mark.model
def test_capture_today_gives_the_golden_rows(tmp_path, smol_dir):
    from conftest import capture_cli

    capture_cli(*ARGS, "--out", str(tmp_path / "run"), check=True)
    want = golden()
    now = rows_of(tmp_path / "run")
    then = rows_of(GOLDEN / "run")
    exact = ("sample_id", "source", "row_index", "tokens", "token_sha256", "input_ids", "loss_mask")
    got = [digest(r) for r in now]
    assert [{k: d[k] for k in exact} for d in got] == [{k: d[k] for k in exact} for d in want["rows"]]
    if torch.backends.cpu.get_cpu_capability() == want["cpu_capability"]:
        assert got == want["rows"]  # every state cell, argmax and top-K bit for bit
    else:
        for a, b in zip(now, then):
            for c in a.states:
                step = (b.states[c].float().abs() * 2 ** -7).clamp_min(2 ** -126)  # one bf16 step
                assert ((a.states[c].float() - b.states[c].float()).abs() <= step).all(), c


def _make() -> None:
    """Remake tests/golden/ (run it as a script, from the repo's virtual environment)."""
    import subprocess

    shutil.rmtree(GOLDEN / "run", ignore_errors=True)
    GOLDEN.mkdir(exist_ok=True)
    subprocess.run([sys.executable, "-m", "cli", *ARGS, "--out", str(GOLDEN / "run")], cwd=REPO, check=True)
    rows = rows_of(GOLDEN / "run")
    (GOLDEN / "decoded.json").write_text(json.dumps(
        {"args": list(ARGS), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
         "tokens": sum(r.num_tokens for r in rows), "rows": [digest(r) for r in rows]}, indent=1) + "\n")


if __name__ == "__main__":
    _make()
