"""One engine replica: takes work units of tokenized records, prefills them, writes shards.

A replica runs as a Ray actor or in the driver's process (``--executor``, :mod:`capture.executor`); it owns an engine and a
:class:`shards.writer.ShardWriter`. It never touches the manifest: it returns the shards it closed and
the driver commits them, so two replicas never claim the same shard or sample.

The writer runs in a thread of its own, so encoding and I/O overlap the next forward: the engine hands
each batch of rows to a queue of at most two batches (bounded memory in flight; the engine waits when
the writer falls behind), and the writer encodes cells with its own small thread pool (zstd and numpy
release the GIL). A writer error (e.g. ENOSPC) is raised by the next ``process`` or ``finish`` call.

A shard closes when it reaches ``shard_size``, and also at the end of a unit when it is the replica's
first shard or has been open ``commit_seconds`` or longer: the driver commits what a unit closed, so a
short or killed run keeps all but its last unit(s), whatever the shard size.

Self-distillation (header ``responses.mode == "regenerate"``): a work unit holds
:class:`capture.chat.Prompt` records; the replica generates their answers with the engine
(:func:`capture.regenerate.regenerate`, batched by ``batch_tokens``), applies the length filters that
depend on the generated answers (``filters``: max/min tokens, min loss tokens; a dropped record is
rejected with the filter's reason), then prefills and writes the records like dataset ones. The replica
does not care which engine it has.

Write-time validation: a record whose states hold NaN or Inf is rejected with the reason
``nonfinite_states`` (counted, not written), one whose top-K log-probabilities hold NaN or +inf with
``nonfinite_topk`` (-inf, a probability of exactly 0, is kept); a length mismatch between ids, mask,
argmax, top-K and states is a bug in an engine and raises RuntimeError.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from typing import Sequence

import numpy as np
import torch

from common.records import Prompt, Tokenized
from capture.engines import EngineSpec, load_engine
from capture.engines.base import Captured
from capture.identity import ModelIdentity, check as check_model
from capture.regenerate import regenerate, sampling_of
from capture.sinks import Output
from capture.targets import Taps
from filters import FilterConfig, apply_filters
from shards.format import RunHeader, schema
from shards.rows import Row
from shards.run import Location
from shards.writer import ShardInfo


_CLOSE = object()  # a writer queue item: close the open shard
_PAYLOAD = object()  # a writer queue item (outputs with payloads): close the unit's payload


@dataclasses.dataclass
class UnitResult:
    shards: list[ShardInfo]  # closed shards
    rejected: dict[str, str]  # sample_id → reason
    tokens: int  # tokens prefilled in this unit
    rows: int
    engine_seconds: float = 0.0  # in engine forward/generate calls
    write_seconds: float = 0.0  # the writer thread's encoding and I/O since the last unit (beside the engine)
    payload: ShardInfo | None = None  # outputs with payloads: what the unit's payload holds (path ""), None if no row


def length_batches(records: Sequence[Tokenized], batch_tokens: int | None) -> list[list[Tokenized]]:
    """Group records by length (longest first) into batches of at most ``batch_tokens`` padded tokens;
    a record longer than the budget gets a batch of its own. ``None``: one batch (an engine that
    schedules its own batches, like vLLM)."""
    ordered = sorted(records, key=lambda r: r.num_tokens, reverse=True)
    if batch_tokens is None:
        return [ordered] if ordered else []
    batches: list[list[Tokenized]] = []
    for rec in ordered:
        if batches and (len(batches[-1]) + 1) * batches[-1][0].num_tokens <= batch_tokens:
            batches[-1].append(rec)
        else:
            batches.append([rec])
    return batches


def to_row(rec: Tokenized, cap: Captured, hidden_size: int, topk: int = 0) -> Row | str:
    """Validate one captured record (``topk``: the run's K, 0 for none). Returns a Row, or the rejection
    reason."""
    n = rec.num_tokens
    for column, t in cap.states.items():
        if tuple(t.shape) != (n, hidden_size):
            raise RuntimeError(f"{rec.sample_id}: {column} has shape {tuple(t.shape)}, expected ({n}, {hidden_size})")
    if cap.argmax is not None and cap.argmax.shape != (n,):
        raise RuntimeError(f"{rec.sample_id}: argmax has {cap.argmax.shape[0]} entries for {n} tokens")
    if rec.loss_mask.shape != (n,):
        raise RuntimeError(f"{rec.sample_id}: loss mask has {rec.loss_mask.shape[0]} entries for {n} tokens")
    for name, a in (("topk_ids", cap.topk_ids), ("topk_logprobs", cap.topk_logprobs)):
        if topk and (a is None or a.shape != (n, topk)):
            raise RuntimeError(f"{rec.sample_id}: {name} has shape {None if a is None else a.shape}, expected ({n}, {topk})")
        if not topk and a is not None:
            raise RuntimeError(f"{rec.sample_id}: the engine returned {name} for a run without --topk")
    for column, t in cap.states.items():
        if not bool(torch.isfinite(t).all()):
            return f"nonfinite_states:{column}"
    if topk and (np.isnan(cap.topk_logprobs).any() or np.isposinf(cap.topk_logprobs).any()):
        return "nonfinite_topk"
    return Row(rec.sample_id, rec.source, rec.row_index, rec.input_ids, rec.loss_mask, cap.argmax, cap.states,
               rec.token_sha256, rec.finish_reasons, cap.topk_ids, cap.topk_logprobs)


class Replica:
    """Engine + shard writer for the run at ``out`` (a Location or a path/URI). ``header`` is the run
    header; ``filters`` are applied to regenerated records after generation (dedup excepted: the driver
    dedups prompts)."""

    def __init__(self, model_dir: str, taps: Taps, header: RunHeader, out: Location | str, *, shard_size: int,
                 batch_tokens: int, threads: int | None = None, codec_threads: int = 2,
                 engine: EngineSpec = EngineSpec("hf"), filters: FilterConfig | None = None, feed=None,
                 commit_seconds: float = float("inf"), output: Output = Output(), model: ModelIdentity | None = None):
        self._load = lambda: load_engine(engine, model_dir, taps, argmax=header.argmax, dtype=header.dtype,
                                         threads=threads, topk=header.topk)
        # the driver's fingerprint of the model folder and code (capture.identity), checked before loading
        self._check = (lambda: check_model(model_dir, model, header.target.get("source"))) if model else None
        self.engine = None  # loaded by start(): a Ray actor's constructor error loses its exception type
        self.hidden_size = header.hidden_size
        self.topk = header.topk
        # an engine that schedules its own batches (vLLM's max_num_batched_tokens) gets the whole unit at once
        self.batch_tokens = None if engine.capabilities.own_batching else batch_tokens
        self.responses = header.responses
        self.filters = dataclasses.replace(filters or FilterConfig(), dedup=False)
        # what the run's sink asks for (capture.sinks): shards, and/or each unit's rows as one Arrow IPC
        # payload (:meth:`process_with_payload`), encoded exactly as shard rows
        self.writer = output.writer(out, schema(header), shard_size, codec_threads)
        self._payloads: queue.SimpleQueue = queue.SimpleQueue()  # writer thread → process_with_payload
        self._queue: queue.Queue = queue.Queue(maxsize=2)
        self._closed: queue.SimpleQueue[ShardInfo] = queue.SimpleQueue()  # writer thread → caller
        self._error: BaseException | None = None
        self._feed = feed  # capture.progress.feed(): token counts per forward batch, for the driver's display
        self._write_seconds = 0.0  # the writer thread's busy time, handed out with each UnitResult
        self.commit_seconds = commit_seconds
        self._opened: float | None = None  # when rows first went into the open shard (None: it holds none)
        self._closed_any = False  # whether this replica has closed a shard yet
        self._start_writer()

    def start(self) -> str:
        """Check this host's model folder and code against the driver's (:mod:`capture.identity`), then load
        the engine (minutes for a large target); raises CaptureError for a mismatch, and what the engine
        raises, e.g. CaptureError for engine arguments vLLM refuses. Returns the engine's name."""
        if self._check is not None:
            self._check()
        self.engine = self._load()
        return self.engine.name

    def _start_writer(self) -> None:
        self._thread = threading.Thread(target=self._write_loop, name="shard-writer", daemon=True)
        self._thread.start()

    def _write_loop(self) -> None:
        while (rows := self._queue.get()) is not None:
            if self._error is None:  # else drop: nothing of a failed writer is committed; the error goes to the driver
                t0 = time.perf_counter()
                try:
                    if rows is _PAYLOAD:
                        for item in self.writer.close_payload():
                            self._payloads.put(item)
                    else:
                        for info in (self.writer.close() if rows is _CLOSE else self.writer.write(rows)):
                            self._closed.put(info)
                except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
                    self._error = e
                self._write_seconds += time.perf_counter() - t0
            self._queue.task_done()
        self._queue.task_done()

    def _collect(self) -> list[ShardInfo]:
        """Shards the writer closed since the last call; raises the writer's error if it failed."""
        if self._error is not None:
            raise self._error
        closed = []
        while not self._closed.empty():
            closed.append(self._closed.get())
        return closed

    def process(self, unit: Sequence[Tokenized] | Sequence[Prompt]) -> UnitResult:
        """Prefill and write one work unit (regenerate mode: generate the answers first); returns the
        shards closed meanwhile and the rejections."""
        if self.engine is None:
            raise RuntimeError("Replica.start() loads the engine; call it before process()")
        result = UnitResult([], {}, 0, 0)
        if self.responses["mode"] == "regenerate":
            t0 = time.perf_counter()
            unit = self._regenerate(unit, result.rejected)
            result.engine_seconds += time.perf_counter() - t0
        for batch in length_batches(unit, self.batch_tokens):
            rows = []
            t0 = time.perf_counter()
            captured = self.engine.forward([r.input_ids for r in batch])
            result.engine_seconds += time.perf_counter() - t0
            self._report(sum(r.num_tokens for r in batch))
            for rec, cap in zip(batch, captured):
                row = to_row(rec, cap, self.hidden_size, self.topk)
                if isinstance(row, str):
                    result.rejected[rec.sample_id] = row
                else:
                    rows.append(row)
            if self._error is not None:  # fail fast: the writer failed
                raise self._error
            if rows:
                self._queue.put(rows)
                self._opened = self._opened or time.monotonic()
            result.tokens += sum(r.num_tokens for r in batch)
            result.rows += len(rows)
        if self._opened is not None and (not self._closed_any or time.monotonic() - self._opened >= self.commit_seconds):
            self._queue.put(_CLOSE)  # the open shard closes now and commits with this unit
            self._queue.join()
            self._opened = None
        result.shards = self._collect()
        self._closed_any = self._closed_any or bool(result.shards)
        result.write_seconds, self._write_seconds = self._write_seconds, 0.0
        return result

    def process_with_payload(self, unit: Sequence[Tokenized] | Sequence[Prompt]) -> tuple[UnitResult, np.ndarray]:
        """A sink with payloads (:class:`capture.sinks.Output`): :meth:`process`, then the unit's rows as ``(result, payload)``: ``payload`` a uint8
        array holding one Arrow IPC stream (the run's shard schema and cells; Ray hands it on zero-copy),
        ``result.payload`` the ShardInfo describing it (``path`` ""; no rows: None and an empty payload);
        ``result.shards`` the shards closed meanwhile (an output with shards too).
        Called with two returns (``num_returns=2``) so that the payload is an object the driver owns: it
        outlives this replica."""
        result = self.process(unit)
        self._queue.put(_PAYLOAD)
        self._queue.join()
        if self._error is not None:
            raise self._error
        payload = np.zeros(0, dtype=np.uint8)
        while not self._payloads.empty():
            result.payload, payload = self._payloads.get()
        return result, payload

    def _report(self, tokens: int) -> None:
        if self._feed is not None:
            self._feed.put_nowait(tokens)

    def _regenerate(self, prompts: Sequence[Prompt], rejected: dict[str, str]) -> list[Tokenized]:
        """Generated records of ``prompts`` that pass the length filters; the others go to ``rejected``."""
        records = regenerate(self.engine, prompts, sampling_of(self.responses), self.responses["stop_ids"],
                             batch_tokens=self.batch_tokens, on_batch=self._report, budget=self.filters.max_tokens)
        kept = []
        for rec in records:
            filtered, reason = apply_filters(rec, self.filters, set())
            if reason:
                rejected[rec.sample_id] = reason
            else:
                kept.append(filtered)
        return kept

    def finish(self) -> list[ShardInfo]:
        """Wait for the writer, close the open shard; returns the shards not yet handed to the driver."""
        self._queue.put(None)
        self._thread.join()
        closed = self._collect() + self.writer.close()
        self._opened = None
        self._start_writer()  # the replica stays usable (a later unit starts a new shard)
        return closed

    def close(self) -> None:
        """End the writer and encoder threads and drop the engine (after :meth:`finish`; the replica is unusable after):
        an in-process replica's thread would otherwise keep the replica, and so its model, alive after the
        run (~280 MiB a SmolLM2 run, measured)."""
        self._queue.put(None)
        self._thread.join()
        for writer in (self.writer, getattr(self.writer, "shards", None), getattr(self.writer, "payloads", None)):
            if getattr(writer, "encode", None) is not None:  # a TeeWriter's two writers each have their encoder
                writer.encode.close()
        self.engine = None
