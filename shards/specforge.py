"""SpecForge (SGLang's drafter trainer, 0.2) reads a run in place, through stub files and a small shim.

SpecForge's offline path takes only a folder of per-sample ``.ckpt`` files: its ``OfflineManifestReader``
lists them and its ``LocalFeatureStore`` loads each, in the loader's prefetch threads, with
``specforge.runtime.data_plane.feature_store.load_feature_file``. There is no dataset class or backend to
hand it, so the smallest shim is at that one function:

* ``capture export RUN OUT --format specforge --no-states`` writes the folder SpecForge expects, with a
  ~300-byte stub in place of each ``data_{i}.ckpt`` (``{"capture_in_place": {run, sample_id, aux,
  final_from}}``);
* :func:`install` wraps ``load_feature_file`` (where SpecForge's modules bound it) so that a stub loads as
  the full sample, decoded from the run: exactly the tensors ``capture export --format specforge`` writes
  in that file (:func:`sample`); any other file loads as before;
* ``python -m shards.specforge ARGS`` is the ``specforge`` command with the shim installed.

A shim on another project's function: it holds for specforge 0.2 (the version tests/test_export.py loads);
:func:`install` refuses in one line when the function is not where it was.
"""

from __future__ import annotations

import functools
import sys

import torch

from common.errors import CaptureError
from shards.export import STUB_KEY
from shards.reader import SampleIndex
from shards.rows import state_tensor

MODULES = ("specforge.runtime.data_plane.feature_store", "specforge.runtime.data_plane.offline_reader",
           "specforge.runtime.data_plane.disagg_ingest", "specforge.runtime.data_plane.disaggregated")


def sample(stub: dict, index: SampleIndex) -> dict[str, torch.Tensor]:
    """The SpecForge sample a stub stands for: ``input_ids`` int64 [T], ``loss_mask`` int64 [T],
    ``aux_hidden_state`` [1, T, L*H] (the taps in order), ``hidden_states`` [T, L*H] (the same storage, for
    DFlash), ``hidden_state`` [1, T, H] (the post-norm final state), in the run's dtype."""
    table, row = index.row(stub["sample_id"])
    aux = torch.stack([state_tensor(table, f"tap_{k}", row) for k in stub["aux"]], dim=1)  # [T, L, H]
    flat = aux.reshape(1, aux.shape[0], -1)
    column = table.column
    return {
        "input_ids": torch.from_numpy(column("input_ids")[row].values.to_numpy(zero_copy_only=False).astype("int64")),
        "loss_mask": torch.from_numpy(column("loss_mask")[row].values.to_numpy(zero_copy_only=False).astype("int64")),
        "aux_hidden_state": flat,
        "hidden_states": flat[0],
        "hidden_state": state_tensor(table, stub["final_from"], row)[None],
    }


def install() -> None:
    """Make SpecForge's ``load_feature_file`` load stubs as their samples (idempotent). Raises CaptureError
    when specforge is not installed or its function moved (another version than this shim knows)."""
    import importlib

    try:
        store = importlib.import_module(MODULES[0])
        original = store.load_feature_file
    except (ImportError, AttributeError) as e:
        raise CaptureError(f"specforge 0.2's feature_store.load_feature_file is not there ({e}); this shim "
                           "knows specforge 0.2: export the files instead (capture export --format specforge)") from None
    if getattr(original, "capture_shim", False):
        return
    indexes: dict[str, SampleIndex] = {}  # run → its index, made on first use in this process

    @functools.wraps(original)
    def load_feature_file(path: str) -> dict:
        raw = original(path)
        if not (isinstance(raw, dict) and STUB_KEY in raw):
            return raw
        stub = raw[STUB_KEY]
        index = indexes.get(stub["run"])
        if index is None:
            index = indexes[stub["run"]] = SampleIndex(stub["run"], [stub["sample_id"]])
        return sample(stub, index)

    load_feature_file.capture_shim = True
    for name in MODULES:
        module = importlib.import_module(name)
        if hasattr(module, "load_feature_file"):
            module.load_feature_file = load_feature_file


def main() -> int:
    """The ``specforge`` command with :func:`install` done first."""
    install()
    from specforge.cli import main as specforge_main

    return specforge_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
