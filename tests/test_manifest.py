"""shards.manifest: reading (missing, torn last line, torn header, corrupt line, unknown version),
reopening (same header, a different run identity, a header from before ``responses``) and completion.

No model: the fixture ``good_run`` (conftest.py) and rows from tests/helpers.py. Fast.
"""

from __future__ import annotations

import json

import pytest
from helpers import BIG, HEADER, SCHEMA, make_header, make_rows, manifest_lines, rewrite_manifest, write_run

from common.errors import CaptureError
from shards import format as shard_format
from shards import manifest as manifest_mod
from shards.manifest import ManifestWriter
from shards.run import MANIFEST
from shards.verify import verify
from shards.writer import ShardWriter


def test_manifest_missing_is_empty(tmp_path):
    m = manifest_mod.read(tmp_path)
    assert m.header is None and m.shards == [] and m.completions == [] and m.committed_bytes == 0
    assert m.complete is False


def test_manifest_torn_last_line(good_run):
    run, infos, rows = good_run
    path = run / MANIFEST
    good = path.read_bytes()
    torn = json.dumps({"kind": "shard", "path": "shard-torn.arrow", "rows": 3}).encode()
    path.write_bytes(good + torn[: len(torn) // 2])

    m = manifest_mod.read(run)
    assert m.committed_bytes == len(good)
    assert [s["path"] for s in m.shards] == [i.path for i in infos]
    assert m.complete is True  # the torn line does not count as a later line
    assert verify(run).ok

    mw, reopened = ManifestWriter.open(run, HEADER)
    assert path.read_bytes() == good  # cut off at once
    assert [s["path"] for s in reopened.shards] == [i.path for i in infos]
    w = ShardWriter(run, SCHEMA, target_bytes=BIG)
    w.write(make_rows(12, 2, start=400))
    [info] = w.close()
    mw.commit(info)

    data = path.read_bytes()
    assert data.startswith(good) and data.endswith(b"\n")
    entries = [json.loads(line) for line in data.splitlines()]  # every line valid
    assert [e["kind"] for e in entries] == ["header", "shard", "shard", "shard", "complete", "shard"]
    m = manifest_mod.read(run)
    assert len(m.shards) == 4 and m.shards[-1]["path"] == info.path
    assert m.committed_bytes == len(data)
    assert verify(run).ok


def test_manifest_torn_header_only(tmp_path):
    (tmp_path / MANIFEST).write_bytes(json.dumps({"kind": "header", **HEADER.to_dict()}).encode()[:40])
    assert manifest_mod.read(tmp_path).header is None
    mw, m = ManifestWriter.open(tmp_path, HEADER)
    assert m.header is None
    lines = manifest_lines(tmp_path)
    assert lines == [{"kind": "header", **HEADER.to_dict()}]


def test_manifest_corrupt_middle_line(good_run):
    run, infos, _ = good_run
    path = run / MANIFEST
    lines = path.read_bytes().splitlines(keepends=True)
    lines[2] = b'{"kind": "shard", "path": oops\n'
    path.write_bytes(b"".join(lines))
    with pytest.raises(CaptureError, match="line 3"):
        manifest_mod.read(run)
    with pytest.raises(CaptureError):
        ManifestWriter.open(run, HEADER)
    assert path.read_bytes() == b"".join(lines)  # left alone


def test_manifest_unknown_major_version(tmp_path):
    (tmp_path / MANIFEST).write_text(json.dumps({"kind": "header", **make_header(format_version="2.0").to_dict()}) + "\n")
    with pytest.raises(CaptureError, match="2.0"):
        manifest_mod.read(tmp_path)


def test_manifest_reopen_same_header(good_run):
    run, infos, _ = good_run
    before = (run / MANIFEST).read_bytes()
    mw, m = ManifestWriter.open(run, HEADER)
    assert (run / MANIFEST).read_bytes() == before  # nothing written, nothing cut
    assert m.header == HEADER
    assert [s["path"] for s in m.shards] == [i.path for i in infos]
    assert len(m.completions) == 1
    w = ShardWriter(run, SCHEMA, target_bytes=BIG)
    w.write(make_rows(13, 1, start=500))
    [info] = w.close()
    mw.commit(info)
    kinds = [e["kind"] for e in manifest_lines(run)]
    assert kinds == ["header", "shard", "shard", "shard", "complete", "shard"]
    assert kinds.count("header") == 1


@pytest.mark.parametrize("field, value", [
    ("taps", {"layers": [1, 2], "final": "post-norm", "tap_convention": "t", "final_convention": "f"}),
    ("columns", ["tap_1", "tap_3"]),
    ("codec", "fp8"),
    ("tokenizer_sha256", "c" * 64),
    ("chat_template_sha256", "d" * 64),
    ("hidden_size", 16),
    ("target", {"name": "other"}),
    ("responses", {"mode": "regenerate", "policy": "last", "temperature": 0.0, "top_p": 1.0, "max_new_tokens": 512,
                   "seed": 0, "stop_ids": [2], "chat_template_kwargs": {}}),
    ("responses", {"mode": "dataset", "chat_template_kwargs": {"enable_thinking": False}}),
])
def test_manifest_reopen_with_different_header(good_run, field, value):
    run, infos, _ = good_run
    before = (run / MANIFEST).read_bytes()
    with pytest.raises(CaptureError) as e:
        ManifestWriter.open(run, make_header(**{field: value}))
    assert field in str(e.value)
    others = [k for k in shard_format.RUN_IDENTITY if k != field and k not in field]
    assert not any(f"different {k}" in str(e.value) for k in others)
    assert (run / MANIFEST).read_bytes() == before


def test_manifest_reopen_differing_only_in_chat_template_text_is_allowed(good_run):
    run, infos, _ = good_run
    mw, m = ManifestWriter.open(run, make_header(chat_template="other text, same hash"))
    assert len(m.shards) == 3


def test_manifest_reopen_of_a_header_from_before_responses(tmp_path):
    """A 1.0 header has no ``responses``: it means dataset answers, so today's dataset header resumes it and a
    regenerate header is refused."""
    write_run(tmp_path, [make_rows(3, 2)])
    lines = manifest_lines(tmp_path)
    lines[0] = {k: v for k, v in lines[0].items() if k != "responses"} | {"format_version": "1.0"}
    rewrite_manifest(tmp_path, lines)
    mw, m = ManifestWriter.open(tmp_path, HEADER)
    assert len(m.shards) == 1 and "responses" not in manifest_lines(tmp_path)[0]
    assert m.header.responses == {"mode": "dataset", "chat_template_kwargs": {}}  # what 1.0 meant
    with pytest.raises(CaptureError, match="different responses"):
        ManifestWriter.open(tmp_path, make_header(responses={"mode": "regenerate", "chat_template_kwargs": {}}))


def test_manifest_complete_flag(tmp_path):
    mw, m = ManifestWriter.open(tmp_path, HEADER)
    assert m.complete is False
    assert manifest_mod.read(tmp_path).complete is False  # header only
    w = ShardWriter(tmp_path, SCHEMA, target_bytes=BIG)
    w.write(make_rows(14, 2))
    [a] = w.close()
    mw.commit(a)
    assert manifest_mod.read(tmp_path).complete is False
    mw.complete({"rows": 2, "reason": "done"})
    m = manifest_mod.read(tmp_path)
    assert m.complete is True and len(m.completions) == 1
    assert m.completions[0] == {"kind": "complete", "rows": 2, "reason": "done"}
    w.write(make_rows(15, 2, start=10))
    [b] = w.close()
    mw.commit(b)
    m = manifest_mod.read(tmp_path)
    assert m.complete is False and len(m.completions) == 1 and len(m.shards) == 2
    assert verify(tmp_path).complete is False
    mw.complete({"rows": 4, "reason": "done again"})
    m = manifest_mod.read(tmp_path)
    assert m.complete is True and [c["rows"] for c in m.completions] == [2, 4]
    assert verify(tmp_path).complete is True
    assert m.sample_ids() == {"d:0", "d:1", "d:10", "d:11"}
    assert m.token_hashes() == set(a.token_sha256) | set(b.token_sha256)
