"""shards.export and `capture export` on a real run (fixture ``reader_run``): the written files load back
with those projects' keys, shapes, dtypes and layer order, equal to the shard values bit for bit."""

from __future__ import annotations

import dataclasses
import json

import datasets
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

import cli
from capture.errors import CaptureError
from shards import format as shard_format
from shards import manifest as manifest_mod
from shards.export import export
from shards.manifest import ManifestWriter
from shards.reader import read_table, shard_paths
from shards.rows import state_tensor
from shards.stream import ShardStream
from shards.writer import ShardWriter
from helpers import bits, real_rows

TAPS = ("tap_3", "tap_15", "tap_27")


def stored(run) -> dict:
    """sample_id -> (table, row) of the run's shards."""
    out = {}
    for path in shard_paths(run):
        t = read_table(path)
        for i, sid in enumerate(t.column("sample_id").to_pylist()):
            out[sid] = (t, i)
    return out


def test_speculators_round_trip_through_the_cli(reader_run, tmp_path):
    out = tmp_path / "spec"
    res = CliRunner().invoke(cli.main, ["export", str(reader_run), str(out), "--format", "speculators",
                                        "--split", "heldout", "--heldout-fraction", "0.3", "--no-progress"])
    assert res.exit_code == 0, res.output
    record = json.loads((out / "export.json").read_text())
    held = ShardStream(reader_run, split="heldout", heldout_fraction=0.3).order()
    assert record["sample_ids"] == held and res.output.startswith(f"{out}: {len(held)} samples")
    assert [(t["slot"], t["tap"], t["vllm_aux_layer_id"], t["hf_hidden_states_index"]) for t in record["taps"]] == [
        (0, 3, 4, 4), (1, 15, 16, 16), (2, 27, 28, 28)]
    assert record["final"] == "post-norm"
    ds = datasets.load_from_disk(str(out))  # what speculators' ArrowDataset opens
    assert ds["sample_id"] == held
    rows = stored(reader_run)
    for i, sid in enumerate(held):
        t, r = rows[sid]
        f = load_file(str(out / "hidden_states" / f"hs_{i}.safetensors"))
        assert set(f) == {"token_ids", "hidden_states"}
        n = t.column("num_tokens")[r].as_py()
        assert f["token_ids"].dtype == torch.int64 and f["token_ids"].tolist() == t.column("input_ids")[r].as_py()
        hs = f["hidden_states"]
        assert hs.dtype == torch.bfloat16 and hs.shape == (n, 4, 576)
        for slot, column in enumerate((*TAPS, "final")):
            assert torch.equal(bits(hs[:, slot]), bits(state_tensor(t, column, r)))
        assert ds[i]["input_ids"] == f["token_ids"].tolist() and ds[i]["seq_len"] == n
        assert ds[i]["loss_mask"] == t.column("loss_mask")[r].as_py()
    # speculators' own reading: aux = hidden_states[:, :-1].flatten(1), verifier last = hidden_states[:, -1]
    t, r = rows[held[0]]
    hs = load_file(str(out / "hidden_states" / "hs_0.safetensors"))["hidden_states"]
    assert torch.equal(bits(hs[:, :-1].flatten(1)[:, 576:1152]), bits(state_tensor(t, "tap_15", r)))

    again = CliRunner().invoke(cli.main, ["export", str(reader_run), str(out), "--format", "speculators"])
    assert again.exit_code == 2 and "not empty" in again.output


def test_specforge_round_trip(reader_run, tmp_path):
    out = tmp_path / "sf"
    summary = export(reader_run, out, "specforge")
    order = ShardStream(reader_run).order()
    assert summary["samples"] == len(order) and summary["tokens"] == sum(
        s["tokens"] for s in manifest_mod.read(reader_run).shards)
    rows = stored(reader_run)
    for i, sid in enumerate(order):
        t, r = rows[sid]
        d = torch.load(out / "rows_0-2000" / f"data_{i}.ckpt", weights_only=True)
        assert set(d) == {"input_ids", "loss_mask", "aux_hidden_state", "hidden_state"}
        n = t.column("num_tokens")[r].as_py()
        assert d["input_ids"].dtype == torch.int64 and d["input_ids"].tolist() == t.column("input_ids")[r].as_py()
        assert d["loss_mask"].dtype == torch.int64 and d["loss_mask"].tolist() == [
            int(x) for x in t.column("loss_mask")[r].as_py()]
        aux = d["aux_hidden_state"]
        assert aux.dtype == torch.bfloat16 and aux.shape == (1, n, 3 * 576)
        for l, column in enumerate(TAPS):  # aux[..., l*H:(l+1)*H] is tap l in header order
            assert torch.equal(bits(aux[0, :, l * 576:(l + 1) * 576]), bits(state_tensor(t, column, r)))
        assert d["hidden_state"].shape == (1, n, 576)
        assert torch.equal(bits(d["hidden_state"][0]), bits(state_tensor(t, "final", r)))


def test_export_refuses_bad_input(reader_run, tmp_path):
    header = manifest_mod.read(reader_run).header
    header = header.replace(columns=list(TAPS), taps={**header.taps, "final": None})
    no_final = tmp_path / "no-final"
    mw, _ = ManifestWriter.open(no_final, header)
    sw = ShardWriter(no_final, shard_format.schema(header), target_bytes=1 << 40)
    rows = [dataclasses.replace(r, states={c: r.states[c] for c in TAPS}) for r in real_rows(reader_run)[:2]]
    sw.write(rows)
    mw.commit(sw.close()[0])
    with pytest.raises(CaptureError, match="need the final state"):
        export(no_final, tmp_path / "x", "specforge")
    with pytest.raises(CaptureError, match="unknown export format"):
        export(reader_run, tmp_path / "y", "eagle")
    res = CliRunner().invoke(cli.main, ["export", str(tmp_path / "nothing"), str(tmp_path / "z"), "--format", "specforge"])
    assert res.exit_code == 2 and "holds no capture run" in res.output
