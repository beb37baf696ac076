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


def check_trainer(folder: str, aux_layer_ids, target_model_path: str | None) -> None:
    """Refuse, in one line, a SpecForge config that does not fit the stub folder ``folder`` (a ``capture export
    --format specforge --no-states``): ``model.aux_hidden_state_layer_ids`` other than the stubs' taps
    (SGLang ids k), or a target whose tokenizer is not the run's (:func:`common.hashing.tokenizer_sha256`). A
    folder that holds no stubs (exported files) is not this shim's business."""
    import json
    import os

    from shards import manifest as manifest_mod

    try:
        record = json.loads(open(os.path.join(folder, "export.json")).read())
    except (OSError, ValueError):
        return
    plan = record.get("states")
    if record.get("format") != "specforge" or not isinstance(plan, dict):
        return
    if aux_layer_ids and list(aux_layer_ids) != plan["aux"]:
        raise CaptureError(f"model.aux_hidden_state_layer_ids {list(aux_layer_ids)} but the stubs in {folder} hold "
                           f"the run's taps {plan['aux']} (SGLang ids); train with those or export other --layers")
    if target_model_path and os.path.isdir(target_model_path):
        from transformers import AutoTokenizer

        from common.hashing import tokenizer_sha256

        header = manifest_mod.read(plan["in_place"]).header
        found = tokenizer_sha256(AutoTokenizer.from_pretrained(target_model_path))
        if found != header.tokenizer_sha256:
            raise CaptureError(f"the target {target_model_path} has another tokenizer (sha256 {found[:12]}) than the "
                               f"run {plan['in_place']} was captured with ({header.tokenizer_sha256[:12]})")


def main(argv: list[str] | None = None) -> int:
    """The ``specforge`` command with :func:`install` done first; ``specforge train -c CONFIG`` is first
    checked against the stubs its ``data.hidden_states_path`` names (:func:`check_trainer`; one line, exit 2)."""
    argv = sys.argv[1:] if argv is None else argv
    install()
    from specforge.cli import main as specforge_main

    if argv[:1] == ["train"]:
        import argparse

        from specforge.config.schema import load_config

        known = argparse.ArgumentParser(add_help=False)
        known.add_argument("-c", "--config")
        known.add_argument("overrides", nargs="*")
        args, _ = known.parse_known_args(argv[1:])
        if args.config:
            config = load_config(args.config, [o for o in args.overrides if "=" in o])
            try:
                check_trainer(config.data.hidden_states_path, config.model.aux_hidden_state_layer_ids,
                              config.model.target_model_path)
            except CaptureError as e:
                print(f"error: {e}", file=sys.stderr)
                return 2
    return specforge_main(argv)


if __name__ == "__main__":
    sys.exit(main())
