"""Stream a run's committed rows into training: a torch ``IterableDataset`` over the shards.

Per sample (the contract a drafter trainer relies on)::

    {"sample_id": str, "source": str,
     "input_ids": int64 [T], "loss_mask": bool [T],
     "argmax": int64 [T]            (if the run stored it),
     "taps": bf16 [T, L, H]         (the tap_<k> columns stacked in header order; ids in ShardStream.taps_layers),
     "final": bf16 [T, H]           (if the run stored it; ShardStream.final_kind says post-norm or pre-norm),
     "topk_ids": int64 [T, K]       (if the run stored top-K, ``--topk K``; ShardStream.topk says K),
     "topk_logprobs": float32 [T, K] (same rows: log-probabilities over the full vocabulary, descending)}

``topk_ids[t]`` / ``topk_logprobs[t]`` are the target's K most likely tokens t+1 at position t (the
convention of ``argmax``: ``topk_ids[t, 0] == argmax[t]``) with ``logit - logsumexp(all logits)`` in
float32; ``exp(topk_logprobs)`` are probabilities, ``1 - exp(topk_logprobs).sum(-1)`` the tail mass
outside the top K (see :mod:`shards.topk`).

States keep the run's dtype (bf16; fp16 for engines that give fp16): each cell is decoded in the cell
layout of its shard's header (:class:`shards.format.CellLayout`) straight from the Arrow buffer, never
widened to float32, by the one sample decoder every reader of this contract shares
(:func:`shards.rows.decode_sample`: this stream, :class:`shards.online.OnlineStream`, the HF ``datasets``
transform, export, Ray Data).
``taps[:, i]`` is tap ``taps_layers[i]``, the output of 0-based decoder layer ``taps_layers[i]`` (HF
``hidden_states[k+1]``, vLLM aux id ``k+1``; see docs/conventions.md).

**Global order.** Each epoch has one deterministic order of ``(shard, row)`` entries, the same on every
machine: the manifest's committed shards (snapshot taken at construction), in commit order or, with
``shuffle=True``, permuted by ``(seed, epoch)``; each shard's rows in stored order; rows outside the
``split`` removed; then, with ``shuffle=True``, a seeded shuffle buffer of ``shuffle_buffer`` entries
(a row comes out at most that many places early, and rarely much later, so a reader keeps only a few
shards open).

**Ranks and workers.** Entry ``g`` of the global order belongs to rank ``g % world_size`` as its
rank-local position ``j = g // world_size``; DataLoader worker ``(j - position) % num_workers`` of that rank reads
it (counting from the resume position). Every entry is read exactly once per epoch. When the entries do not divide evenly, the first
``n % world_size`` ranks get one more sample (nothing is dropped); ``drop_last=True`` instead cuts the
order to a multiple of ``world_size`` (dropping at most ``world_size - 1`` entries of the epoch's order).
A ``DataLoader(stream, batch_size=None, num_workers=W)`` hands samples out in rank-local order (it takes
one item from each worker in turn); pack them in the main process with :func:`shards.pack.pack`.

**Resume.** :meth:`ShardStream.state_dict` records ``epoch`` and ``position``, the number of this
rank's samples consumed in the epoch; after :meth:`ShardStream.load_state_dict` the stream yields
exactly the rest of the epoch, in the same order, for any number of workers. Iterated in the calling
process, the stream counts what it yielded; behind DataLoader workers, the trainer passes the count
(``state_dict(consumed=n)``, e.g. the sum of ``len(batch["sample_ids"])`` since the epoch or resume
began). Call :meth:`ShardStream.set_epoch` at the start of each epoch (a new epoch starts at position 0;
the loaded epoch keeps its position).

**Persistent workers.** ``DataLoader(stream, ..., persistent_workers=True)`` works: one loader for the
whole run, ``set_epoch`` / ``load_state_dict`` called in the main process before each ``iter(loader)``.
Such workers copy the dataset once, when they start, so a plain attribute set later in the main process
would never reach them (they would repeat the first epoch's order). The epoch, the resume position and
the committed-shard count therefore live in a small int64 tensor in shared memory
(``share_memory_()``), which the main-process object and every worker see, with the ``fork`` and with
the ``spawn``/``forkserver`` start methods (torch's DataLoader pickling passes shared tensors by handle).
A worker reads them when the DataLoader restarts it, at ``iter(loader)``; the rest of a stream's
settings are fixed at construction. A copy made with :mod:`pickle` or :func:`copy.deepcopy` gets its
own shared state (it does not follow the original).

**Tail mode** (``tail=True``) follows a run a capture is still writing: it polls ``manifest.jsonl`` every
``poll_s`` seconds, reads each newly committed shard line (a torn last line is not committed), and stops
when the manifest's last line is a completion record and every committed shard is read. Shards come in
commit order (shard permutation needs the whole list; the shuffle buffer still applies). ``timeout_s``:
raise CaptureError when no new commit arrives for that long. ``drop_last`` needs the total and is
refused in tail mode. **Bounded disk**: against a capture run with ``--retain N`` each rank calls
:meth:`ShardStream.ack` after it saved a checkpoint, and the capture deletes the shards every rank is done
with (:mod:`shards.retain`: the rules, and how large N must be). Removed shards keep their place in the
order (their rows count for positions), so a stream restored from an acked state reads on; one behind its
ack raises CaptureError naming the removed shard. An offline (non-tail) stream reads the shards left.

**Remote runs.** ``run`` is a path, a URI (``s3://…``, ``gs://…``, ``objstore+file://…``) or a
:class:`shards.run.Location` (any ``pyarrow.fs.FileSystem`` and a path on it). A shard is an Arrow IPC *stream* (no random access), so a reader fetches each shard it touches
whole (at most ``open_shards`` held at once); local runs are memory-mapped and only the touched rows are
paged in.
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import os
import random
import time
from collections import OrderedDict
from typing import Iterator, Sequence

import pyarrow as pa
import torch
from torch.utils.data import IterableDataset, get_worker_info

from common.errors import CaptureError
from shards import manifest as manifest_mod
from shards import live
from shards.format import RunHeader, tap_layers
from shards.rows import table_sample
from shards.run import Location, as_location

log = logging.getLogger(__name__)

SPLITS = ("train", "heldout", "all")
_EPOCH, _POSITION, _SHARDS = 0, 1, 2  # slots of ShardStream._shared


def heldout_score(sample_id: str) -> float:
    """A number in [0, 1) fixed by the sample id alone: the first 8 bytes of SHA-256(utf-8 id), big-endian,
    over 2**64. Stable across runs, machines and Python versions."""
    return int.from_bytes(hashlib.sha256(sample_id.encode()).digest()[:8], "big") / 2**64


def in_split(sample_id: str, split: str, heldout_fraction: float) -> bool:
    """Whether ``sample_id`` belongs to ``split``: ``heldout`` is ``heldout_score < heldout_fraction``,
    ``train`` the rest, ``all`` everything. Raises CaptureError for another split name."""
    if split == "all":
        return True
    if split not in SPLITS:
        raise CaptureError(f"unknown split {split!r}; one of {', '.join(SPLITS)}")
    return (heldout_score(sample_id) < heldout_fraction) == (split == "heldout")


class ShardStream(IterableDataset):
    """Samples of a run folder (see the module docstring for order, sharding, resume and tail mode).

    ``run``: the run folder (a path, a URI or a :class:`shards.run.Location`). ``split``: ``train``,
    ``heldout`` or ``all`` by :func:`in_split` with ``heldout_fraction``. ``layers``: the taps to return
    (default all, in header order). ``final``: return the final state when the run stored it. ``topk``:
    return the top-K arrays when the run stored them (``--topk K``; :attr:`topk` is K, 0 when not
    returned). ``rank``,
    ``world_size``: default from ``torch.distributed`` when initialized, else 0 and 1.

    Raises CaptureError for a folder without a run (outside tail mode), a tap the run lacks, a bad split,
    fraction, rank or option combination.
    """

    def __init__(self, run: str | os.PathLike | Location, *, split: str = "all", heldout_fraction: float = 0.01, layers: Sequence[int] | None = None,
                 final: bool = True, topk: bool = True, shuffle: bool = False, seed: int = 0, shuffle_buffer: int = 1024,
                 rank: int | None = None, world_size: int | None = None, drop_last: bool = False,
                 tail: bool = False, poll_s: float = 1.0, timeout_s: float | None = None, open_shards: int = 4):
        if split not in SPLITS:
            raise CaptureError(f"unknown split {split!r}; one of {', '.join(SPLITS)}")
        if not 0.0 <= heldout_fraction <= 1.0:
            raise CaptureError(f"heldout_fraction must be in [0, 1], got {heldout_fraction}")
        if shuffle_buffer < 1 or open_shards < 1:
            raise CaptureError("shuffle_buffer and open_shards must be at least 1")
        if tail and drop_last:
            raise CaptureError("drop_last needs the run's total, which tail mode does not know until the end")
        self.location = as_location(run)
        self.split, self.heldout_fraction = split, heldout_fraction
        self.shuffle, self.seed, self.shuffle_buffer = shuffle, seed, shuffle_buffer
        self.rank, self.world_size = _rank(rank, world_size)
        self.drop_last, self.tail, self.poll_s, self.timeout_s = drop_last, tail, poll_s, timeout_s
        self.open_shards = open_shards

        manifest = self._wait_for_header() if tail else manifest_mod.read(self.location)
        if manifest.header is None:
            raise CaptureError(f"{run} holds no capture run (no {self.location.manifest_name} with a header)")
        self.header: RunHeader = manifest.header
        self._snapshot: list[dict] = [] if tail else list(manifest.shards)
        if manifest.removed and not tail:
            log.warning("%s: %d shard(s) of %d row(s) were removed after their readers consumed them (--retain); "
                        "reading the %d left", self.location.path, len(manifest.removed),
                        sum(s["rows"] for s in manifest.removed.values()), len(manifest.shards))
        # epoch, position, shard count: shared with DataLoader workers, persistent ones included (module docstring)
        self._shared = torch.tensor([0, 0, len(self._snapshot)], dtype=torch.int64).share_memory_()
        self._next = 0  # what this process yielded (in-process iteration; each worker counts its own)
        self.columns: tuple[str, ...] = self.header.layout.columns_for(layers, final)  # the state columns decoded
        self.taps_layers: tuple[int, ...] = tap_layers(self.columns)
        self.final_kind: str | None = self.header.final_kind if final else None
        self.has_argmax: bool = self.header.argmax
        self.topk: int = self.header.topk if topk else 0

    # ---------------------------------------------------------------- state shared with workers

    @property
    def epoch(self) -> int:
        """The epoch the next iteration reads (shared with DataLoader workers)."""
        return int(self._shared[_EPOCH])

    @epoch.setter
    def epoch(self, value: int) -> None:
        self._shared[_EPOCH] = int(value)

    @property
    def position(self) -> int:
        """This rank's samples of the epoch skipped by the next iteration (the resume point; shared with
        DataLoader workers)."""
        return int(self._shared[_POSITION])

    @position.setter
    def position(self, value: int) -> None:
        self._shared[_POSITION] = int(value)

    @property
    def _shards(self) -> list[dict]:
        """The committed shards an epoch reads: the construction snapshot, cut by a loaded state."""
        return self._snapshot[: int(self._shared[_SHARDS])]

    def __setstate__(self, state: dict) -> None:
        # A plain pickle copies the tensor into ordinary memory; share it again so the copy works behind
        # fork workers too. (Unpickled by torch's DataLoader/multiprocessing it is already the shared one.)
        self.__dict__.update(state)
        if not self._shared.is_shared():
            self._shared.share_memory_()

    # ---------------------------------------------------------------- order

    def _wait_for_header(self) -> manifest_mod.Manifest:
        start = time.monotonic()
        while True:
            manifest = manifest_mod.read(self.location)
            if manifest.header is not None:
                return manifest
            if self.timeout_s is not None and time.monotonic() - start > self.timeout_s:
                return manifest
            time.sleep(self.poll_s)

    def _committed(self) -> Iterator[dict]:
        """Shard lines of the epoch: the snapshot, or (tail) every line as it is committed."""
        if not self.tail:
            yield from self._shards
            return
        seen, last_new = 0, time.monotonic()
        while True:
            manifest = manifest_mod.read(self.location)
            new = manifest.all_shards[seen:]  # removed ones too: they hold positions of the order
            yield from new
            seen += len(new)
            if new:
                last_new = time.monotonic()
            elif manifest.complete:
                return
            elif self.timeout_s is not None and time.monotonic() - last_new > self.timeout_s:
                raise CaptureError(f"tail: no new shard committed to {self.location.path} for {self.timeout_s:g} s "
                                   "and no completion record")
            else:
                time.sleep(self.poll_s)

    def _entries(self, epoch: int) -> Iterator[tuple[str, int, str]]:
        """The epoch's global order of ``(shard path, row, sample_id)`` (before rank sharding)."""
        shards = self._committed()
        if self.shuffle and not self.tail:
            shards = list(shards)
            random.Random(f"{self.seed}:{epoch}:shards").shuffle(shards)
        rows = ((s["path"], i, sid) for s in shards for i, sid in enumerate(s["sample_ids"])
                if in_split(sid, self.split, self.heldout_fraction))
        if self.shuffle:
            rows = _buffer_shuffle(rows, self.shuffle_buffer, random.Random(f"{self.seed}:{epoch}:buffer"))
        if self.drop_last:
            rows = list(rows)
            rows = rows[: len(rows) - len(rows) % self.world_size]
        return rows

    def order(self, epoch: int | None = None) -> list[str]:
        """The sample ids this rank yields in ``epoch`` (default the current one), from position 0; no
        shard is read (tail mode: waits for the run's completion)."""
        epoch = self.epoch if epoch is None else epoch
        return [sid for g, (_, _, sid) in enumerate(self._entries(epoch)) if g % self.world_size == self.rank]

    def __len__(self) -> int:
        """Samples of this rank in one epoch (not defined in tail mode: TypeError)."""
        if self.tail:
            raise TypeError("a tail-mode ShardStream has no length until its run completes")
        n = sum(1 for s in self._shards for sid in s["sample_ids"] if in_split(sid, self.split, self.heldout_fraction))
        if self.drop_last:
            n -= n % self.world_size
        return n // self.world_size + (1 if self.rank < n % self.world_size else 0)

    # ---------------------------------------------------------------- iteration

    def __iter__(self) -> Iterator[dict]:
        worker = get_worker_info()
        wid, workers = (worker.id, worker.num_workers) if worker is not None else (0, 1)
        epoch, start, _ = self._shared.tolist()  # read once: the main process may move on meanwhile
        self._next = start
        tables = _TableCache(self.location, self.open_shards)
        for g, (path, row, sid) in enumerate(self._entries(epoch)):
            if g % self.world_size != self.rank:
                continue
            j = g // self.world_size
            if j < start or (j - start) % workers != wid:  # the DataLoader asks worker 0 first
                continue
            table = self._table(tables, path)
            if row >= table.num_rows or table.column("sample_id")[row].as_py() != sid:
                raise CaptureError(f"{self.location.path}: row {row} of {path} is not {sid}, as the manifest records; "
                                   "the run is damaged (`capture shards verify` checks it)")
            sample = self.sample(table, row)
            self._next = j + 1
            yield sample

    def _table(self, tables: "_TableCache", path: str) -> pa.Table:
        try:
            return tables.get(path)
        except (CaptureError, OSError, pa.ArrowIOError):
            if path in manifest_mod.read(self.location).removed:
                raise CaptureError(
                    f"{path} was removed after every reader rank acked it (--retain): this stream is behind the "
                    "position its rank acked; resume it from the state saved with that ack") from None
            raise

    def sample(self, table: pa.Table, row: int) -> dict:
        """Row ``row`` of a shard table as a sample dict (the module docstring's contract), decoded by
        :func:`shards.rows.table_sample` in the layout of the shard's own header."""
        return table_sample(table, row, self.columns, self.topk)

    # ---------------------------------------------------------------- epochs and resume

    def set_epoch(self, epoch: int) -> None:
        """Iterate ``epoch`` next (the shuffle depends on ``(seed, epoch)``), from its beginning; the
        current epoch keeps its resume position, so ``for e in range(state["epoch"], n): set_epoch(e)``
        continues a loaded state."""
        if int(epoch) != self.epoch:
            self._shared[_EPOCH], self._shared[_POSITION], self._next = int(epoch), 0, 0

    def state_dict(self, consumed: int | None = None) -> dict:
        """What :meth:`load_state_dict` needs to continue exactly: ``epoch`` and ``position`` (this rank's
        samples consumed in the epoch: the resume point plus ``consumed`` when given, else what this
        object yielded in the calling process), plus the settings that fix the order, which a resume
        checks."""
        position = self._next if consumed is None else self.position + int(consumed)
        return {"epoch": self.epoch, "position": position, "rank": self.rank, "world_size": self.world_size,
                **self._order_settings()}

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state`` (see :meth:`state_dict`). Raises CaptureError when this stream's order
        would differ: other seed, shuffle, split, world size, rank or committed shards."""
        mine = {"rank": self.rank, "world_size": self.world_size, **self._order_settings()}
        diff = [k for k in mine if k in state and state[k] != mine[k] and k != "shards"]
        if diff:
            raise CaptureError(f"saved stream state differs in {', '.join(diff)}; it cannot resume this stream")
        if not self.tail:
            n = state["shards"]["count"]
            if n > len(self._snapshot) or _fingerprint(self._snapshot[:n]) != state["shards"]["fingerprint"]:
                raise CaptureError("the run's committed shards do not start with the ones this state was saved over")
            self._shared[_SHARDS] = n
        self._shared[_EPOCH], self._shared[_POSITION] = int(state["epoch"]), int(state["position"])
        self._next = self.position

    def ack(self, state: dict | None = None) -> "live.Ack":
        """Acknowledge what this rank consumed, so that a capture run with ``--retain N`` may delete the
        shards every rank is done with (:mod:`shards.retain`). ``state``: the stream state the trainer just
        saved with its checkpoint (:meth:`state_dict`; default this object's own). Call it after that
        checkpoint is durable. Returns the :class:`shards.live.Ack` written (``shards``: the live shards none of whose rows
        this rank still has to read from ``state["position"]`` on). Raises CaptureError outside tail mode (an
        offline reader's shards stay) and OSError from the store."""
        if not self.tail:
            raise CaptureError("ack() is for tail-mode streams (tail=True): an offline reader never removes shards")
        state = self.state_dict() if state is None else state
        if state["rank"] != self.rank or state["world_size"] != self.world_size:
            raise CaptureError(f"ack: the state is rank {state['rank']} of {state['world_size']}, this stream rank "
                               f"{self.rank} of {self.world_size}")
        epoch, position = int(state["epoch"]), int(state["position"])
        ack = live.Ack("tail", self.rank, self.world_size, time.time(), shards=tuple(self.done(epoch, position)),
                       epoch=epoch, position=position)
        live.write(self.location, ack)
        return ack

    def done(self, epoch: int, position: int) -> list[str]:
        """Live shards (in the manifest now) none of whose rows this rank reads at rank-local ``position``
        of ``epoch`` or later: every row of the shard already left the global order (the shuffle buffer
        keeps rows back until the run completes) and this rank's ones lie before ``position``. Tail mode
        only (its order is the commit order); no shard is read."""
        manifest = manifest_mod.read(self.location)
        left = collections.Counter()
        for s in manifest.all_shards:
            left[s["path"]] += sum(1 for sid in s["sample_ids"] if in_split(sid, self.split, self.heldout_fraction))
        rows = ((s["path"], i, sid) for s in manifest.all_shards for i, sid in enumerate(s["sample_ids"])
                if in_split(sid, self.split, self.heldout_fraction))
        if self.shuffle:
            rows = _buffer_shuffle(rows, self.shuffle_buffer, random.Random(f"{self.seed}:{epoch}:buffer"),
                                   flush=manifest.complete)
        ahead = collections.Counter()  # this rank's rows at or past `position`, per shard
        for g, (path, _, _) in enumerate(rows):
            left[path] -= 1
            if g % self.world_size == self.rank and g // self.world_size >= position:
                ahead[path] += 1
        return [s["path"] for s in manifest.shards if left[s["path"]] == 0 and ahead[s["path"]] == 0]

    def _order_settings(self) -> dict:
        shards = None if self.tail else {"count": len(self._shards), "fingerprint": _fingerprint(self._shards)}
        return {"seed": self.seed, "shuffle": self.shuffle, "shuffle_buffer": self.shuffle_buffer,
                "split": self.split, "heldout_fraction": self.heldout_fraction, "drop_last": self.drop_last,
                "tail": self.tail, "shards": shards}


def _rank(rank: int | None, world_size: int | None) -> tuple[int, int]:
    if rank is None and world_size is None and torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    rank, world_size = rank or 0, world_size or 1
    if not 0 <= rank < world_size:
        raise CaptureError(f"rank {rank} is not in [0, world_size={world_size})")
    return rank, world_size


def _fingerprint(shards: list[dict]) -> str:
    return hashlib.sha256(json.dumps([s["sha256"] for s in shards]).encode()).hexdigest()[:16]


def _buffer_shuffle(items, size: int, rng: random.Random, flush: bool = True):
    """A bounded shuffle: keep ``size`` items, emit a random one as each new item arrives, then (``flush``)
    the rest in random order. Deterministic for a given ``rng`` state and input order; what it emits
    before the flush depends only on the items so far (what :meth:`ShardStream.done` relies on)."""
    buffer = []
    for item in items:
        if len(buffer) < size:
            buffer.append(item)
            continue
        i = rng.randrange(size)
        yield buffer[i]
        buffer[i] = item
    if flush:
        rng.shuffle(buffer)
        yield from buffer


class _TableCache:
    """The last ``size`` shard tables a reader touched (an LRU; one per iterator, never shared)."""

    def __init__(self, location: Location, size: int):
        self.location, self.size, self.tables = location, size, OrderedDict()

    def get(self, path: str) -> pa.Table:
        if path in self.tables:
            self.tables.move_to_end(path)
        else:
            self.tables[path] = self.location.read_table(path)
            while len(self.tables) > self.size:
                self.tables.popitem(last=False)
        return self.tables[path]
