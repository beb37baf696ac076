"""Where a run's replicas live: Ray actors (a local ``ray.init()`` unless ``--ray-address`` is given), or
one replica object in the driver's own process (no Ray daemons, one process: bench/peer_modelopt.out).

:func:`start` resolves ``--executor``, starts Ray when needed (and shuts down a Ray it started), gives
the progress display its feed, checks that the replicas fit the CPUs, and yields an :class:`Executor`:
the pool's calls interface (:mod:`capture.pool`) and a factory of replica actors.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from typing import Callable, Iterator

from capture.config import RunConfig
from capture.engines import EngineSpec
from capture.pool import LocalActor, LocalCalls, RayCalls
from capture.progress import LocalFeed, Progress, feed
from common.errors import CaptureError
from common.net import gcs_unreachable


@dataclasses.dataclass(frozen=True)
class Executor:
    """``name``: ``"ray"`` or ``"local"``; ``calls``: how the pool reaches a replica; ``cpus``: CPU threads
    per replica; ``gpus``: GPUs a Ray replica reserves (Ray sets its CUDA_VISIBLE_DEVICES)."""

    name: str
    calls: RayCalls | LocalCalls
    cpus: int
    gpus: int = 0

    def actors(self, cls: type, *args, **kwargs) -> Callable[[], object]:
        """A ``make_actor()`` for :class:`capture.pool.ReplicaPool`: a new ``cls(*args, **kwargs)`` replica,
        a Ray actor (its process reserving ``cpus`` and ``gpus``) or a :class:`capture.pool.LocalActor`."""
        if self.name == "local":
            return lambda: LocalActor(cls(*args, **kwargs))
        import ray

        actor_cls = ray.remote(num_cpus=self.cpus, num_gpus=self.gpus)(cls)
        return lambda: actor_cls.remote(*args, **kwargs)


def executor_of(cfg: RunConfig, engine: EngineSpec) -> str:
    """``cfg.executor``, with ``auto`` resolved: ``local`` for one replica of an engine that runs in the
    driver's process (``Capabilities.in_process``: hf) with no Ray address and no unit timeout, else ``ray``
    (a replica that owns GPUs or engine processes of its own, vLLM and EXL3, is worth isolating)."""
    if cfg.executor != "auto":
        return cfg.executor
    alone = cfg.replicas == 1 and cfg.ray_address is None and cfg.unit_timeout is None
    return "local" if alone and engine.capabilities.in_process else "ray"


def replica_gpus(engine: EngineSpec, tp: int, cluster_gpus: float) -> int:
    """GPUs a Ray replica reserves: a cuda hf replica its ``engine.gpus`` (CaptureError when the cluster
    has fewer), a vLLM replica its TP group's ``tp`` on a GPU cluster (none on a CPU one: vLLM-CPU), others none."""
    if engine.device == "cuda":
        if cluster_gpus < engine.gpus:
            raise CaptureError(f"--device cuda: the Ray cluster has {cluster_gpus:g} GPU(s), a replica needs {engine.gpus}")
        return engine.gpus
    return tp if engine.capabilities.gpus_per_tp_rank and cluster_gpus else 0


def _cpus(cfg: RunConfig, total: int, where: str) -> int:
    """CPU threads per replica (``--cpus-per-replica``, else an equal share); CaptureError when they do not fit."""
    cpus = cfg.cpus_per_replica or max(1, total // cfg.replicas)
    if cpus * cfg.replicas > total:
        raise CaptureError(f"{cfg.replicas} replica(s) x {cpus} CPU(s) do not fit the {total} CPU(s) {where}; "
                           "lower --replicas or --cpus-per-replica")
    return cpus


@contextlib.contextmanager
def start(cfg: RunConfig, engine: EngineSpec, progress: Progress, needs_ray: bool = False) -> Iterator[Executor]:
    """The run's executor (module docstring); ``needs_ray``: the run hands payloads between processes
    (online), which needs Ray. On exit the progress feed closes, then Ray, if this call started it.
    Raises CaptureError for ``--executor local`` with ``needs_ray``, or replicas that do not fit."""
    if needs_ray and cfg.executor == "local":
        raise CaptureError("an online run streams rows through Ray: it needs --executor ray or auto")
    if not needs_ray and executor_of(cfg, engine) == "local":
        progress.feed = LocalFeed()
        try:
            yield Executor("local", LocalCalls(), _cpus(cfg, len(os.sched_getaffinity(0)), "this process may use"))
        finally:
            progress.close()
        return
    import ray

    we_started_ray = not ray.is_initialized()
    if we_started_ray:
        if cfg.ray_address and gcs_unreachable(cfg.ray_address):
            raise CaptureError(f"--ray-address {cfg.ray_address}: nothing answers there: is the cluster up (`ray status "
                               f"--address {cfg.ray_address}`)? Nothing was captured")
        progress.status("starting Ray")
        # "local": a new instance even where `ray start` left a (maybe stale) /tmp/ray/ray_current_cluster
        try:
            ray.init(address=cfg.ray_address or "local", num_cpus=None if cfg.ray_address else os.cpu_count(),
                     include_dashboard=False, logging_level=logging.ERROR, log_to_driver=True)
        except ConnectionError as e:  # ray.init's own words name the address and that nothing answered there
            raise CaptureError(f"{e}: is the cluster up (`ray status --address {cfg.ray_address}`)? "
                               "Nothing was captured") from None
    try:
        progress.feed = feed(on_driver_node())  # a lost worker node does not take it along
        resources = ray.cluster_resources()
        cpus, gpus = _cpus(cfg, int(resources.get("CPU", 0)), "Ray has"), replica_gpus(engine, cfg.tp, resources.get("GPU", 0))
        yield Executor("ray", RayCalls(cpus, gpus), cpus, gpus)
    finally:
        progress.close()  # the feed's actor goes before Ray does
        if we_started_ray:
            ray.shutdown()


def on_driver_node() -> dict:
    """Ray actor options for the run's own helper actors (the progress feed, an online run's queues): no CPU,
    and placed on this process's node (hard affinity), so that losing a worker node never takes one with it."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return {"num_cpus": 0,
            "scheduling_strategy": NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)}
