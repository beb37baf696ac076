"""``capture shards check RUN``: recompute stored rows with an independent reference forward and compare.

Write-time validation catches NaN/Inf and length mismatches; it cannot see states that are finite and
wrong: all zeros (vLLM PR #46301), an intermediate stream instead of the layer output (GLM-5.3-Flash,
vLLM PR #55682), a tap taken from the neighbouring layer, a pre-norm final state labelled post-norm. This
check picks ``rows`` stored rows (seeded, spread over the run's lengths and so its shards), runs the
target over their stored ``input_ids`` with plain HF transformers in a process of its own (float32 by
default, the whole model, nothing of the capture engines: forward hooks on the decoder layers and the
final norm written here), and compares per tap:

- per-token cosine (min over tokens and mean), relative error ``‖s - r‖ / ‖r‖`` over all values;
- the share of tokens whose stored state is all zero, constant across channels, or not finite;
- argmax agreement with the reference logits where the run stored argmax; for ``--topk`` runs, the share
  of the reference's top-K ids found among the stored ones.

Conventions (the run header's ``tap_convention``): tap ``k`` is the output of 0-based decoder layer ``k``
before the final norm (HF ``hidden_states[k+1]`` except for the last layer, whose ``hidden_states`` entry
is post-norm: hence the hooks), a layer output over N residual streams reduced by their mean (the
header's ``stream_reduction``); ``final`` post-norm is the final norm's output, pre-norm its input.

A run passes when every tap meets :data:`THRESHOLDS` for its codec class. Measured on real SmolLM2 runs
(bf16 arithmetic against a float32 reference, 6 rows of 122-3,180 tokens): per-token cosine min >= 0.9925,
mean >= 0.99979, argmax agreement >= 0.971; the neighbouring layer's states score mean cosine
0.950-0.972, a pre-norm final labelled post-norm 0.54-0.75. Lossy codecs lose more (``int4-b32`` keeps a
per-token cosine of ~0.987 mean, bench/codecs.out), so their bound is lower.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import multiprocessing
import os
import random

import numpy as np
import torch

from common.errors import CaptureError
from shards import manifest as manifest_mod
from shards.format import FINAL, RunHeader, tap_column
from shards.rows import read_row
from shards.run import Location, as_location


@dataclasses.dataclass(frozen=True)
class Thresholds:
    """A tap passes with per-token cosine min >= ``cos_min`` and mean >= ``cos_mean`` and no all-zero,
    constant or non-finite token; the run also needs (where stored) argmax agreement >= ``argmax`` and top-K
    overlap >= ``topk_overlap``."""

    cos_min: float
    cos_mean: float
    argmax: float = 0.95
    topk_overlap: float = 0.9


# by codec class: lossless and the fine lossy codecs, the coarse 4-bit ones (their own loss, module docstring)
THRESHOLDS = {"fine": Thresholds(cos_min=0.98, cos_mean=0.995), "coarse": Thresholds(cos_min=0.9, cos_mean=0.975)}
COARSE = ("int4-b32", "fp4-b32")


def thresholds_for(codec: str) -> Thresholds:
    return THRESHOLDS["coarse" if codec in COARSE else "fine"]


@dataclasses.dataclass
class TapResult:
    column: str
    cos_min: float
    cos_mean: float
    rel_err: float
    zero_tokens: float  # shares of checked tokens
    constant_tokens: float
    nonfinite_tokens: float
    failing_rows: list[str]  # sample ids of rows below the thresholds
    ok: bool


@dataclasses.dataclass
class Report:
    """One ``shards check``: the rows checked, per-tap results, argmax (and top-K) agreement, verdict."""

    run: str
    model_dir: str
    dtype: str
    codec: str
    thresholds: dict
    rows: list[str]
    tokens: int
    taps: list[TapResult]
    argmax_agreement: float | None
    topk_overlap: float | None
    ok: bool
    problems: list[str]

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def pick_rows(loc: Location, shards: list[dict], n: int, seed: int) -> list[tuple[str, int]]:
    """``n`` (shard path, row) pairs spread over the run's lengths: rows sorted by token count, one drawn
    (seeded) from each of ``n`` equal slices; all rows when the run has fewer."""
    rows = []
    for entry in shards:
        lengths = loc.read_table(entry["path"], ["num_tokens"], entry["rows"]).column("num_tokens").to_pylist()
        rows += [(n_tok, entry["path"], i) for i, n_tok in enumerate(lengths)]
    rows.sort()
    if len(rows) <= n:
        return [(p, i) for _, p, i in rows]
    rng = random.Random(seed)
    edges = np.linspace(0, len(rows), n + 1).astype(int)
    return [rows[rng.randrange(a, b)][1:] for a, b in zip(edges[:-1], edges[1:])]


def check(run: str | os.PathLike | Location, *, rows: int = 8, dtype: str = "float32", seed: int = 0,
          model_path: str | None = None) -> Report:
    """Check ``rows`` stored rows of ``run`` against a reference forward (module docstring). ``dtype``:
    the reference's arithmetic (``float32`` or ``bfloat16``); ``model_path``: the target folder (default:
    ``model_dir`` of the run's ``provenance.json``). Returns the Report (``ok`` False below thresholds).
    Raises CaptureError for a folder with no run or no rows, an unknown dtype, or no model folder."""
    if dtype not in ("float32", "bfloat16"):
        raise CaptureError(f"--dtype {dtype}: the reference computes in float32 or bfloat16")
    loc = as_location(run)
    m = manifest_mod.read(loc)
    if m.header is None or not m.shards:
        raise CaptureError(f"{run}: no committed rows to check")
    header = m.header
    if model_path is None:
        from provenance.record import read as read_provenance

        model_path = read_provenance(loc).get("model_dir")
    if not model_path or not os.path.isdir(model_path):
        raise CaptureError(f"{run}: the target folder {model_path!r} is not here; give --model-path")
    picked = pick_rows(loc, m.shards, rows, seed)
    stored = []
    for path, i in picked:
        stored.append(read_row(loc.read_table(path), i, topk=header.topk > 0))
    ctx = multiprocessing.get_context("spawn")  # a clean process: no capture engine state, no hooks of ours
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
        refs = pool.submit(reference, model_path, dtype, list(header.taps["layers"]), header.taps["final"],
                           [r.input_ids for r in stored], header.topk).result()
    return compare(str(run), model_path, dtype, header, stored, refs)


def reference(model_path: str, dtype: str, layers: list[int], final: str, ids: list[np.ndarray],
              topk: int) -> list[dict]:
    """Per row: float32 ``{"tap_<k>": [T, H], "final": [T, H], "argmax": int32 [T], "topk": int32 [T, K]}``
    from a plain HF forward (hooks on ``model.get_decoder().layers[k]`` and the decoder's final norm)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    # a checkpoint whose text model has no causal-LM class (glm5_next) loads as image-text-to-text
    auto = AutoModelForCausalLM if type(AutoConfig.from_pretrained(model_path)) in AutoModelForCausalLM._model_mapping \
        else AutoModelForImageTextToText
    model = auto.from_pretrained(model_path, dtype=getattr(torch, dtype)).eval()
    decoder = model.get_decoder()
    saved: dict = {}
    hooks = [decoder.layers[k].register_forward_hook(
        lambda mod, args, out, k=k: saved.__setitem__(tap_column(k), _layer_output(out))) for k in layers]
    if final in ("post-norm", "pre-norm"):
        hooks.append(decoder.norm.register_forward_hook(
            lambda mod, args, out: saved.__setitem__(FINAL, (out if final == "post-norm" else args[0])[0])))
    results = []
    for row_ids in ids:
        saved.clear()
        with torch.inference_mode():
            logits = model(torch.from_numpy(np.asarray(row_ids, dtype=np.int64))[None]).logits[0].float()
        res = {k: v.float().clone() for k, v in saved.items()}
        res["argmax"] = logits.argmax(-1).to(torch.int32).numpy()
        if topk:
            res["topk"] = logits.topk(topk, dim=-1).indices.to(torch.int32).numpy()
        results.append(res)
    for h in hooks:
        h.remove()
    return results


def _layer_output(out) -> torch.Tensor:
    """A decoder layer's output for the batch's one row: ``[T, H]``; a ``[T, N, H]`` output over N residual
    streams (GLM-5.3-Flash's hyper-connections) reduced by the mean over streams, the header's
    ``stream_reduction`` (the model's own reduction before its final norm)."""
    x = (out[0] if isinstance(out, tuple) else out)[0]
    return x.float().mean(dim=-2) if x.dim() == 3 else x


def compare(run: str, model_dir: str, dtype: str, header: RunHeader, stored: list, refs: list[dict]) -> Report:
    """The Report of ``stored`` rows (:class:`shards.rows.Row`) against their ``refs``."""
    limits = thresholds_for(header.codec)
    taps, problems = [], []
    for column in header.columns:
        cos_all, errs, refs_sq = [], 0.0, 0.0
        zero = const = nonfinite = 0
        failing = []
        for row, ref in zip(stored, refs):
            s, r = row.states[column].float(), ref[column]
            cos = torch.nn.functional.cosine_similarity(s, r, dim=-1)
            cos_all.append(cos)
            errs += float(((s - r) ** 2).sum())
            refs_sq += float((r**2).sum())
            finite = torch.isfinite(s).all(dim=-1)
            zero += int((s == 0).all(dim=-1).sum())
            const += int(((s == s[:, :1]).all(dim=-1) & finite).sum())
            nonfinite += int((~finite).sum())
            # NaN compares False: a non-finite row fails
            if not (float(cos.min()) >= limits.cos_min and float(cos.mean()) >= limits.cos_mean and bool(finite.all())):
                failing.append(row.sample_id)
        cos = torch.cat(cos_all)
        n = cos.numel()
        result = TapResult(column, float(cos.min()), float(cos.mean()), (errs / refs_sq) ** 0.5 if refs_sq else float("nan"),
                           zero / n, const / n, nonfinite / n, failing, False)
        result.ok = (result.cos_min >= limits.cos_min and result.cos_mean >= limits.cos_mean
                     and zero == const == nonfinite == 0)
        if not result.ok:
            problems.append(f"{column}: per-token cosine min {result.cos_min:.4f} / mean {result.cos_mean:.5f} "
                            f"(need {limits.cos_min} / {limits.cos_mean}), all-zero {zero}, constant {const}, "
                            f"non-finite {nonfinite} of {n} tokens; rows {', '.join(failing[:5])}")
        taps.append(result)
    argmax = topk = None
    if header.argmax:
        agree = np.concatenate([r.argmax == ref["argmax"] for r, ref in zip(stored, refs)])
        argmax = float(agree.mean())
        if not argmax >= limits.argmax:
            problems.append(f"argmax agrees with the reference at {argmax:.4f} of tokens (need {limits.argmax})")
    if header.topk:
        hits = [np.mean([len(set(a) & set(b)) / len(b) for a, b in zip(r.topk_ids, ref["topk"])])
                for r, ref in zip(stored, refs)]
        topk = float(np.mean(hits))
        if not topk >= limits.topk_overlap:
            problems.append(f"top-{header.topk} ids overlap the reference's at {topk:.4f} (need {limits.topk_overlap})")
    return Report(run, model_dir, dtype, header.codec, dataclasses.asdict(limits), [r.sample_id for r in stored],
                  sum(len(r.input_ids) for r in stored), taps, argmax, topk, not problems, problems)


def markdown(r: Report) -> str:
    lines = [f"{r.run}: {len(r.rows)} rows, {r.tokens:,} tokens against a {r.dtype} HF forward of {r.model_dir} "
             f"(codec {r.codec})", "",
             "| state | per-token cosine min | mean | relative error | all-zero | constant | non-finite | ok |",
             "|---|---|---|---|---|---|---|---|"]
    for t in r.taps:
        lines.append(f"| {t.column} | {t.cos_min:.5f} | {t.cos_mean:.6f} | {t.rel_err:.4f} | {t.zero_tokens:.2%} | "
                     f"{t.constant_tokens:.2%} | {t.nonfinite_tokens:.2%} | {'yes' if t.ok else 'NO'} |")
    if r.argmax_agreement is not None:
        lines.append(f"\nargmax agreement {r.argmax_agreement:.4f}")
    if r.topk_overlap is not None:
        lines.append(f"top-K overlap {r.topk_overlap:.4f}")
    lines.append("\nOK" if r.ok else "\nFAILED: " + "; ".join(r.problems))
    return "\n".join(lines)

