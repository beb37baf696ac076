"""`capture shards repair` (issue 33 part 4): a truncated, a bit-flipped and a deleted shard are given up
with their reasons, `verify` passes, and the same `capture run` captures exactly their rows again; on an
object-store run the `lost` line is one more manifest.d/ entry."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from helpers import make_rows, write_run

from conftest import READER_RUN, capture_cli
from shards import manifest
from shards.reader import iter_rows
from shards.repair import repair
from shards.run import MANIFEST, MANIFEST_DIR, OBJSTORE_SCHEME, resolve
from shards.verify import verify


def damage(run, shards: list[dict]) -> dict[str, str]:
    """Truncate the first of ``shards`` by 100 bytes, flip one bit in the middle of the second, delete the
    third; returns path → the reason repair must give."""
    a, b, c = (run / s["path"] for s in shards)
    a.write_bytes(a.read_bytes()[:-100])
    data = bytearray(b.read_bytes())
    data[len(data) // 2] ^= 0x10
    b.write_bytes(bytes(data))
    c.unlink()
    return {shards[0]["path"]: "size", shards[1]["path"]: "sha256", shards[2]["path"]: "missing"}


@pytest.mark.model
def test_damaged_shards_are_given_up_and_the_rerun_captures_exactly_their_rows(tmp_path, reader_run):
    run = tmp_path / "run"
    shutil.copytree(reader_run, run)
    before = manifest.read(run)
    assert len(before.shards) >= 4 and before.complete
    victims = [before.shards[0], before.shards[len(before.shards) // 2], before.shards[-1]]
    reasons = damage(run, victims)
    lost_ids = {sid for s in victims for sid in s["sample_ids"]}

    stuck = capture_cli("run", *READER_RUN, "--out", str(run))
    assert stuck.returncode == 2 and "give them up with `capture shards repair" in stuck.stderr

    manifest_bytes = (run / MANIFEST).read_bytes()
    dry = capture_cli("shards", "repair", str(run), "--dry-run", check=True)
    assert f"3 of {len(before.shards)} shard(s), {sum(s['rows'] for s in victims)} row(s) would be given up" in dry.stdout
    assert (run / MANIFEST).read_bytes() == manifest_bytes

    done = capture_cli("shards", "repair", str(run), check=True)
    assert f"3 of {len(before.shards)} shard(s) given up" in done.stdout
    repaired = manifest.read(run)
    assert set(repaired.lost) == set(reasons)
    for path, word in reasons.items():
        assert word in repaired.lost[path]["lost_reason"] and not (run / path).exists()
    assert repaired.sample_ids() == before.sample_ids() - lost_ids
    assert len(repaired.all_shards) == len(before.shards) - 3  # history: the shard lines are still in the file
    assert sum(json.loads(x)["kind"] == "shard" for x in (run / MANIFEST).read_text().splitlines()) == len(before.shards)
    report = verify(run)
    assert report.ok and report.lost_shards == 3 and report.rows == before.rows - len(lost_ids)
    assert "nothing to repair" in capture_cli("shards", "repair", str(run), check=True).stdout

    s = json.loads(capture_cli("run", *READER_RUN, "--out", str(run), "--json", check=True).stdout)
    assert s["already_committed"] == before.rows - len(lost_ids) and s["committed_rows"] == len(lost_ids)
    after = manifest.read(run)
    new = [sid for sh in after.shards if sh["path"] not in {x["path"] for x in before.shards} for sid in sh["sample_ids"]]
    assert sorted(new) == sorted(lost_ids)  # exactly their rows, once each
    assert after.sample_ids() == before.sample_ids() and after.rows == before.rows and after.complete
    original = {r["sample_id"]: r for r in iter_rows(reader_run)}
    for row in iter_rows(run):
        assert np.array_equal(row["input_ids"], original[row["sample_id"]]["input_ids"])
        assert np.array_equal(row["loss_mask"], original[row["sample_id"]]["loss_mask"])
    assert verify(run).ok


def test_repair_on_an_object_store_run(tmp_path):
    run = resolve(f"{OBJSTORE_SCHEME}{tmp_path}/obj")
    write_run(run, [make_rows(0, 4), make_rows(1, 4, start=4), make_rows(2, 4, start=8)], target_bytes=1)
    before = manifest.read(run)
    assert len(before.shards) >= 3
    reasons = damage(tmp_path / "obj", before.shards[:3])
    assert not verify(run).ok
    r = repair(run)
    assert set(r.lost) == set(reasons) and r.rows == sum(s["rows"] for s in before.shards[:3])
    entries = sorted(p.name for p in (tmp_path / "obj" / MANIFEST_DIR).iterdir())
    assert entries[-1].endswith("-lost.json")
    after = manifest.read(run)
    assert set(after.lost) == set(reasons) and after.rows == before.rows - r.rows
    assert verify(run).ok and not after.complete  # a resume will capture the rows again
