"""`capture shards check`: real SmolLM2 runs pass against an independent float32 HF forward (post-norm and
pre-norm final, every codec); runs whose states were corrupted before encoding fail, naming the tap and
rows: zeros in one tap, one tap taken from the neighbouring layer, the final state stored pre-norm but
labelled post-norm, and inf / NaN made by an fp16 overflow that bypassed validation."""

import dataclasses
import json

import pytest
import torch

from conftest import capture_cli
from provenance.check import compare, reference, thresholds_for
from shards import codecs
from shards import manifest as manifest_mod
from shards.format import schema
from shards.reader import iter_rows
from shards.recode import recode
from shards.rows import read_row
from shards.run import as_location
from shards.writer import ShardWriter

pytestmark = pytest.mark.model  # every test checks real captures against a forward


def test_real_runs_pass_post_norm_and_pre_norm(reader_run, prenorm_run):
    for run in (reader_run, prenorm_run):
        proc = capture_cli("shards", "check", str(run), "--rows", "3", "--json")
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        r = json.loads(proc.stdout)
        assert r["ok"] and len(r["rows"]) == 3 and r["dtype"] == "float32"
        assert [t["column"] for t in r["taps"]] == ["tap_3", "tap_15", "tap_27", "final"]
        for t in r["taps"]:  # bf16 arithmetic against float32 (module docstring's measurement)
            assert t["cos_mean"] > 0.9995 and t["cos_min"] > 0.99 and t["rel_err"] < 0.03
            assert t["zero_tokens"] == t["constant_tokens"] == t["nonfinite_tokens"] == 0
        assert r["argmax_agreement"] > 0.95


@pytest.fixture(scope="module")
def layered_run(tmp_path_factory, smol_dir):
    """6 ShareGPT rows (<= 256 tokens) with taps 3, 14, 15, 29 and the post-norm final state."""
    out = tmp_path_factory.mktemp("check") / "run"
    capture_cli("run", "--target", "smollm2-135m", "--dataset", "sharegpt", "--layers", "3,14,15,29", "--final",
                "post-norm", "--limit", "6", "--max-tokens", "256", "--overlength", "truncate", "--out", str(out),
                "--no-progress", check=True)
    return out


def rewrite(src, dst, mutate) -> None:
    """A copy of run ``src`` at ``dst`` whose rows went through ``mutate(row) -> row`` before encoding,
    committed as a capture commits (header, shards, completion): nothing validates the states."""
    m = manifest_mod.read(src)
    writer, _ = manifest_mod.ManifestWriter.open(dst, m.header)
    out = ShardWriter(dst, schema(m.header), 2**30)
    rows = [mutate(row) for row in stored_rows(src)]
    for info in out.write(rows) + out.close():
        writer.commit(info)
    writer.complete({})


def stored_rows(run) -> list:
    loc = as_location(run)
    return [read_row(t, i) for e in manifest_mod.read(loc).shards for t in [loc.read_table(e["path"])]
            for i in range(t.num_rows)]


def test_corrupted_states_fail_naming_tap_and_rows(layered_run, smol_dir, tmp_path):
    bad = tmp_path / "bad"
    first = next(iter_rows(layered_run))["sample_id"]

    def mutate(row):
        s = dict(row.states)
        s["tap_3"] = torch.zeros_like(s["tap_3"])  # all-zero states (vLLM PR #46301)
        s["tap_15"] = s["tap_14"].clone()  # the neighbouring layer's output
        s["final"] = s["tap_29"].clone()  # pre-norm, labelled post-norm
        if row.sample_id == first:  # an fp16 overflow that slipped past validation, in one row
            big = torch.full((4,), 60000.0, dtype=torch.float16)
            inf = big + big  # fp16 overflows to inf (max 65504) ...
            s["tap_29"] = s["tap_29"].clone()
            s["tap_29"][0, :4], s["tap_29"][0, 4:8] = inf, inf - inf  # ... and inf - inf is NaN
        return dataclasses.replace(row, states=s)

    rewrite(layered_run, bad, mutate)
    proc = capture_cli("shards", "check", str(bad), "--rows", "6", "--model-path", str(smol_dir), "--json")
    assert proc.returncode == 1, proc.stderr[-2000:]
    r = json.loads(proc.stdout)
    taps = {t["column"]: t for t in r["taps"]}
    assert not r["ok"]
    assert {c for c, t in taps.items() if not t["ok"]} == {"tap_3", "tap_15", "tap_29", "final"}
    assert taps["tap_14"]["ok"] and taps["tap_14"]["failing_rows"] == []
    assert taps["tap_3"]["zero_tokens"] == 1.0
    assert 0.9 < taps["tap_15"]["cos_mean"] < 0.99  # close, not close enough: the neighbouring layer
    assert taps["final"]["cos_mean"] < 0.9
    assert taps["tap_29"]["nonfinite_tokens"] > 0 and taps["tap_29"]["failing_rows"] == [first]
    assert sorted(taps["tap_15"]["failing_rows"]) == sorted(r["rows"]) and len(r["rows"]) == 6
    text = capture_cli("shards", "check", str(bad), "--rows", "2", "--model-path", str(smol_dir))
    assert text.returncode == 1 and "FAILED: tap_3: " in text.stdout and "tap_15: per-token cosine" in text.stdout


def test_every_codec_passes_within_its_bound(layered_run, smol_dir, tmp_path):
    """Every codec's recode of a real run passes the thresholds of its class (one reference forward)."""
    header = manifest_mod.read(layered_run).header
    rows = list(iter_rows(layered_run))[:3]
    refs = reference(str(smol_dir), "float32", list(header.taps["layers"]), header.taps["final"],
                     [r["input_ids"] for r in rows], 0)
    for codec in codecs.CODECS:
        dst = tmp_path / codec
        recode(layered_run, dst, codec)
        stored = {r.sample_id: r for r in stored_rows(dst)}
        report = compare(str(dst), str(smol_dir), "float32", manifest_mod.read(dst).header,
                         [stored[r["sample_id"]] for r in rows], refs)
        assert report.ok, (codec, report.problems)
        assert report.thresholds == dataclasses.asdict(thresholds_for(codec))


def test_self_check_is_recorded_in_the_completion_record_and_provenance(tmp_path):
    """``capture run --self-check 2``: the verdict is in the summary, the manifest's completion record and
    this invocation of provenance.json; hf runs check nothing by default."""
    out = tmp_path / "run"
    args = ["run", "--dataset", "sharegpt", "--layers", "3,15", "--final", "post-norm", "--limit", "3",
            "--max-tokens", "256", "--overlength", "truncate", "--out", str(out), "--no-progress", "--json"]
    s = json.loads(capture_cli(*args, "--self-check", "2", check=True).stdout)
    c = s["self_check"]
    assert c["ok"] and c["rows"] == 2 and c["dtype"] == "float32" and set(c["taps"]) == {"tap_3", "tap_15", "final"}
    assert all(t["cos_mean"] > 0.9995 for t in c["taps"].values()) and c["argmax_agreement"] > 0.95
    assert manifest_mod.read(out).completions[-1]["self_check"] == c
    prov = json.loads((out / "provenance.json").read_text())
    assert prov["invocations"][-1]["self_check"] == c
    plain = json.loads(capture_cli(*[a if a != str(out) else str(tmp_path / "plain") for a in args], check=True).stdout)
    assert plain["self_check"] is None
    assert "self_check" not in json.loads((tmp_path / "plain" / "provenance.json").read_text())["invocations"][-1]
