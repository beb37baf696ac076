"""shards.live: one ack format for tail and online readers, the endpoint, and acks of older runs read alike."""

from __future__ import annotations

import json

from shards import live
from shards.run import as_location


def test_a_tail_ack_supersedes_the_rank_s_older_ones_and_online_acks_add_up(tmp_path):
    loc = as_location(tmp_path)
    assert not live.any_acks(loc) and live.latest(loc) == {} and live.acked_ids(loc) == set()
    first = live.Ack("tail", 0, 2, 1.0, shards=("shard-a.arrow",), epoch=0, position=3)
    second = live.Ack("tail", 0, 2, 2.0, shards=("shard-a.arrow", "shard-b.arrow"), epoch=0, position=7)
    other = live.Ack("tail", 1, 2, 1.5, shards=(), position=1)
    names = [live.write(loc, a) for a in (first, other, second)]
    assert sorted(n for n in loc.names() if n.startswith(live.PREFIX)) == sorted(names[1:])  # rank 0's first is gone
    assert live.latest(loc) == {0: second, 1: other}
    live.write(loc, live.Ack("online", 0, 2, 3.0, sample_ids=("d:1", "d:2")))
    live.write(loc, live.Ack("online", 0, 2, 4.0, sample_ids=("d:3",)))  # online acks are never superseded
    assert live.acked_ids(loc) == {"d:1", "d:2", "d:3"}
    assert live.latest(loc) == {0: second, 1: other}  # kinds do not mix
    assert live.any_acks(loc)


def test_acks_of_older_runs_are_read_and_superseded(tmp_path):
    (tmp_path / "consumed-00000.json").write_text(json.dumps(
        {"rank": 0, "world_size": 1, "epoch": 1, "position": 5, "done": ["shard-x.arrow"], "time": 9.0}))
    (tmp_path / "online-consumed-00001-00000000-1a.json").write_text(json.dumps(
        {"rank": 1, "time": 8.0, "sample_ids": ["d:7"]}))
    (tmp_path / "ack-00000-broken.json").write_text("{")  # torn: skipped with a warning
    loc = as_location(tmp_path)
    assert live.latest(loc) == {0: live.Ack("tail", 0, 1, 9.0, shards=("shard-x.arrow",), epoch=1, position=5)}
    assert live.acked_ids(loc) == {"d:7"}
    live.write(loc, live.Ack("tail", 0, 1, 10.0, shards=(), epoch=1, position=6))
    assert not (tmp_path / "consumed-00000.json").exists()
    assert live.latest(loc)[0].position == 6


def test_endpoint_round_trip(tmp_path):
    loc = as_location(tmp_path)
    assert live.read_endpoint(loc) is None
    endpoint = {"address": "10.0.0.1:6379", "namespace": "n", "queues": ["q0"], "world_size": 1, "auth_mode": None}
    live.write_endpoint(loc, endpoint)
    assert live.read_endpoint(loc) == endpoint and (tmp_path / live.ENDPOINT).is_file()
