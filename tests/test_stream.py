"""shards.stream (ShardStream), shards.hf.hf_dataset's split and shards.pack on a real run (SmolLM2 over
ShareGPT rows, the session fixture ``reader_run``): contract and bit-exact states, ranks x workers,
shuffle, resume, persistent DataLoader workers (fork and spawn), split, tail mode against a writer
thread, pyarrow file systems, packing."""

from __future__ import annotations

import hashlib
import json
import pickle
import threading
import time

import pyarrow.fs as pafs
import pytest
import torch
from helpers import bits, real_rows
from torch.utils.data import DataLoader

from common.errors import CaptureError
from shards import format as shard_format
from shards import manifest as manifest_mod
from shards import run as run_mod
from shards.manifest import ManifestWriter
from shards.pack import pack
from shards.reader import read_table, shard_paths
from shards.rows import state_tensor
from shards.run import Location
from shards.hf import hf_dataset
from shards.stream import ShardStream, heldout_score
from shards.writer import ShardWriter


def token_hash(ids: torch.Tensor) -> str:
    return hashlib.sha256(ids.to(torch.int32).numpy().astype("<i4").tobytes()).hexdigest()


def committed(run) -> dict[str, str]:
    m = manifest_mod.read(run)
    return {s: h for shard in m.shards for s, h in zip(shard["sample_ids"], shard["token_sha256"])}


def test_sample_contract_and_states_bit_exact(reader_run):
    stream = ShardStream(reader_run)
    assert stream.taps_layers == (3, 15, 27) and stream.final_kind == "post-norm"
    samples = list(stream)
    assert [s["sample_id"] for s in samples] == list(committed(reader_run))  # manifest order
    assert len(samples) == len(stream) >= 30
    tables = {}
    for path in shard_paths(reader_run):
        t = read_table(path)
        for i, sid in enumerate(t.column("sample_id").to_pylist()):
            tables[sid] = (t, i)
    for s in samples:
        assert set(s) == {"sample_id", "source", "input_ids", "loss_mask", "argmax", "taps", "final"}
        t, i = tables[s["sample_id"]]
        n = t.column("num_tokens")[i].as_py()
        assert s["source"] == "sharegpt"
        assert s["input_ids"].dtype == torch.int64 and s["input_ids"].shape == (n,)
        assert s["loss_mask"].dtype == torch.bool and int(s["loss_mask"].sum()) == t.column("num_loss_tokens")[i].as_py()
        assert s["argmax"].dtype == torch.int64 and s["argmax"].tolist() == t.column("argmax")[i].as_py()
        assert s["input_ids"].tolist() == t.column("input_ids")[i].as_py()
        assert token_hash(s["input_ids"]) == t.column("token_sha256")[i].as_py()
        assert s["taps"].dtype == torch.bfloat16 and s["taps"].shape == (n, 3, 576)
        for j, k in enumerate((3, 15, 27)):
            assert torch.equal(bits(s["taps"][:, j]), bits(state_tensor(t, f"tap_{k}", i)))
        assert s["final"].dtype == torch.bfloat16 and torch.equal(bits(s["final"]), bits(state_tensor(t, "final", i)))
    # a subset of taps, no final
    few = next(iter(ShardStream(reader_run, layers=[27, 3], final=False)))
    assert "final" not in few and torch.equal(bits(few["taps"]), bits(samples[0]["taps"][:, [2, 0]]))


@pytest.mark.parametrize("drop_last", [False, True])
def test_two_ranks_two_workers_cover_every_sample_once(reader_run, drop_last):
    truth = committed(reader_run)
    seen, sizes = [], []
    for rank in range(2):
        stream = ShardStream(reader_run, shuffle=True, seed=7, shuffle_buffer=6, rank=rank, world_size=2,
                             drop_last=drop_last)
        got = list(DataLoader(stream, batch_size=None, num_workers=2))
        assert [s["sample_id"] for s in got] == stream.order()  # the DataLoader keeps the rank-local order
        assert len(got) == len(stream)
        sizes.append(len(got))
        seen += [(s["sample_id"], token_hash(s["input_ids"])) for s in got]
    ids = [s for s, _ in seen]
    assert len(ids) == len(set(ids))  # no duplicates
    assert all(truth[s] == h for s, h in seen)  # each id came with its own tokens
    if drop_last:
        assert sizes[0] == sizes[1] and len(truth) - len(ids) == len(truth) % 2
    else:
        assert set(ids) == set(truth) and abs(sizes[0] - sizes[1]) <= 1  # no drops
    assert ids != list(truth)  # shuffled


def test_shuffle_is_seeded_and_changes_per_epoch(reader_run):
    a, b = ShardStream(reader_run, shuffle=True, seed=3), ShardStream(reader_run, shuffle=True, seed=3)
    assert a.order() == b.order() == [s["sample_id"] for s in a]
    assert a.order(1) != a.order(0) and sorted(a.order(1)) == sorted(a.order(0))
    assert ShardStream(reader_run, shuffle=True, seed=4).order() != a.order()
    a.set_epoch(1)
    assert [s["sample_id"] for s in a] == b.order(1)


def test_resume_reproduces_the_rest_of_the_epoch(reader_run):
    kw = dict(shuffle=True, seed=11, shuffle_buffer=8, rank=1, world_size=2)
    full = ShardStream(reader_run, **kw)
    full.set_epoch(2)
    expected = [(s["sample_id"], token_hash(s["input_ids"])) for s in full]

    first = ShardStream(reader_run, **kw)  # in-process: the stream counts what it yielded
    first.set_epoch(2)
    it = iter(first)
    head = [next(it)["sample_id"] for _ in range(5)]
    state = json.loads(json.dumps(first.state_dict()))  # survives a checkpoint file
    assert state["epoch"] == 2 and state["position"] == 5
    again = ShardStream(reader_run, **kw)
    again.load_state_dict(state)
    again.set_epoch(2)  # the loaded epoch keeps its position (a training loop calls set_epoch every epoch)
    rest = [(s["sample_id"], token_hash(s["input_ids"])) for s in again]
    assert head == [s for s, _ in expected[:5]] and rest == expected[5:]

    # behind DataLoader workers the trainer counts; resume with another number of workers
    loader_stream = ShardStream(reader_run, **kw)
    loader_stream.set_epoch(2)
    it = iter(DataLoader(loader_stream, batch_size=None, num_workers=1))
    taken = [next(it)["sample_id"] for _ in range(7)]
    del it
    state = loader_stream.state_dict(consumed=len(taken))
    resumed = ShardStream(reader_run, **kw)
    resumed.load_state_dict(state)
    rest = [s["sample_id"] for s in DataLoader(resumed, batch_size=None, num_workers=2)]  # resumes at an odd position
    assert taken + rest == [s for s, _ in expected]

    with pytest.raises(CaptureError, match="seed"):
        ShardStream(reader_run, **{**kw, "seed": 12}).load_state_dict(state)



@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_persistent_workers_follow_set_epoch_and_resume(reader_run, context):
    """One DataLoader with persistent workers for every epoch: set_epoch and load_state_dict, called in the
    main process before iter(loader), reach the running workers (epoch, position: shared memory)."""
    kw = dict(shuffle=True, seed=5, shuffle_buffer=6, layers=[3], final=False)
    stream = ShardStream(reader_run, **kw)
    loader = DataLoader(stream, batch_size=None, num_workers=2, persistent_workers=True,
                        multiprocessing_context=context)
    orders, pids = [], set()
    for epoch in range(3):
        stream.set_epoch(epoch)
        orders.append([s["sample_id"] for s in loader])
        assert orders[-1] == stream.order(epoch)
        pids.add(tuple(w.pid for w in loader._iterator._workers))
    assert len(pids) == 1  # the same two worker processes served every epoch
    assert orders[0] != orders[1] and orders[1] != orders[2] and orders[0] != orders[2]

    # resume mid-epoch: a state saved by another stream (7 samples into epoch 4), loaded into this one
    # while its workers are running, gives exactly the rest; the next epoch starts at its beginning
    other = ShardStream(reader_run, **kw)
    other.set_epoch(4)
    it = iter(other)
    head = [next(it)["sample_id"] for _ in range(7)]
    stream.load_state_dict(json.loads(json.dumps(other.state_dict())))
    rest = [s["sample_id"] for s in loader]
    assert head + rest == stream.order(4) and len(rest) == len(stream) - 7
    stream.set_epoch(5)
    assert [s["sample_id"] for s in loader] == stream.order(5)
    assert len({tuple(w.pid for w in loader._iterator._workers)} | pids) == 1

    # a pickled copy reads the same order but keeps its own epoch and position
    copy = pickle.loads(pickle.dumps(stream))
    assert (copy.epoch, copy.position, copy.order()) == (5, 0, stream.order())
    copy.set_epoch(6)
    assert stream.epoch == 5 and [s["sample_id"] for s in copy] == stream.order(6)


def test_split_by_sample_id_hash_is_stable_and_disjoint(reader_run):
    assert heldout_score("sharegpt:0") == int(hashlib.sha256(b"sharegpt:0").hexdigest()[:16], 16) / 2**64
    ids = [f"d:{i}" for i in range(20_000)]
    assert abs(sum(heldout_score(s) < 0.1 for s in ids) / len(ids) - 0.1) < 0.01
    held = ShardStream(reader_run, split="heldout", heldout_fraction=0.3).order()
    train = ShardStream(reader_run, split="train", heldout_fraction=0.3).order()
    assert held == ShardStream(reader_run, split="heldout", heldout_fraction=0.3).order()
    assert not set(held) & set(train) and set(held) | set(train) == set(committed(reader_run))
    assert 0.1 < len(held) / (len(held) + len(train)) < 0.55
    assert all(heldout_score(s) < 0.3 for s in held)
    # the HF datasets adapter filters the same way
    ds = hf_dataset(reader_run, split="heldout", heldout_fraction=0.3)
    assert ds["sample_id"] == held and "tap_3" not in ds.column_names
    assert ds[0]["input_ids"] == next(iter(ShardStream(reader_run, split="heldout", heldout_fraction=0.3)))["input_ids"].tolist()


def test_pack_conserves_tokens_and_never_splits_a_sample(reader_run):
    samples = list(ShardStream(reader_run))
    longest = max(len(s["input_ids"]) for s in samples)
    budget = 600
    batches = list(pack(samples, budget))
    flat = [sid for b in batches for sid in b["sample_ids"]]
    assert flat == [s["sample_id"] for s in samples]
    by_id = {s["sample_id"]: s for s in samples}
    for b in batches:
        n = int(b["cu_seqlens"][-1])
        assert b["cu_seqlens"].dtype == torch.int32 and b["cu_seqlens"][0] == 0
        assert n <= budget or len(b["sample_ids"]) == 1
        assert b["input_ids"].shape == (n,) and b["taps"].shape == (n, 3, 576) and b["final"].shape == (n, 576)
        for j, sid in enumerate(b["sample_ids"]):
            lo, hi = int(b["cu_seqlens"][j]), int(b["cu_seqlens"][j + 1])
            s = by_id[sid]
            assert torch.equal(b["input_ids"][lo:hi], s["input_ids"])
            assert torch.equal(b["loss_mask"][lo:hi], s["loss_mask"])  # no pad, no neighbour in the loss
            assert torch.equal(b["argmax"][lo:hi], s["argmax"])
            assert torch.equal(bits(b["taps"][lo:hi]), bits(s["taps"]))
            assert torch.equal(b["position_ids"][lo:hi], torch.arange(hi - lo))
    assert sum(int(b["cu_seqlens"][-1]) for b in batches) == sum(len(s["input_ids"]) for s in samples)
    assert sum(int(b["loss_mask"].sum()) for b in batches) == sum(int(s["loss_mask"].sum()) for s in samples)

    small = longest - 10  # oversize samples: alone (default), truncated, or refused
    alone = [b for b in pack(samples, small) if int(b["cu_seqlens"][-1]) > small]
    assert alone and all(len(b["sample_ids"]) == 1 for b in alone)
    cut = list(pack(samples, small, oversize="truncate"))
    assert all(int(b["cu_seqlens"][-1]) <= small for b in cut)
    assert [sid for b in cut for sid in b["sample_ids"]] == flat
    with pytest.raises(CaptureError, match="over the budget"):
        list(pack(samples, small, oversize="error"))


def test_tail_follows_a_writer_and_stops_at_completion(reader_run, tmp_path):
    header = manifest_mod.read(reader_run).header
    rows = real_rows(reader_run)[:24]
    live = tmp_path / "live"
    errors = []

    def writer():  # the running capture: a shard every 0.3 s, a torn line, then the completion record
        try:
            mw, _ = ManifestWriter.open(live, header)
            sw = ShardWriter(live, shard_format.schema(header), target_bytes=1 << 40)
            for i in range(0, len(rows), 6):
                time.sleep(0.3)
                sw.write(rows[i:i + 6])
                [info] = sw.close()
                mw.commit(info)
            with open(live / run_mod.MANIFEST, "ab") as f:
                f.write(b'{"kind": "complete"')  # torn: not committed, no stop yet
            time.sleep(0.5)
            with open(live / run_mod.MANIFEST, "ab") as f:
                f.truncate(manifest_mod.read(live).committed_bytes)
            mw.complete({"rows": len(rows)})
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        stream = ShardStream(live, tail=True, poll_s=0.05, timeout_s=20)
        got = [s["sample_id"] for s in stream]
    finally:
        thread.join()
    assert not errors
    assert got == [r.sample_id for r in rows]
    assert manifest_mod.read(live).complete

    # two ranks in tail mode split the same growing order
    both = [ShardStream(live, tail=True, rank=r, world_size=2, poll_s=0.05).order() for r in range(2)]
    assert sorted(both[0] + both[1]) == sorted(got) and both[0] == got[0::2]

    # a run that never completes: the timeout ends the read with an error
    stalled = tmp_path / "stalled"
    mw, _ = ManifestWriter.open(stalled, header)
    sw = ShardWriter(stalled, shard_format.schema(header), target_bytes=1 << 40)
    sw.write(rows[:3])
    mw.commit(sw.close()[0])
    seen = []
    with pytest.raises(CaptureError, match="no new shard committed"):
        for s in ShardStream(stalled, tail=True, poll_s=0.05, timeout_s=0.5):
            seen.append(s["sample_id"])
    assert seen == [r.sample_id for r in rows[:3]]


def test_reads_through_a_pyarrow_filesystem(reader_run):
    fs = pafs.SubTreeFileSystem(str(reader_run.parent), pafs.LocalFileSystem())
    remote = list(ShardStream(Location(fs, reader_run.name), shuffle=True, seed=2))
    local = list(ShardStream(reader_run, shuffle=True, seed=2))
    assert [s["sample_id"] for s in remote] == [s["sample_id"] for s in local]
    for a, b in zip(remote, local):
        assert torch.equal(bits(a["taps"]), bits(b["taps"])) and torch.equal(a["input_ids"], b["input_ids"])


def test_bad_input_is_one_clear_error(reader_run, tmp_path):
    with pytest.raises(CaptureError, match="unknown split"):
        ShardStream(reader_run, split="val")
    with pytest.raises(CaptureError, match="rank 2"):
        ShardStream(reader_run, rank=2, world_size=2)
    with pytest.raises(CaptureError, match=r"no tap\(s\) \[4\]"):
        ShardStream(reader_run, layers=[4])
    with pytest.raises(CaptureError, match="holds no capture run"):
        ShardStream(tmp_path)
    with pytest.raises(CaptureError, match="drop_last"):
        ShardStream(reader_run, tail=True, drop_last=True)
    with pytest.raises(CaptureError, match="heldout_fraction"):
        ShardStream(reader_run, heldout_fraction=1.5)
