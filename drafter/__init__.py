"""A small DFlash block drafter trained on capture runs, streamed, and its offline score.

Modules: :mod:`drafter.data` (shard rows → per-conversation tensors, streamed; held-out sets kept disjoint
from training; the drafter's only door to ``shards.stream``), :mod:`drafter.blocks` (anchors, block
labels, padded batches), :mod:`drafter.model` (the drafter), :mod:`drafter.metrics` (acceptance length,
bigram baseline), :mod:`drafter.config` (:class:`TrainConfig`), :mod:`drafter.train` (the training loop:
offline runs, ranks, resume), :mod:`drafter.live` (training while the capture runs: online or followed),
:mod:`drafter.evaluate` (held-out scores), :mod:`drafter.checkpoint` (the trained drafter's files and
the training checkpoints).
"""

from drafter.checkpoint import load as load_checkpoint
from drafter.config import TrainConfig
from drafter.data import heldout, load_samples
from drafter.metrics import acceptance_length
from drafter.train import evaluate_checkpoint, train

__all__ = ["TrainConfig", "heldout", "load_samples", "acceptance_length", "train", "load_checkpoint",
           "evaluate_checkpoint"]
