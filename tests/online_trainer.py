"""A stand-in trainer for tests/test_online.py: starts an online capture (capture.online) of the first
``--limit`` rows of a dataset, reads its rank-0 stream, acks after every ``--ack-every`` samples, and prints
one JSON line per sample (id and the SHA-256 of its taps, final and argmax bytes), then the capture's summary.
``--crash-after K``: exit hard (os._exit, no cleanup) right after the ack that covers K samples: a trainer
killed after its checkpoint. ``--world-size W``: the capture serves W ranks; this process reads rank 0.
``--attach R``: start nothing; attach to the online run capturing into ``--out`` (shards.online.attach) and
read rank R, in this process or, with ``--workers N``, in N spawned DataLoader workers (each sample line
then names the worker process's pid)."""

import argparse
import hashlib
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from torch.utils.data import DataLoader  # noqa: E402

from capture import online  # noqa: E402
from capture.config import from_mapping  # noqa: E402
from common.errors import CaptureError  # noqa: E402
from shards.online import attach  # noqa: E402


def digest(sample: dict) -> str:
    h = hashlib.sha256()
    for key in ("input_ids", "taps", "final", "argmax"):
        t = sample[key].contiguous()
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.dtype.is_floating_point else t.numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--limit", type=int, required=True)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--ack-every", type=int, default=1)
    ap.add_argument("--crash-after", type=int)
    ap.add_argument("--keep", action="store_true", help="also commit every row to shards (a tee)")
    ap.add_argument("--regenerate", type=int, help="self-distillation: the last answer regenerated, at most N tokens")
    ap.add_argument("--world-size", type=int, default=1)
    ap.add_argument("--attach", type=int, metavar="RANK", help="read this rank of a run another process started")
    ap.add_argument("--workers", type=int, default=0, help="with --attach: DataLoader workers (spawned)")
    ap.add_argument("--ray-address", help="a running Ray cluster (default: a local one of its own)")
    ap.add_argument("--disk-reserve", help="the capture's --disk-reserve (e.g. 0 on a small test disk)")
    ap.add_argument("--try-fork", action="store_true", help="first try a forked DataLoader worker (refused)")
    args = ap.parse_args()
    if args.attach is not None:
        return read_attached(args)
    regenerate = {"responses": "regenerate", "max_new_tokens": args.regenerate} if args.regenerate else {}
    cfg = from_mapping({"target": "smollm2-135m", "dataset": args.dataset, "layers": "3,15", "final": "post-norm",
                        "limit": args.limit, "max_tokens": 256, "overlength": "truncate", "replicas": args.replicas,
                        "cpus_per_replica": 1, "unit_tokens": 600, "out": args.out, "progress": False, **regenerate,
                        **({"ray_address": args.ray_address} if args.ray_address else {}),
                        **({"disk_reserve": args.disk_reserve} if args.disk_reserve else {})})
    run = online.start(cfg, world_size=args.world_size, keep=args.keep)
    stream = run.stream(0, timeout_s=300)
    if args.try_fork:  # a forked DataLoader worker of this Ray-connected process: refused before it takes a unit
        try:
            next(iter(DataLoader(stream, batch_size=None, num_workers=1, multiprocessing_context="fork")))
        except CaptureError as e:  # torch re-raises the worker's exception type with its traceback text
            print(json.dumps({"fork_refused": str(e).strip().splitlines()[-1]}), flush=True)
    pending = []
    for n, sample in enumerate(stream, 1):
        print(json.dumps({"id": sample["sample_id"], "sha": digest(sample),
                          "loss_tokens": int(sample["loss_mask"].sum())}), flush=True)
        pending.append(sample["sample_id"])
        if len(pending) == args.ack_every:
            stream.ack(pending)  # (a real trainer saves its checkpoint first)
            pending = []
            if args.crash_after is not None and n >= args.crash_after:
                os._exit(3)
    if pending:
        stream.ack(pending)
    summary = run.join()
    run.close(wait_s=300)  # ranks in other processes may still be reading (--world-size)
    print(json.dumps({"summary": summary, "wait_seconds": stream.wait_seconds}), flush=True)


class WithPid(torch.utils.data.IterableDataset):
    """The stream's samples, each with the pid of the process that decoded it."""

    def __init__(self, stream):
        self.stream = stream

    def __iter__(self):
        for sample in self.stream:
            yield {**sample, "pid": os.getpid()}


def read_attached(args) -> None:
    stream = attach(args.out, args.attach, wait_s=300, timeout_s=300)
    samples = DataLoader(WithPid(stream), batch_size=None, num_workers=args.workers,
                         multiprocessing_context="spawn" if args.workers else None)
    ids = []
    for sample in samples:
        print(json.dumps({"id": sample["sample_id"], "sha": digest(sample), "pid": int(sample["pid"])}), flush=True)
        ids.append(sample["sample_id"])
    stream.ack(ids)
    print(json.dumps({"attached": args.attach, "rows": len(ids)}), flush=True)


if __name__ == "__main__":
    main()
