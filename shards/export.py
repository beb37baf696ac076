"""Export a run into the per-sample files other drafter trainers read (``capture export``).

Sample ``i`` is the i-th row of the run in manifest order (after the ``split`` filter); ``export.json``
in the output folder maps every index to its ``sample_id`` and records the layer conventions below.

**speculators** (vllm-project/speculators, ``speculators.train.data.ArrowDataset``; checked against its
``src/speculators/train/data.py`` and ``data_generation/offline.py``): ``OUT`` is a Hugging Face dataset
(``datasets.Dataset.save_to_disk``: ``input_ids`` int64 [T], ``loss_mask`` bool [T], ``seq_len``,
``sample_id``) and ``OUT/hidden_states/hs_{i}.safetensors`` holds ``token_ids`` int64 [T] and
``hidden_states`` [T, n, H] (the run's dtype, bf16), n = taps + 1: slots 0..L-1 are the taps in header
order, slot L the final state. speculators trains on ``hidden_states[:, :-1]`` flattened (the aux
states) and ``hidden_states[:, -1]`` (``verifier_last_hidden_states``). Its vLLM generator fills the
slots with vLLM aux layer ids, where id i+1 is the output of decoder layer i (this project's tap i) and
the last id L is the final state *before* the norm; a run stored with ``--final post-norm`` gives the
post-norm state in the last slot (recorded in ``export.json``).

**specforge** (sgl-project/SpecForge, ``scripts/prepare_hidden_states.py`` and
``specforge/data/preprocessing.py``): ``OUT/rows_{g}-{g+2000}/data_{i}.ckpt``, one ``torch.save`` dict
per sample: ``input_ids`` int64 [T], ``loss_mask`` int64 [T] (0/1), ``aux_hidden_state`` [1, T, L*H] (the
taps concatenated along the last dimension in header order: columns ``l*H:(l+1)*H`` are tap l) and
``hidden_state`` [1, T, H] (the final state, which SpecForge captures after the final norm, as HF's
``hidden_states[-1]``; a ``--final pre-norm`` run is exported as stored and recorded so).

Tap k is the output of 0-based decoder layer k, HF ``hidden_states[k+1]``, vLLM aux id k+1. Both formats
need the final state: a run without a ``final`` column is refused (``capture run --final post-norm``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from capture.errors import CaptureError
from shards.run import Location, as_location
from shards.stream import ShardStream

FORMATS = ("specforge", "speculators")
SPECFORGE_GROUP = 2000  # SpecForge's file_group_size: data_{i} lives in rows_{g}-{g+2000}


def export(run: str | os.PathLike | Location, out: str | os.PathLike, fmt: str, *, split: str = "all",
           heldout_fraction: float = 0.01, progress: bool = False) -> dict:
    """Write the run's samples (``split``: ``train``/``heldout``/``all``, see :func:`shards.stream.in_split`)
    into the local folder ``out`` in format ``fmt`` (module docstring); ``run`` is a path, a URI or a Location. Returns ``{"format", "samples", "tokens", "out"}``.

    Raises CaptureError for an unknown format, a run without a final state, or an ``out`` that exists and
    is not empty (nothing is overwritten).
    """
    if fmt not in FORMATS:
        raise CaptureError(f"unknown export format {fmt!r}; one of {', '.join(FORMATS)}")
    loc = as_location(run)
    stream = ShardStream(loc, split=split, heldout_fraction=heldout_fraction)
    if stream.final_kind is None:
        raise CaptureError(f"{fmt} files need the final state, which run {run} did not store; "
                           "capture with --final post-norm")
    if len(stream) == 0:
        raise CaptureError(f"run {run} has no committed samples in split {split!r}; nothing to export")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CaptureError(f"{out} exists and is not empty; export into a new folder")
    if loc.contains(out):
        raise CaptureError(f"{out} is inside the run folder {run}; export into a folder outside it")
    out.mkdir(parents=True, exist_ok=True)

    write = _specforge if fmt == "specforge" else _speculators
    ids, tokens, rows = [], 0, []
    for i, sample in enumerate(tqdm(stream, total=len(stream), disable=not progress, unit="sample")):
        rows.append(write(out, i, sample))
        ids.append(sample["sample_id"])
        tokens += len(sample["input_ids"])
    if fmt == "speculators":
        import datasets

        columns = {k: [r[k] for r in rows] for k in ("input_ids", "loss_mask", "seq_len", "sample_id")}
        features = datasets.Features({"input_ids": datasets.Sequence(datasets.Value("int64")),
                                      "loss_mask": datasets.Sequence(datasets.Value("bool")),
                                      "seq_len": datasets.Value("int64"), "sample_id": datasets.Value("string")})
        bars = datasets.utils.is_progress_bar_enabled()
        if not progress:
            datasets.utils.disable_progress_bars()
        try:
            datasets.Dataset.from_dict(columns, features=features).save_to_disk(str(out))
        finally:
            if bars:
                datasets.utils.enable_progress_bars()
    layers = list(stream.taps_layers)
    record = {
        "format": fmt, "run": str(run), "split": split, "heldout_fraction": heldout_fraction,
        "samples": len(ids), "tokens": tokens, "sample_ids": ids, "dtype": stream.header.dtype,
        "hidden_size": stream.header.hidden_size,
        "taps": [{"slot": i, "tap": k, "decoder_layer": k, "hf_hidden_states_index": k + 1, "vllm_aux_layer_id": k + 1}
                 for i, k in enumerate(layers)],
        "final": stream.final_kind,
        "convention": "tap k = output of 0-based decoder layer k (before the final norm); "
                      + ("speculators hidden_states[:, :L] = taps in this order, [:, L] = final state"
                         if fmt == "speculators" else
                         "specforge aux_hidden_state[..., l*H:(l+1)*H] = tap l of this list, hidden_state = final state"),
    }
    (out / "export.json").write_text(json.dumps(record, indent=1) + "\n")
    return {"format": fmt, "samples": len(ids), "tokens": tokens, "out": str(out)}


def _speculators(out: Path, i: int, sample: dict) -> dict:
    folder = out / "hidden_states"
    folder.mkdir(exist_ok=True)
    states = torch.cat([sample["taps"], sample["final"][:, None]], dim=1)  # [T, L+1, H]
    save_file({"token_ids": sample["input_ids"], "hidden_states": states.contiguous()},
              str(folder / f"hs_{i}.safetensors"))
    return {"input_ids": sample["input_ids"].tolist(), "loss_mask": sample["loss_mask"].tolist(),
            "seq_len": len(sample["input_ids"]), "sample_id": sample["sample_id"]}


def _specforge(out: Path, i: int, sample: dict) -> dict:
    g = i // SPECFORGE_GROUP * SPECFORGE_GROUP
    folder = out / f"rows_{g}-{g + SPECFORGE_GROUP}"
    folder.mkdir(exist_ok=True)
    taps = sample["taps"]
    record = {
        "input_ids": sample["input_ids"],
        "loss_mask": sample["loss_mask"].long(),
        "aux_hidden_state": taps.reshape(1, taps.shape[0], -1).contiguous(),  # [1, T, L*H]
        "hidden_state": sample["final"][None].contiguous(),  # [1, T, H]
    }
    torch.save(record, folder / f"data_{i}.ckpt")
    return {}
