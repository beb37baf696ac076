"""Tail mode with bounded disk (shards.retain, ``capture run --retain N``, ShardStream.ack): which shards a
rank is done with (against the rows it actually reads), and a real capture that two reader ranks follow
and ack while it deletes what they consumed, with a reader restarted from its acked state."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest
from helpers import make_rows, write_run

from common.errors import CaptureError
from conftest import REPO
from shards import live
from shards import manifest as manifest_mod
from shards import retain
from shards.manifest import ManifestWriter
from shards.stream import ShardStream
from shards.verify import verify


def shard_of(run) -> dict[str, str]:
    return {sid: s["path"] for s in manifest_mod.read(run).all_shards for sid in s["sample_ids"]}


def rest_of(stream: ShardStream, position: int) -> list[str]:
    """What ``stream`` yields from rank-local ``position`` on (a restored reader)."""
    stream.load_state_dict({**stream.state_dict(), "position": position})
    return [s["sample_id"] for s in stream]


@pytest.mark.parametrize("shuffle", [False, True])
def test_done_is_exactly_the_shards_a_rank_no_longer_reads(tmp_path, shuffle):
    run = tmp_path / "run"
    write_run(run, [make_rows(0, 7, 7 * i) for i in range(6)], target_bytes=1)  # ~one shard per write batch
    owner = shard_of(run)
    assert len(set(owner.values())) >= 6
    for rank in range(2):
        stream = ShardStream(run, tail=True, rank=rank, world_size=2, shuffle=shuffle, shuffle_buffer=5, poll_s=0.01)
        order = stream.order()
        for position in range(0, len(order) + 1, 3):
            done = set(stream.done(0, position))
            still = {owner[sid] for sid in rest_of(stream, position)}
            assert done == {s["path"] for s in manifest_mod.read(run).shards} - still, (rank, position)


def test_done_never_names_a_shard_whose_rows_the_shuffle_buffer_holds(tmp_path):
    """On a run still being written, rows wait in the shuffle buffer for later input: their shards are not
    done, although none of them has been read; once the run grows and completes, nothing acked comes back."""
    run = tmp_path / "run"
    batches = [make_rows(1, 2, 2 * i) for i in range(16)]  # shards of 2 rows
    write_run(run, batches[:8], target_bytes=1, complete=False)
    owner = shard_of(run)
    stream = ShardStream(run, tail=True, shuffle=True, shuffle_buffer=4, seed=3, poll_s=0.01)
    position = 12  # all 16 - 4 rows the buffer has let out
    done = set(stream.done(0, position))
    held = {owner[sid] for sid in owner} - done  # shards with a row still in the buffer
    assert done and held
    write_run(run, batches[8:], target_bytes=1)  # the capture goes on and completes
    later = rest_of(ShardStream(run, tail=True, shuffle=True, shuffle_buffer=4, seed=3, poll_s=0.01), position)
    assert {owner[sid] for sid in later if sid in owner} == held  # the held rows came later; no done shard did


def test_removable_needs_every_rank_of_one_world_size(tmp_path):
    run = tmp_path / "run"
    write_run(run, [make_rows(2, 4, 4 * i) for i in range(3)], target_bytes=1)
    m = manifest_mod.read(run)
    a, b, c = [s["path"] for s in m.shards[:3]]
    ack = lambda r, w, done: live.Ack("tail", r, w, 0.0, shards=tuple(done))  # noqa: E731
    assert retain.removable(m, {0: ack(0, 2, [a, b])}) == []  # rank 1 has not acked
    assert retain.removable(m, {0: ack(0, 2, [a, b]), 1: ack(1, 2, [b, c])}) == [b]
    assert retain.removable(m, {0: ack(0, 2, [a, b]), 1: ack(1, 3, [a, b])}) == []  # two world sizes
    assert "rank(s) [1]" in retain.waiting_for({0: ack(0, 2, [a])})


def test_removed_shards_count_but_are_not_read(tmp_path):
    run = tmp_path / "run"
    infos = write_run(run, [make_rows(3, 5, 5 * i) for i in range(3)], target_bytes=1, complete=False)
    writer, _ = ManifestWriter.open(run, manifest_mod.read(run).header)
    writer.removed([infos[0].path], "consumed (test)")
    os.remove(run / infos[0].path)
    m = manifest_mod.read(run)
    assert list(m.removed) == [infos[0].path] and len(m.shards) == len(infos) - 1
    assert m.rows == sum(i.rows for i in infos)  # still committed: a resume skips them
    assert set(infos[0].sample_ids) <= m.sample_ids()
    report = verify(run)
    assert report.ok and report.removed_shards == 1 and report.removed_rows == infos[0].rows
    assert report.shards == len(infos) - 1 and not report.garbage
    offline = [s["sample_id"] for s in ShardStream(run)]
    assert offline == [sid for i in infos[1:] for sid in i.sample_ids]
    with pytest.raises(CaptureError, match="removed after every reader rank acked it"):
        list(ShardStream(run, tail=True, timeout_s=0.2, poll_s=0.05))
    with pytest.raises(CaptureError, match="tail-mode"):
        ShardStream(run).ack()


def test_capture_with_retain_follows_its_readers(tmp_path, smol_dir):
    """A real capture (SmolLM2, 24 ShareGPT rows, a shard per few rows) with --retain 2, read in tail mode
    by two ranks that ack after every sample. Rank 1 stops half-way, its state saved and acked, and a new
    rank-1 stream restored from that state reads on. Every row is read exactly once; the manifest never
    holds more than 2 live shards; removed files are gone; verify counts them."""
    out = tmp_path / "run"
    args = [sys.executable, "-m", "cli", "run", "--out", str(out), "--dataset", "sharegpt", "--layers", "3,15",
            "--limit", "24", "--max-tokens", "256", "--overlength", "truncate", "--shard-size", "256KiB",
            "--unit-tokens", "1024", "--first-unit-tokens", "512", "--retain", "2", "--json", "--no-progress"]
    capture = subprocess.Popen(args, cwd=REPO, env={**os.environ, "TQDM_DISABLE": "1"}, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    got: dict[int, list[str]] = {0: [], 1: []}
    errors = []

    def read(rank: int, stop_after: int | None = None):
        try:
            stream = ShardStream(out, tail=True, rank=rank, world_size=2, poll_s=0.1, timeout_s=300)
            for n, s in enumerate(stream, 1):
                got[rank].append(s["sample_id"])
                stream.ack()  # a checkpoint after every sample
                if n == stop_after:
                    break
            if stop_after is not None:  # the trainer restarts from its checkpoint
                state = stream.state_dict()
                again = ShardStream(out, tail=True, rank=rank, world_size=2, poll_s=0.1, timeout_s=300)
                again.load_state_dict(state)
                for s in again:
                    got[rank].append(s["sample_id"])
                    again.ack()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    readers = [threading.Thread(target=read, args=(0,)), threading.Thread(target=read, args=(1, 4))]
    for t in readers:
        t.start()
    try:
        stdout, stderr = capture.communicate(timeout=600)
    finally:
        for t in readers:
            t.join(timeout=120)
    assert capture.returncode == 0, stderr[-3000:]
    assert not errors, errors
    summary = json.loads(stdout)
    m = manifest_mod.read(out)
    ids = [sid for s in m.all_shards for sid in s["sample_ids"]]
    assert len(ids) == summary["total_rows"] >= 12
    assert sorted(got[0] + got[1]) == sorted(ids) and len(set(got[0] + got[1])) == len(ids)  # exactly once
    assert got[0] == ids[0::2] and got[1] == ids[1::2]  # each rank's order, across the restart
    live, peak = set(), 0
    lines = [json.loads(x) for x in (out / "manifest.jsonl").read_text().splitlines()]
    for line in lines:  # replay the commit log: the bound holds at every commit
        if line["kind"] == "shard":
            live.add(line["path"])
        elif line["kind"] == "removed":
            live -= set(line["paths"])
        peak = max(peak, len(live))
    assert peak <= 2 and m.removed and len(m.all_shards) >= 4
    assert not [p for p in m.removed if (out / p).exists()]
    r = summary["retained"]
    assert r["limit"] == 2 and r["peak_live"] == peak and r["removed_shards"] == len(m.removed)
    report = verify(out)
    assert report.ok and report.complete and report.removed_shards == len(m.removed)
    assert report.rows + report.removed_rows == len(ids)
