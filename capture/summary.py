"""What a run did: the :class:`Summary` ``capture run`` prints (``--json``: :meth:`Summary.as_dict`) and
the completion record's counts come from."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Summary:
    """What a run did. Counts are for this invocation; ``total_*`` are the whole run's (manifest)."""

    out: str
    rows_read: int = 0
    already_committed: int = 0
    kept: int = 0  # records sent to the engine
    committed_rows: int = 0
    committed_tokens: int = 0
    committed_loss_tokens: int = 0
    committed_bytes: int = 0
    shards: int = 0  # shards committed (an online run without keep commits none)
    delivered_units: int = 0  # online: units whose payload went to the trainer side (rows all acked: not queued)
    skipped: dict = dataclasses.field(default_factory=dict)  # reason → rows (data, template, filters)
    rejected: dict = dataclasses.field(default_factory=dict)  # reason → rows (write-time validation)
    normalized: dict = dataclasses.field(default_factory=dict)
    truncated_input: str | None = None
    total_rows: int = 0
    total_tokens: int = 0
    seconds: float = 0.0
    estimated_bytes: int | None = None  # dry run only
    estimated_tokens: int | None = None  # dry run only
    estimated_bytes_by_codec: dict | None = None  # dry run only
    free_bytes: int | None = None  # dry run only: free space where --out is (or would be)
    replicas: list = dataclasses.field(default_factory=list)  # per replica: units, rows, tokens, busy s, restarts
    timings: dict = dataclasses.field(default_factory=dict)  # seconds: capture.progress.Timings
    quarantined: dict = dataclasses.field(default_factory=dict)  # sample_id → reason (failed every attempt)
    executor: str = ""  # where the replicas ran: "ray" (actors) or "local" (the driver's process)
    self_check: dict | None = None  # --self-check: provenance.check's verdict on rows of this run (None: not run)
    engine: str = ""  # the engine that ran (or would run) and why: Prepared.engine_choice
    # --retain N: limit, removed_shards, removed_rows (by this invocation), peak_live (most committed shards
    # on disk), wait_seconds (waiting for reader acks); None without --retain
    retained: dict | None = None

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)
