"""Export a run into the per-sample files other drafter trainers read (``capture export``).

Sample ``i`` is the i-th row of the run in manifest order (after the ``split`` filter); ``export.json``
in the output folder maps every index to its ``sample_id`` and records every convention below, with the
layer ids and command-line values each trainer wants (``trainers``).

Tap k is the output of 0-based decoder layer k: HF ``hidden_states[k+1]``, vLLM aux layer id ``k+1``,
SGLang/SpecForge layer id ``k`` (SGLang captures the input of layer k+1). Each format follows its
trainer's convention for the final state, checked against the released packages (tests/test_export.py
loads the files with them and reproduces the stored ``argmax`` from their teacher logits):

**speculators** 0.9 (``speculators.train.data.ArrowDataset``): ``OUT`` is a Hugging Face dataset saved
with the torch format (``input_ids`` int64 [T], ``loss_mask`` bool [T], ``seq_len``, ``sample_id``;
speculators compares ``input_ids`` with ``torch.equal``, so it must load as tensors) and
``OUT/hidden_states/hs_{i}.safetensors`` holds ``token_ids`` int64 [T] and ``hidden_states`` [T, n, H]
(the run's dtype): slots 0..n-2 are the aux taps in order, slot n-1 the **pre-norm** final state (the
output of the last decoder layer, vLLM aux id L). speculators' trainer takes ``hidden_states[:, :-1]``
flattened as the drafter input and builds its teacher as ``verifier_lm_head(verifier_norm(slot n-1))``:
it applies the final norm itself, so a post-norm state there would be normed twice. The pre-norm state
comes from the run's ``final`` column when captured ``--final pre-norm``, else from a tap at layer L-1
(then not repeated among the aux slots unless ``layers`` names it); a run with neither is refused.
Train with ``--target-layer-ids`` = the aux taps' vLLM ids (``trainers.speculators.target_layer_ids``).

**specforge** 0.2 (``specforge.data.preprocessing.process_offline_eagle3_sample`` and
``process_offline_dflash_sample``, read by its ``OfflineManifestReader``):
``OUT/rows_{g}-{g+2000}/data_{i}.ckpt``, one ``torch.save`` dict per sample: ``input_ids`` int64 [T],
``loss_mask`` int64 [T] (0/1), ``aux_hidden_state`` [1, T, L*H] (the taps concatenated along the last
dimension in order: columns ``l*H:(l+1)*H`` are tap l), ``hidden_state`` [1, T, H] and, for its DFlash
and DSpark readers, ``hidden_states`` [T, L*H] (a view of the same storage: no extra bytes on disk).
SpecForge's EAGLE-3 teacher is its ``TargetHead``, the lm_head alone, over ``hidden_state``: that must be
the **post-norm** final state (``--final post-norm``); a run without it is refused. SpecForge's EAGLE-3
draft takes exactly 3 aux layers: another count is exported with a warning (DFlash takes any number);
pick three with ``layers``.

**Top-K log-probabilities** (``--topk K`` runs) are not exported: neither format has a place for them.
speculators' ``ArrowDataset`` reads ``token_ids`` and ``hidden_states`` from each file and its trainer
derives the teacher from the last slot; SpecForge's offline readers read ``input_ids``, ``loss_mask``,
``aux_hidden_state`` / ``hidden_state`` / ``hidden_states`` (its DFlash reader's docstring: "there is no
target distribution"; its online runtime's full-vocabulary ``logits`` are not read offline). Writing
extra keys neither reads would only cost disk, so ``export.json`` records ``topk`` with
``"exported": false`` and why; read them from the run (:class:`shards.stream.ShardStream`).
"""

from __future__ import annotations

import errno
import functools
import io
import json
import os
import shutil
from pathlib import Path
from typing import Sequence

import torch
from safetensors.torch import save
from tqdm import tqdm

from common.errors import CaptureError
from shards import manifest as manifest_mod
from shards.format import FINAL, tap_column, tap_layer
from shards.run import Location, as_location
from shards.stream import ShardStream

FORMATS = ("specforge", "speculators")
SPECFORGE_GROUP = 2000  # SpecForge's file_group_size: data_{i} lives in rows_{g}-{g+2000}
SPECFORGE_EAGLE3_TAPS = 3  # LlamaForCausalLMEagle3's fc takes target_hidden_size * 3
STUB_KEY = "capture_in_place"  # a specforge stub file's one key (shards.specforge)


def export(run: str | os.PathLike | Location, out: str | os.PathLike, fmt: str, *, split: str = "all",
           heldout_fraction: float = 0.01, layers: Sequence[int] | None = None, progress: bool = False,
           states: bool = True) -> dict:
    """Write the run's samples (``split``: ``train``/``heldout``/``all``, see :func:`shards.stream.in_split`)
    into the local folder ``out`` in format ``fmt`` (module docstring); ``run`` is a path, a URI or a
    Location; ``layers``: the taps to export as aux states, in that order (default: every tap, less the
    one speculators' last slot takes). Returns ``{"format", "samples", "tokens", "out", "warnings", "trainers"}``.

    ``states=False``: no state file, the run is read in place. speculators: the index alone (the Hugging
    Face dataset and ``export.json``, which names the run), read through the ``capture`` hidden-states
    backend (:mod:`shards.speculators`); specforge: a ~300-byte stub per sample where its file goes, which
    :mod:`shards.specforge`'s shim loads as the full sample.

    Raises CaptureError for an unknown format, a run without the final state the format's trainer needs
    (speculators: pre-norm, specforge: post-norm), a tap the run lacks or named twice, an empty split, or an ``out``
    that exists and is not empty (nothing is overwritten).
    """
    if fmt not in FORMATS:
        raise CaptureError(f"unknown export format {fmt!r}; one of {', '.join(FORMATS)}")
    loc = as_location(run)
    head = ShardStream(loc, split=split, heldout_fraction=heldout_fraction).header  # refuses a folder without a run
    num_layers = int(head.target.get("num_layers") or 0)
    taps = list(head.tap_layers)
    if layers is not None:
        head.layout.columns_for(layers)  # CaptureError for a tap the run lacks
    if layers is not None and len(set(layers)) != len(layers):
        raise CaptureError(f"--layers names a tap twice: {list(layers)}")

    if fmt == "speculators":
        final_from, aux = _speculators_plan(run, head.final_kind, taps, num_layers, layers)
    else:
        if head.final_kind != "post-norm":
            raise CaptureError(
                f"specforge files need the post-norm final state (SpecForge's EAGLE-3 teacher is lm_head alone "
                f"over hidden_state); run {run} stored {head.final_kind or 'no final state'}: "
                "capture with --final post-norm")
        final_from, aux = FINAL, list(layers) if layers is not None else taps
    if not aux:
        raise CaptureError(f"run {run} has no tap left to export as aux states (taps {taps})")
    warnings = []
    if fmt == "specforge" and len(aux) != SPECFORGE_EAGLE3_TAPS:
        warnings.append(f"SpecForge's EAGLE-3 draft takes exactly {SPECFORGE_EAGLE3_TAPS} aux layers; this export "
                        f"has {len(aux)} (taps {aux}): EAGLE-3 cannot train on it, DFlash can; "
                        "pick three with --layers")

    final_tap = tap_layer(final_from)  # None: the final column
    wanted = sorted(set(aux) | ({final_tap} if final_tap is not None else set()))
    stream = ShardStream(loc, split=split, heldout_fraction=heldout_fraction, layers=wanted if states else wanted[:1],
                         final=final_tap is None and states, topk=False)  # an index decodes one tap, unused
    if len(stream) == 0:
        raise CaptureError(f"run {run} has no committed samples in split {split!r}; nothing to export")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CaptureError(f"{out} exists and is not empty; export into a new folder")
    if loc.contains(out):
        raise CaptureError(f"{out} is inside the run folder {run}; export into a folder outside it")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CaptureError(f"cannot create {out}: {e.strerror}") from None

    aux_slots = [wanted.index(k) for k in aux]
    final_slot = None if final_tap is None else wanted.index(final_tap)
    if states:
        write = _specforge if fmt == "specforge" else _speculators
    else:
        plan = {"run": str(loc.absolute()), "aux": list(aux), "final_from": final_from}
        write = functools.partial(_specforge_stub, plan) if fmt == "specforge" else _speculators_index
    ids, tokens, rows = [], 0, []
    try:
        for i, sample in enumerate(tqdm(stream, total=len(stream), disable=not progress, unit="sample")):
            aux_states = sample["taps"][:, aux_slots] if states else None  # [T, L, H]
            final = None if not states else sample["final"] if final_slot is None else sample["taps"][:, final_slot]
            rows.append(write(out, i, sample, aux_states, final))  # final: [T, H]
            ids.append(sample["sample_id"])
            tokens += len(sample["input_ids"])
        if fmt == "speculators":
            _save_dataset(out, rows, progress)
        record = {
            "format": fmt, "run": str(run), "split": split, "heldout_fraction": heldout_fraction,
            "samples": len(ids), "tokens": tokens, "sample_ids": ids, "dtype": head.dtype,
            "hidden_size": head.hidden_size, "num_layers": num_layers,
            "taps": [{"slot": i, "tap": k, "decoder_layer": k, "hf_hidden_states_index": k + 1,
                      "vllm_aux_layer_id": k + 1, "sglang_layer_id": k} for i, k in enumerate(aux)],
            "final": {"kind": "pre-norm" if fmt == "speculators" else "post-norm", "from": final_from},
            "convention": _convention(fmt, len(aux)),
            "trainers": _trainers(fmt, aux, num_layers),
            "warnings": warnings,
            "states": "files" if states else {"in_place": str(loc.absolute()), "aux": aux, "final_from": final_from},
        }
        if head.topk:
            record["topk"] = {"stored": head.topk, "exported": False,
                              "why": f"{fmt}'s offline format has no place for top-K teacher log-probabilities; read "
                                     "topk_ids / topk_logprobs from the run with shards.stream.ShardStream"}
        (out / "export.json").write_text(json.dumps(record, indent=1) + "\n")
    except OSError as e:  # the per-sample files are written by Python's own writes (_write_file): ENOSPC
        if e.errno != errno.ENOSPC:
            raise
        shutil.rmtree(out, ignore_errors=True)  # a folder this call made (or found empty): only its own files
        need = manifest_mod.read(loc).tokens * (len(aux) + 1) * head.hidden_size * torch.finfo(
            getattr(torch, head.dtype)).bits // 8
        raise CaptureError(f"the disk at {out} is full ({e.strerror}) after {len(ids)} of {len(stream)} samples: the "
                           f"partial export was removed; it needs about {_size(need)} (the run's tokens x "
                           f"{len(aux) + 1} states x {head.hidden_size} x {head.dtype}); free that much and rerun, "
                           "or read the run in place (docs/reading.md)") from None
    return {"format": fmt, "samples": len(ids), "tokens": tokens, "out": str(out), "warnings": warnings,
            "trainers": record["trainers"]}


def _speculators_plan(run, final_kind: str | None, taps: list[int], num_layers: int,
                      layers: Sequence[int] | None) -> tuple[str, list[int]]:
    """(where the pre-norm final state comes from: ``final`` or ``tap_<L-1>``, the aux taps)."""
    last = num_layers - 1
    if final_kind == "pre-norm":
        source = FINAL
    elif last in taps:
        source = tap_column(last)
    else:
        raise CaptureError(
            f"speculators' trainer applies the target's final norm to the last slot itself (verifier_norm), so "
            f"it needs the pre-norm final state; run {run} stored {final_kind or 'no final state'} and taps "
            f"{taps}: capture with --final pre-norm (or a tap at layer {last})")
    if layers is not None:
        return source, list(layers)
    return source, [k for k in taps if source == FINAL or k != last]


def _convention(fmt: str, n: int) -> str:
    base = "tap k = output of 0-based decoder layer k (before the final norm); "
    if fmt == "speculators":
        return base + (f"hidden_states[:, :{n}] = the taps in this order, hidden_states[:, {n}] = the pre-norm final "
                       "state (speculators applies verifier_norm, then verifier_lm_head)")
    return base + ("aux_hidden_state[..., l*H:(l+1)*H] = hidden_states[:, l*H:(l+1)*H] = tap l of this list; "
                   "hidden_state = the post-norm final state (SpecForge's TargetHead is lm_head alone)")


def _trainers(fmt: str, aux: list[int], num_layers: int) -> dict:
    """What each trainer / server must be told about the layers (ids in its own numbering)."""
    if fmt == "speculators":
        ids = [k + 1 for k in aux]
        return {"speculators": {
            "target_layer_ids": ids,
            "args": "--target-layer-ids " + ",".join(map(str, ids)),
            "note": "speculators and vLLM number aux layers k+1 for the output of decoder layer k; the last slot is "
                    f"vLLM's id {num_layers} (the pre-norm final state), not listed among target_layer_ids"}}
    return {"specforge": {
        "eagle_aux_hidden_state_layer_ids": list(aux),
        "note": "SGLang/SpecForge number layer k for the output of decoder layer k (SGLang captures the input of "
                "layer k+1); EAGLE-3 reads aux_hidden_state + hidden_state, DFlash/DSpark read hidden_states",
        "eagle3_ready": len(aux) == SPECFORGE_EAGLE3_TAPS}}


def _save_dataset(out: Path, rows: list[dict], progress: bool) -> None:
    import datasets

    columns = {k: [r[k] for r in rows] for k in ("input_ids", "loss_mask", "seq_len", "sample_id")}
    features = datasets.Features({"input_ids": datasets.Sequence(datasets.Value("int64")),
                                  "loss_mask": datasets.Sequence(datasets.Value("bool")),
                                  "seq_len": datasets.Value("int64"), "sample_id": datasets.Value("string")})
    bars = datasets.utils.is_progress_bar_enabled()
    if not progress:
        datasets.utils.disable_progress_bars()
    try:  # the torch format is saved in state.json: load_from_disk gives tensors, as speculators needs
        datasets.Dataset.from_dict(columns, features=features).with_format("torch").save_to_disk(str(out))
    finally:
        if bars:
            datasets.utils.enable_progress_bars()


def _speculators(out: Path, i: int, sample: dict, aux: torch.Tensor, final: torch.Tensor) -> dict:
    folder = out / "hidden_states"
    folder.mkdir(exist_ok=True)
    states = torch.cat([aux, final[:, None]], dim=1)  # [T, L+1, H]
    _write_file(folder / f"hs_{i}.safetensors",
                save({"token_ids": sample["input_ids"], "hidden_states": states.contiguous()}))
    return {"input_ids": sample["input_ids"].tolist(), "loss_mask": sample["loss_mask"].tolist(),
            "seq_len": len(sample["input_ids"]), "sample_id": sample["sample_id"]}


def _speculators_index(out: Path, i: int, sample: dict, aux: None, final: None) -> dict:
    """A speculators dataset row without its state file (``states=False``)."""
    return {"input_ids": sample["input_ids"].tolist(), "loss_mask": sample["loss_mask"].tolist(),
            "seq_len": len(sample["input_ids"]), "sample_id": sample["sample_id"]}


def _specforge_stub(plan: dict, out: Path, i: int, sample: dict, aux: None, final: None) -> dict:
    """Where SpecForge's ``data_{i}.ckpt`` goes, a stub naming the run and the sample (``states=False``)."""
    g = i // SPECFORGE_GROUP * SPECFORGE_GROUP
    folder = out / f"rows_{g}-{g + SPECFORGE_GROUP}"
    folder.mkdir(exist_ok=True)
    buffer = io.BytesIO()
    torch.save({STUB_KEY: {**plan, "sample_id": sample["sample_id"]}}, buffer)
    _write_file(folder / f"data_{i}.ckpt", buffer.getbuffer())
    return {}


def _specforge(out: Path, i: int, sample: dict, aux: torch.Tensor, final: torch.Tensor) -> dict:
    g = i // SPECFORGE_GROUP * SPECFORGE_GROUP
    folder = out / f"rows_{g}-{g + SPECFORGE_GROUP}"
    folder.mkdir(exist_ok=True)
    flat = aux.reshape(1, aux.shape[0], -1).contiguous()  # [1, T, L*H]
    record = {
        "input_ids": sample["input_ids"],
        "loss_mask": sample["loss_mask"].long(),
        "aux_hidden_state": flat,
        "hidden_states": flat[0],  # [T, L*H], same storage: torch.save writes it once
        "hidden_state": final[None].contiguous(),  # [1, T, H]
    }
    buffer = io.BytesIO()
    torch.save(record, buffer)
    _write_file(folder / f"data_{i}.ckpt", buffer.getbuffer())
    return {}


def _write_file(path: Path, data) -> None:
    """Write ``data`` (bytes) to ``path`` with Python's own file writes, so that a full disk is an OSError
    (ENOSPC); safetensors' and torch's writers report it as other errors (a torch ``RuntimeError`` that names
    a stream position)."""
    with open(path, "wb") as f:
        f.write(data)


def _size(n: int) -> str:
    return f"{n / 2**30:,.1f} GiB" if n >= 2**30 else f"{n / 2**20:,.0f} MiB"
