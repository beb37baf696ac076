"""speculators (vLLM's drafter trainer, 0.9) reads a run in place: no state files, no raw-size copy.

speculators' ``ArrowDataset`` reads two things: a Hugging Face dataset of token ids and loss masks (small)
and, per sample ``i``, the states through a *hidden-states backend* (``hs_connectors.HiddenStatesBackend``,
chosen by ``--hidden-states-backend``; ``file`` reads ``hs_{i}.safetensors``). This module registers a
backend named ``capture`` whose transfer (:class:`RunTransfer`) decodes sample ``i``'s states from the run's
shards, in any codec, when the DataLoader asks for it, and hands back exactly what the ``file`` backend
reads from ``capture export --format speculators``'s files: ``token_ids`` int64 ``[T]`` and
``hidden_states`` ``[T, n, H]`` in the run's dtype, the aux taps in order then the **pre-norm** final state
(speculators applies its verifier's final norm itself; see :mod:`shards.export`).

Use (the index is ``capture export --no-states``: the dataset and ``export.json``, which names the run)::

    capture export runs/a idx --format speculators --no-states
    torchrun -m shards.speculators config.yaml --data-path idx --hidden-states-backend capture

``python -m shards.speculators`` is ``python -m speculators.train`` with the backend registered first
(speculators collects every backend's flags when its config module is imported). Rank-aware and resumable
as speculators' own loader is (the transfer is indexed by sample, stateless). Refused in one line before
training: an index whose run is gone or changed since the index was written (other shards), a
``--target-layer-ids`` other than the index's taps, a verifier whose tokenizer is not the run's.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch
from hs_connectors import HiddenStatesBackend, HiddenStatesTransfer

from common.errors import CaptureError
from shards import manifest as manifest_mod
from shards.reader import SampleIndex
from shards.rows import state_tensor

BACKEND = "capture"


class RunTransfer(HiddenStatesTransfer):
    """Sample ``i`` of the index folder ``index`` (``capture export --format speculators --no-states``),
    decoded from the run its ``export.json`` names. ``open_shards``: shard tables kept open per process."""

    def __init__(self, index: str | os.PathLike, open_shards: int = 4):
        try:
            record = json.loads((Path(index) / "export.json").read_text())
        except (OSError, ValueError) as e:
            raise CaptureError(f"{index}: no readable export.json ({e}); make the index with `capture export RUN "
                               f"{index} --format speculators --no-states`") from None
        plan = record.get("states")
        if record.get("format") != "speculators" or not isinstance(plan, dict):
            raise CaptureError(f"{index} is not a speculators index that reads a run in place; make it with "
                               f"`capture export RUN {index} --format speculators --no-states`")
        self.run, self.sample_ids = plan["in_place"], record["sample_ids"]
        self.columns = [f"tap_{k}" for k in plan["aux"]] + [plan["final_from"]]
        self.target_layer_ids = record["trainers"]["speculators"]["target_layer_ids"]
        self.open_shards = open_shards
        self.rows: SampleIndex | None = None
        self.setup()

    def setup(self) -> None:
        """Map every sample id to its shard and row (the manifest; no state is read). Raises CaptureError
        when the run lacks a sample of the index (gone, repaired or another run since)."""
        if self.rows is None:
            self.rows = SampleIndex(self.run, self.sample_ids, self.open_shards)

    def get_cached(self, file_idx: int) -> dict[str, torch.Tensor]:
        """``{"token_ids": int64 [T], "hidden_states": [T, n, H]}`` of sample ``file_idx`` (module docstring)."""
        table, row = self.rows.row(self.sample_ids[file_idx])
        states = torch.stack([state_tensor(table, c, row) for c in self.columns], dim=1)
        ids = torch.from_numpy(table.column("input_ids")[row].values.to_numpy(zero_copy_only=False).astype("int64"))
        return {"token_ids": ids, "hidden_states": states}

    def get_generated(self, hs_transfer_params: dict[str, Any]) -> dict[str, torch.Tensor] | None:
        raise CaptureError("the capture backend reads states a run holds; it cannot ask vLLM for new ones "
                           "(speculators' --on-missing generate): use --on-missing raise")


@HiddenStatesBackend.register(BACKEND)
class CaptureBackend(HiddenStatesBackend):
    """speculators' ``--hidden-states-backend capture``: :class:`RunTransfer` over ``--data-path`` (the index)."""

    @staticmethod
    def add_train_args(parser: argparse.ArgumentParser) -> None:
        """No flag of its own: the index (``--data-path``) names the run."""

    @staticmethod
    def add_launch_args(parser: argparse.ArgumentParser) -> None:
        """Nothing to launch: the states are in the run."""

    @staticmethod
    def from_train_args(args: argparse.Namespace, data_path: str) -> RunTransfer:
        transfer = RunTransfer(data_path)
        check_trainer(transfer, getattr(args, "target_layer_ids", None), getattr(args, "verifier_name_or_path", None))
        return transfer

    @staticmethod
    def build_kv_transfer_config(args: argparse.Namespace) -> dict[str, Any]:
        raise CaptureError("the capture backend is for training from a run; capture with `capture run`")


def check_trainer(transfer: RunTransfer, target_layer_ids, verifier: str | None) -> None:
    """Refuse, in one line, a trainer whose ``--target-layer-ids`` are not the index's taps (vLLM ids k+1) or
    whose verifier's tokenizer is not the run's (:func:`common.hashing.tokenizer_sha256`)."""
    if target_layer_ids and list(target_layer_ids) != transfer.target_layer_ids:
        raise CaptureError(f"--target-layer-ids {list(target_layer_ids)} but the index holds the run's taps as vLLM "
                           f"ids {transfer.target_layer_ids}; train with those or export other --layers")
    if verifier and os.path.isdir(verifier):
        from transformers import AutoTokenizer

        from common.hashing import tokenizer_sha256

        header = manifest_mod.read(transfer.run).header
        found = tokenizer_sha256(AutoTokenizer.from_pretrained(verifier))
        if found != header.tokenizer_sha256:
            raise CaptureError(f"the verifier {verifier} has another tokenizer (sha256 {found[:12]}) than the run "
                               f"{transfer.run} was captured with ({header.tokenizer_sha256[:12]})")


def main() -> None:
    """``python -m speculators.train`` with the ``capture`` backend registered."""
    from speculators.train.cli import main as train
    from speculators.train.config import TrainConfig

    train(TrainConfig.resolve())


if __name__ == "__main__":
    main()
