"""The files a live run's readers and the capture exchange in the run folder: acks and the online endpoint.

A capture that waits on its readers learns what they consumed from their **acks**, one format for both
ways of waiting:

* tail mode (``capture run --retain N``, :mod:`shards.retain`): a :class:`shards.stream.ShardStream` rank
  acks the committed shards none of whose rows it still has to read (``shards``, with the stream's
  ``epoch`` and ``position``); the capture removes the shards every rank acked. A rank's latest ack
  supersedes its older ones (the writer deletes them once the new one is written).
* online (:mod:`capture.online`, :class:`shards.online.OnlineStream`): a rank acks the ``sample_ids`` it
  trained on since its previous ack; a restarted capture skips the union of every ack's ids.

Each ack is one file ``ack-<rank:05d>-<time_ns:016x>.json`` (an atomic whole-file write,
:meth:`shards.run.Location.write_bytes`, on a local folder or an object store) holding :class:`Ack` as
JSON. Trainers ack *after* the checkpoint that holds the same position is durable, so a restart from that
checkpoint never needs an acked row again (exactly once).

The **endpoint** ``online-endpoint.json`` says where an online run's per-rank Ray queues are: ``{"address",
"namespace", "queues", "world_size", "auth_mode"}`` (Ray's ``RAY_AUTH_MODE`` of the capture's process; the
token itself is never written).

Acks written before this module (``consumed-<rank>.json``, tail; ``online-consumed-<rank>-*.json``,
online) are read as the same :class:`Ack`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from typing import Literal

from shards.run import Location, plain_name

log = logging.getLogger(__name__)

PREFIX, SUFFIX = "ack-", ".json"
ENDPOINT = "online-endpoint.json"
_LEGACY = ("consumed-", "online-consumed-")  # tail and online acks of runs made before one format
Kind = Literal["tail", "online"]


@dataclasses.dataclass(frozen=True)
class Ack:
    """What reader rank ``rank`` of ``world_size`` consumed, as of ``time`` (seconds since the epoch).
    ``kind="tail"``: ``shards`` (manifest paths) none of whose rows the rank still reads from ``position``
    (rank-local sample index) of ``epoch`` on. ``kind="online"``: ``sample_ids`` trained on since the
    rank's previous ack."""

    kind: Kind
    rank: int
    world_size: int
    time: float
    shards: tuple[str, ...] = ()
    sample_ids: tuple[str, ...] = ()
    epoch: int = 0
    position: int = 0


def write(loc: Location, ack: Ack) -> str:
    """Write ``ack`` atomically; returns its file name. A tail ack then deletes the rank's older acks
    (the new one supersedes them). Raises OSError from the store (a full disk: the older acks stay)."""
    name = f"{PREFIX}{ack.rank:05d}-{time.time_ns():016x}{SUFFIX}"
    loc.write_bytes(name, json.dumps(dataclasses.asdict(ack), sort_keys=True).encode())
    if ack.kind == "tail":
        for old in _names(loc):
            mine = old.startswith(f"{PREFIX}{ack.rank:05d}-") or old == f"consumed-{ack.rank:05d}.json"
            if mine and old != name:
                loc.delete(old)
    return name


def read(loc: Location, kind: Kind) -> list[Ack]:
    """Every readable ack of ``kind`` in the run, oldest first. A file that cannot be read (a store without
    atomic writes, mid-write; a rank's superseded ack deleted while listing) is skipped with a warning and
    read again at the next call."""
    acks = []
    for name in _names(loc):
        try:
            ack = _parse(name, json.loads(loc.read_bytes(name)))
        except (ValueError, KeyError, TypeError, FileNotFoundError) as e:
            log.warning("%s: unreadable ack %s (%s); ignored until it is rewritten", loc.path, name, e)
            continue
        if ack.kind == kind:
            acks.append(ack)
    return sorted(acks, key=lambda a: a.time)


def latest(loc: Location) -> dict[int, Ack]:
    """Each tail reader rank's latest ack, by rank."""
    return {a.rank: a for a in read(loc, "tail")}


def acked_ids(loc: Location) -> set[str]:
    """Every sample id an online reader rank acked in the run."""
    return {sid for a in read(loc, "online") for sid in a.sample_ids}


def any_acks(loc: Location) -> bool:
    """Whether any reader acked anything in the run (a folder with acks is not an empty run)."""
    return bool(_names(loc))


def write_endpoint(loc: Location, endpoint: dict) -> None:
    """Publish an online run's endpoint (module docstring). Raises OSError from the store."""
    loc.write_bytes(ENDPOINT, json.dumps(endpoint).encode())


def read_endpoint(loc: Location) -> dict | None:
    """The run's online endpoint, or None when no online capture has published one."""
    return json.loads(loc.read_bytes(ENDPOINT)) if loc.exists(ENDPOINT) else None


def _names(loc: Location) -> list[str]:
    return [n for n in loc.names() if n.endswith(SUFFIX) and n.startswith((PREFIX, *_LEGACY))]


def _parse(name: str, body: dict) -> Ack:
    """The Ack in file ``name``. Raises ValueError for shard names that are not plain file names in the run
    (a crafted ack must not name a file elsewhere), KeyError/TypeError for a body of another shape."""
    if name.startswith(PREFIX):
        ack = Ack(**{**body, "shards": tuple(body["shards"]), "sample_ids": tuple(body["sample_ids"])})
    elif name.startswith("online-consumed-"):  # {"rank", "time", "sample_ids"}
        ack = Ack("online", int(body["rank"]), 0, float(body["time"]), sample_ids=tuple(body["sample_ids"]))
    else:  # consumed-<rank>.json
        ack = Ack("tail", int(body["rank"]), int(body["world_size"]), float(body["time"]),
                  shards=tuple(body["done"]), epoch=int(body["epoch"]), position=int(body["position"]))
    if not all(map(plain_name, ack.shards)):
        raise ValueError(f"shard names {list(ack.shards)[:3]} are not plain file names inside the run")
    return ack
