"""Online transport, measured: the bounded queue of object refs that ``capture.online`` uses vs Ray Data's
``streaming_split``, moving the same payloads from 2 producer actors to one trainer rank.

    python bench/online_transport.py [--mib 8 64] [--total-mib 2048] [--repeats 3] [--free-period-ms MS]

The producers stand in for capture replicas and do no work (each returns one fixed uint8 array of
``--mib`` MiB per unit, as a replica returns a unit's Arrow payload): what is left is the transport. Both
designs keep 2 units in flight per producer and at most 2 units waiting for the consumer:

- ``queue``: the driver keeps 2 calls in flight per actor (``ray.wait``), puts each finished ref on a
  ``ray.util.queue.Queue(maxsize=2)``; the consumer (this process's main thread) ``get``s a ref and
  ``ray.get``s the payload (zero-copy from the object store). The shape of ``capture.online``.
- ``ray-data``: ``ray.data.range(N).map_batches(Producer, concurrency=2, batch_size=1)`` then
  ``streaming_split(1)[0].iter_batches(batch_size=None, batch_format="numpy")``, Ray Data's streaming
  executor with its default backpressure.

The consumer touches one byte per 4 KiB page of each payload (so it is really mapped). Per design:
seconds to the first payload (starting the producers included: actors, or Ray Data's executor and actor
pool), GB/s through the consumer after the first payload, CPU-seconds of the whole machine per GB moved
(``psutil.cpu_times``, start-up included: Ray's raylet, workers and executor threads), and the peak of
Ray's plasma store. Median of ``--repeats`` interleaved runs, one Ray instance. ``--free-period-ms``: Ray's
``free_objects_period_milliseconds`` (default 1000: the raylet frees out-of-scope objects in batches once
a second, so plasma also holds up to about a second of consumed payloads).
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import numpy as np
import psutil
import ray

from harness import header, plasma_mib


@ray.remote(num_cpus=0.5)
class Producer:
    def __init__(self, mib: int):
        self.payload = np.random.default_rng(0).integers(0, 256, mib << 20, dtype=np.uint8)

    def unit(self, i: int) -> np.ndarray:
        return self.payload


class DataProducer:
    """The same producer as a Ray Data map_batches UDF (one payload per row)."""

    def __init__(self, mib: int):
        self.payload = np.random.default_rng(0).integers(0, 256, mib << 20, dtype=np.uint8)

    def __call__(self, batch: dict) -> dict:
        return {"payload": self.payload[None, :]}


class Plasma(threading.Thread):
    """Peak MiB in Ray's plasma store, every ``interval`` s."""

    def __init__(self, interval: float = 0.2):
        super().__init__(daemon=True)
        self.interval, self.peak, self.stop = interval, 0, threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            self.peak = max(self.peak, plasma_mib())
            self.stop.wait(self.interval)


def touch(payload: np.ndarray) -> int:
    return int(payload.reshape(-1)[::4096].sum())


def via_queue(mib: int, n: int):
    from ray.util.queue import Queue

    producers = [Producer.remote(mib) for _ in range(2)]
    queue = Queue(maxsize=2, actor_options={"num_cpus": 0})

    def drive() -> None:
        pending, sent = {}, 0
        while sent < n or pending:
            while sent < n and len(pending) < 4:
                pending[producers[sent % 2].unit.remote(sent)] = sent
                sent += 1
            done, _ = ray.wait(list(pending), num_returns=1)
            for ref in done:
                del pending[ref]
                queue.put((ref,))  # in a tuple: a top-level ref argument would be resolved
        queue.put(None)

    def consume():
        threading.Thread(target=drive, daemon=True).start()
        while (item := queue.get()) is not None:
            yield ray.get(item[0])

    return consume, lambda: (queue.shutdown(), [ray.kill(p) for p in producers])


def via_ray_data(mib: int, n: int):
    ds = ray.data.range(n, override_num_blocks=n).map_batches(
        DataProducer, fn_constructor_args=(mib,), batch_size=1, compute=ray.data.ActorPoolStrategy(size=2),
        num_cpus=0.5)
    split = ds.streaming_split(1, equal=False)[0]

    def consume():
        for batch in split.iter_batches(batch_size=None, batch_format="numpy", prefetch_batches=1):
            for payload in batch["payload"]:
                yield payload

    return consume, lambda: None


def one(design: str, mib: int, n: int) -> dict:
    plasma = Plasma()
    plasma.start()
    cpu0 = psutil.cpu_times()
    t0 = time.perf_counter()
    consume, cleanup = (via_queue if design == "queue" else via_ray_data)(mib, n)  # producers start on the clock
    first = None
    got = 0
    for payload in consume():
        touch(payload)
        first = first if first is not None else time.perf_counter()
        got += 1
    end = time.perf_counter()
    cpu1 = psutil.cpu_times()
    plasma.stop.set()
    plasma.join()
    cleanup()
    assert got == n, (design, got, n)
    cpu = (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)
    gb = n * mib * 2**20 / 1e9
    steady = (n - 1) * mib * 2**20 / 1e9 / (end - first)  # after the first payload: startup excluded
    return {"first_s": first - t0, "gb_s": steady, "cpu_per_gb": cpu / gb, "plasma_mib": plasma.peak}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--total-mib", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--free-period-ms", type=int, help="Ray's free_objects_period_milliseconds (default 1000)")
    args = ap.parse_args()
    header()
    import logging

    system = {"free_objects_period_milliseconds": args.free_period_ms} if args.free_period_ms else None
    ray.init(include_dashboard=False, logging_level=logging.ERROR, _system_config=system)
    ray.data.DataContext.get_current().enable_progress_bars = False
    print(f"ray {ray.__version__}, {psutil.cpu_count()} CPUs, 2 producer actors, {args.total_mib} MiB per run, "
          f"median of {args.repeats} interleaved runs, free_objects_period_milliseconds "
          f"{args.free_period_ms or '1000 (default)'}")
    print(f"{'design':10s} {'unit MiB':>8s} {'units':>6s} {'first s':>8s} {'GB/s':>6s} {'CPU s/GB':>9s} "
          f"{'peak plasma MiB':>15s}")
    for mib in args.mib:
        n = max(4, args.total_mib // mib)
        runs = {"queue": [], "ray-data": []}
        for _ in range(args.repeats):
            for design in runs:
                runs[design].append(one(design, mib, n))
        for design, rs in runs.items():
            med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
            print(f"{design:10s} {mib:8d} {n:6d} {med['first_s']:8.2f} {med['gb_s']:6.2f} {med['cpu_per_gb']:9.2f} "
                  f"{med['plasma_mib']:15.0f}")
    ray.shutdown()


if __name__ == "__main__":
    main()
