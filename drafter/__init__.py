"""A small DFlash block drafter trained on capture runs, and its offline score.

Modules: :mod:`drafter.data` (shard rows → per-conversation tensors, held-out sets kept disjoint from
training; the drafter's only door to ``shards.stream``), :mod:`drafter.blocks` (anchors, block labels,
padded batches), :mod:`drafter.model` (the drafter), :mod:`drafter.metrics` (acceptance length, bigram
baseline), :mod:`drafter.config` (:class:`TrainConfig`), :mod:`drafter.train` (training, evaluation,
checkpoints).
"""

from drafter.config import TrainConfig
from drafter.data import heldout, load_samples
from drafter.metrics import acceptance_length
from drafter.train import evaluate_checkpoint, load_checkpoint, load_data, train

__all__ = ["TrainConfig", "heldout", "load_samples", "acceptance_length", "train", "load_data",
           "load_checkpoint", "evaluate_checkpoint"]
