"""shards.summary (stat, ls, head) and `capture shards stat/ls/head`, with values known from the rows
written (no model: rows from tests/helpers.py). Fast."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers import COLUMNS, H, HEADER, invoke, make_row, write_run

from shards.manifest import ManifestWriter
from shards.summary import head, ls, stat


@pytest.fixture
def known_run(tmp_path):
    """Two sources with known lengths: alpha rows have 10 tokens, beta rows 30; three shards."""
    rng = np.random.default_rng(18)
    rows = [make_row(rng, i, 10 if i % 3 else 30, "beta" if i % 3 == 0 else "alpha") for i in range(9)]
    infos = write_run(tmp_path, [rows[0:4], rows[4:6], rows[6:9]], target_bytes=1)
    return tmp_path, infos, rows


def test_stat_values(known_run):
    run, infos, rows = known_run
    s = stat(run)
    tokens = 3 * 30 + 6 * 10
    loss = sum(int(r.loss_mask.sum()) for r in rows)
    nbytes = sum((run / i.path).stat().st_size for i in infos)
    assert s["run"] == str(run)
    assert s["target"] == "tiny"
    assert s["columns"] == COLUMNS
    assert s["hidden_size"] == H
    assert s["codec"] == "bf16"
    assert s["complete"] is True
    assert s["last_completion"] == {"rows": 9, "reason": "test"}
    assert s["shards"] == 3
    assert s["rows"] == 9
    assert s["tokens"] == tokens
    assert s["loss_tokens"] == loss
    assert s["bytes"] == nbytes
    assert s["bytes_per_token"] == round(nbytes / tokens, 1)
    assert s["raw_state_bytes_per_token"] == 3 * H * 2
    assert s["ratio_to_raw_states"] == round(nbytes / (tokens * 48), 4)
    alpha_loss = sum(int(r.loss_mask.sum()) for r in rows if r.source == "alpha")
    assert s["sources"] == {
        "beta": {"rows": 3, "tokens": 90, "loss_tokens": loss - alpha_loss, "token_share": 0.6},
        "alpha": {"rows": 6, "tokens": 60, "loss_tokens": alpha_loss, "token_share": 0.4},
    }
    assert list(s["sources"]) == ["beta", "alpha"]  # most tokens first


def test_stat_empty_run(tmp_path):
    assert stat(tmp_path) == {"run": str(tmp_path), "shards": 0}
    ManifestWriter.open(tmp_path, HEADER)
    s = stat(tmp_path)
    assert s["shards"] == 0 and s["rows"] == 0 and s["tokens"] == 0 and s["bytes_per_token"] is None
    assert s["sources"] == {} and s["complete"] is False and s["last_completion"] is None


def test_ls_values(known_run):
    run, infos, rows = known_run
    assert ls(run) == [{"path": i.path, "rows": i.rows, "tokens": i.tokens, "loss_tokens": i.loss_tokens,
                        "bytes": (run / i.path).stat().st_size, "sha256": i.sha256} for i in infos]
    assert [e["rows"] for e in ls(run)] == [4, 2, 3]
    assert [e["tokens"] for e in ls(run)] == [30 + 10 + 10 + 30, 10 + 10, 30 + 10 + 10]


def test_head_values(known_run):
    run, infos, rows = known_run
    h = head(run, 6)  # crosses from the first shard (4 rows) into the second
    assert [r["sample_id"] for r in h] == [f"d:{i}" for i in range(6)]
    for got, r in zip(h, rows):
        assert got["source"] == r.source
        assert got["num_tokens"] == len(r.input_ids)
        assert got["num_loss_tokens"] == int(r.loss_mask.sum())
        assert got["input_ids[:12]"] == r.input_ids[:12].tolist()
        assert got["token_sha256"] == r.token_sha256[:16]
        for c in COLUMNS:
            expected = float(torch.linalg.vector_norm(r.states[c].float(), dim=-1).mean())
            assert got[f"|{c}| mean"] == pytest.approx(expected, abs=0.006)
    assert [r["sample_id"] for r in head(run, 2)] == ["d:0", "d:1"]
    assert len(head(run, 100)) == 9
    assert head(run, 0) == []


def test_cli_ls_stat_head_json(known_run):
    run, infos, rows = known_run
    res = invoke("shards", "ls", "--json", str(run))
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert [d["path"] for d in data] == [i.path for i in infos]
    assert sum(d["rows"] for d in data) == 9
    assert sum(d["tokens"] for d in data) == 150
    assert [d["sha256"] for d in data] == [i.sha256 for i in infos]

    res = invoke("shards", "stat", "--json", str(run))
    assert res.exit_code == 0, res.output
    s = json.loads(res.output)
    assert s["rows"] == 9 and s["tokens"] == 150 and s["shards"] == 3
    assert s["loss_tokens"] == sum(int(r.loss_mask.sum()) for r in rows)
    assert s["bytes"] == sum(i.bytes for i in infos)
    assert s["sources"]["alpha"]["rows"] == 6 and s["sources"]["beta"]["token_share"] == 0.6

    res = invoke("shards", "head", "-n", "3", "--json", str(run))
    assert res.exit_code == 0, res.output
    assert [r["sample_id"] for r in json.loads(res.output)] == ["d:0", "d:1", "d:2"]

    text = invoke("shards", "ls", str(run))
    assert text.exit_code == 0
    lines = text.output.splitlines()
    assert lines[0].split() == ["path", "rows", "tokens", "loss_tokens", "bytes", "sha256"]
    assert [line.split()[0] for line in lines[1:]] == [i.path for i in infos]
