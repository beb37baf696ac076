"""HF transformers engine: prefill that keeps only the tapped layers.

Taps are taken with forward hooks on the decoder layers (never ``output_hidden_states`` for every layer):
tap k is the output of ``model.layers[k]`` (in transformers 5 a decoder layer returns a Tensor; older
versions return a tuple whose first item is the hidden state; GLM's decoder layers return
``(hidden, topk_indices)``). For targets with several residual streams (``glm5_next``: a layer output is
``[B, T, 4, H]``) every tap and the pre-norm final state are reduced with
:func:`capture.targets.reduce_streams` (mean over streams, the model's own reduction before its norm). The final state is the output of the
final norm (``post-norm``) or of layer L-1 (``pre-norm``); see :mod:`capture.targets` for the convention.

A batch is prefilled one record per forward by default (``pack_tokens=0``): no padding, no mask, the
same forward as a plain ``model(ids[None])``, so states and argmax are bit-identical to it (tests/test_engine.py)
and nothing is computed for a token that is not stored. On a CPU no batching measured faster
(bench/packing.out, SmolLM2, 40 ShareGPT conversations <= 1,024 tokens, tokens per CPU-second against
one per forward: packed groups of 512-1,024 tokens 0.98-1.04x, within the ~5% between repeats;
right-padded batches of 8,192 tokens 0.73-0.80x; packed groups of 2,048 tokens 0.54-0.71x): a CPU gains
little from a larger matmul, and attention over a packed group costs its length squared. ``pack_tokens=N`` packs instead, for accelerators where one long forward beats many
short ones: the records of a batch are concatenated into groups of at most N tokens, each group one
forward with per-record ``position_ids`` (0, 1, ... for each record) and no attention mask, from which
transformers' mask utilities build a block-diagonal causal mask
(``masking_utils.find_packed_sequence_indices``; only without a KV cache, hence ``use_cache=False``). A
record never sees another: at load the engine checks that the model packs exactly so
(:meth:`HFEngine._packing_isolates`: a neighbour's states are bit-identical whatever the record before it
holds, and match its forward alone); a model that fails the check is prefilled one record per forward.
Packed states differ from a record's forward alone only by kernel shapes (bf16: per-token cosine measured
>= 0.9985; tests/test_engine.py). transformers' GLM-5.x models (``glm_moe_dsa``, ``glm5_next``) are never
packed: their DSA sparse indexers choose keys over the whole sequence, and even a right-padded record gets
other states than the same record alone, in float32 (measured on the tiny fixtures: ``glm_moe_dsa`` tap 0
off by 1.2e-2 from token 12 on; ``glm5_next`` from its indexer layer on, for some lengths, e.g. 29-31
tokens padded to 40; tests/test_glm_engine.py), so packing is not asserted safe for them
(:data:`UNBATCHED_ARCHITECTURES`). When neither ``argmax`` nor the post-norm final state is
needed, the forward stops right after the last tapped layer.

Compute dtype (``dtype``) and stored dtype (``state_dtype``) may differ: on a CPU without native bf16
dot products (AVX2, AVX-512 without BF16) a bf16 forward runs ~6x slower than float32 per token, so
:func:`compute_dtype` picks float32 there (``--dtype auto``) and the states are rounded to the run's
dtype (round to nearest even, torch's ``Tensor.to``) on their way out; argmax and top-K then come from
float32 logits.

``argmax[t]`` is the target's greedy prediction for token t+1: ``argmax(lm_head(norm(h_{L-1}))[t])``,
computed in chunks over the real tokens only, so a ``[T, vocab]`` logits tensor never exists.

Top-K (``topk=K > 0``): per chunk of real tokens (at most 2**24 logits at once), the logits are widened to
float32, ``log_softmax`` over the full vocabulary gives the values, and the K largest are taken in the
order (logit descending, token id ascending: ties go to the lower id, the rule of ``torch.argmax``), so
``topk_ids[:, 0]`` is the argmax (and is stored as it when both are captured).

:meth:`HFEngine.generate` (self-distillation, see :mod:`capture.regenerate`) runs ``model.generate`` on a
left-padded batch with an attention mask; the tap hooks are idle while it runs. Greedy decoding
(temperature 0) is deterministic for a given batch; left padding changes bf16 kernels' shapes, so in
rare cases a prompt's greedy answer in a batch differs from its answer alone. Sampled outputs
(``torch.manual_seed(seed)`` once per call) depend on the batch's composition and order.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from capture.engines.registry import option_names
from capture.engines.base import Capabilities, Captured, Generated, Sampling
from capture.targets import Taps, reduce_streams
from shards.format import tap_column

__all__ = ["Captured", "Generated", "HFEngine", "Sampling"]


# model types never packed (the module docstring): their padded batches change real tokens' states
UNBATCHED_ARCHITECTURES = frozenset({"glm_moe_dsa", "glm5_next"})


class _StopForward(Exception):
    pass


def load_causal_lm(model_dir: str, dtype: torch.dtype, device_map: str | None = None):
    """The model with its LM head, in eval mode. Multimodal checkpoints whose text model has no causal-LM
    class of its own (``glm5_next``, GLM-5.3-Flash: ``Glm5NextForConditionalGeneration``) load through
    ``AutoModelForImageTextToText``; only their language model runs (``get_decoder()``). ``device_map``
    is passed to ``from_pretrained`` (None: CPU)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(model_dir)
    if type(config) in AutoModelForCausalLM._model_mapping:
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, device_map=device_map).eval()
    return AutoModelForImageTextToText.from_pretrained(model_dir, dtype=dtype, device_map=device_map).eval()


def _ordered_topk(logits: torch.Tensor, k: int, margin: int = 16) -> torch.Tensor:
    """Indices ``[N, k]`` of the k largest of each row of ``logits`` ``[N, V]``, by value descending and,
    among equal values, index ascending (``torch.topk`` leaves the order of ties open; bf16 logits tie
    often). The candidates are the ``k + margin`` largest, widened until every value equal to the k-th
    is among them."""
    vocab = logits.shape[-1]
    m = min(vocab, k + margin)
    while True:
        vals, idx = torch.topk(logits, m, dim=-1, sorted=True)
        if m == vocab or bool((vals[:, m - 1] < vals[:, k - 1]).all()):
            break
        m = min(vocab, 2 * m)
    by_id = torch.sort(idx, dim=-1, stable=True).indices
    idx, vals = idx.gather(-1, by_id), vals.gather(-1, by_id)
    by_value = torch.sort(vals, dim=-1, descending=True, stable=True).indices[:, :k]
    return idx.gather(-1, by_value)


def pack_groups(lengths: Sequence[int], pack_tokens: int) -> list[list[int]]:
    """Indices of records grouped in order into packs of at most ``pack_tokens`` tokens; a record longer
    than that is a pack of its own."""
    groups: list[list[int]] = []
    total = 0
    for i, n in enumerate(lengths):
        if groups and total + n <= pack_tokens:
            groups[-1].append(i)
            total += n
        else:
            groups.append([i])
            total = n
    return groups


class HFEngine:
    """Load ``model_dir`` and capture ``taps``. ``dtype``: the dtype the model computes in; ``state_dtype``:
    the dtype states come back in (None: ``dtype``; a run passes its header's, e.g. float32 compute and
    bf16 states). ``threads`` sets torch's intra-op threads (None: unchanged); ``device_map`` (e.g.
    ``"auto"`` on a GPU machine; None: CPU) places the model, states come back on CPU. ``pack_tokens``:
    0 prefills one record per forward; N > 0 packs records into forwards of at most N tokens where the
    model keeps packed records apart (module docstring)."""

    name = "hf"
    # load_engine passes device_map="auto" for --device cuda (the replica's visible GPUs)
    capabilities = Capabilities(generates=True, topk=True, devices=("cpu", "cuda"), in_process=True,
                                options=option_names("hf"))

    def __init__(self, model_dir: str, taps: Taps, *, argmax: bool = True, dtype: str = "bfloat16", threads: int | None = None,
                 device_map: str | None = None, topk: int = 0, state_dtype: str | None = None,
                 pack_tokens: int = 0):
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # one progress bar per run (the driver's), not one per replica
        if threads:
            torch.set_num_threads(threads)
        self.taps = taps
        self.want_argmax = argmax
        self.topk = int(topk)
        self.model = load_causal_lm(model_dir, getattr(torch, dtype), device_map)
        self.state_dtype = getattr(torch, state_dtype or dtype)
        self.device = self.model.get_input_embeddings().weight.device
        self.decoder = self.model.get_decoder()
        self.layers = self.decoder.layers
        self.num_layers = len(self.layers)
        self.pad_id = 0
        self._saved: dict[str, torch.Tensor] = {}
        self._capturing = False
        self._stop_after = self._last_needed_layer()
        self.pack_tokens = int(pack_tokens)
        self.packs = (self.pack_tokens > 0 and self.model.config.model_type not in UNBATCHED_ARCHITECTURES
                      and self._packing_isolates())
        self._hooks = [self.layers[k].register_forward_hook(self._saver(tap_column(k), k)) for k in taps.layers]
        if taps.final == "pre-norm":
            self._hooks.append(self.layers[-1].register_forward_hook(self._saver("final", self.num_layers - 1)))
        elif taps.final == "post-norm":
            self._hooks.append(self.decoder.norm.register_forward_hook(self._saver("final", None)))

    @torch.inference_mode()
    def _packing_isolates(self) -> bool:
        """Whether a packed forward (``position_ids`` restarting at 0 per record, no mask) keeps records
        apart in this model: record b's last hidden states are bit-identical after two different records
        a, and close to b's forward alone (per-token cosine > 0.99: its positions restarted). Three tiny
        forwards at load time."""
        vocab = self.model.get_input_embeddings().weight.shape[0]
        a, a2, b = (torch.arange(s, s + n) % vocab for s, n in ((11, 7), (101, 7), (201, 5)))
        pos = torch.cat([torch.arange(7), torch.arange(5)])[None].to(self.device)

        def last(*ids, positions=None):
            x = torch.cat(ids)[None].to(self.device)
            return self.decoder(input_ids=x, position_ids=positions, use_cache=False).last_hidden_state[0].float()

        try:
            first, second, alone = last(a, b, positions=pos)[7:], last(a2, b, positions=pos)[7:], last(b)
        except Exception:  # noqa: BLE001 - a model whose forward refuses position ids this way: one per forward
            return False
        close = torch.nn.functional.cosine_similarity(first, alone, dim=-1).min() > 0.99
        return bool(torch.equal(first, second) and close)

    def _last_needed_layer(self) -> int | None:
        """Layer after which the forward can stop, or None when the norm / LM head are needed."""
        if self.want_argmax or self.topk or self.taps.final == "post-norm":
            return None
        return self.num_layers - 1 if self.taps.final == "pre-norm" else max(self.taps.layers)

    def _saver(self, column: str, layer: int | None):
        def hook(_module, _inputs, output):
            if not self._capturing:  # generate(): the hooks keep nothing and never stop the forward
                return
            out = output[0] if isinstance(output, tuple) else output
            self._saved[column] = reduce_streams(out, self.taps.residual_streams) if layer is not None else out
            if layer is not None and layer == self._stop_after:
                raise _StopForward

        return hook

    @torch.inference_mode()
    def forward(self, batch: Sequence[np.ndarray]) -> list[Captured]:
        """Prefill a batch of token id arrays (int32 ``[T_i]``) and return one :class:`Captured` each, in
        order: one record per forward, or packed groups of at most ``pack_tokens`` tokens where the engine
        packs (module docstring)."""
        if self.packs:
            groups = pack_groups([len(ids) for ids in batch], self.pack_tokens)
        else:
            groups = [[i] for i in range(len(batch))]
        return [c for group in groups for c in self._forward_group([batch[i] for i in group])]

    def _forward_group(self, group: Sequence[np.ndarray]) -> list[Captured]:
        """One forward of ``group`` concatenated, positions restarting at 0 for each record (one record:
        a plain forward, no position ids)."""
        lengths = [len(ids) for ids in group]
        input_ids = torch.from_numpy(np.concatenate([np.asarray(ids, dtype=np.int64) for ids in group]))[None]
        positions = torch.from_numpy(np.concatenate([np.arange(n) for n in lengths]))[None]
        self._saved.clear()
        last = None
        self._capturing = True
        try:
            last = self.decoder(input_ids=input_ids.to(self.device),
                                position_ids=positions.to(self.device) if len(group) > 1 else None,
                                use_cache=False).last_hidden_state[0]
        except _StopForward:
            pass
        finally:
            self._capturing = False
        starts = np.cumsum([0, *lengths])
        out = [self._captured({c: self._saved[c][0, s:e] for c in self.taps.columns},
                              None if last is None else last[s:e]) for s, e in zip(starts[:-1], starts[1:])]
        self._saved.clear()
        return out

    def _captured(self, states: dict[str, torch.Tensor], last: torch.Tensor | None) -> Captured:
        """One record's :class:`Captured` from its tapped states and post-norm last states ``[T, H]``."""
        states = {c: t.to("cpu", self.state_dtype).contiguous() for c, t in states.items()}
        top_ids = top_values = None
        if self.topk:
            top_ids, top_values = self._topk(last, self.topk)
        if not self.want_argmax:
            argmax = None
        elif top_ids is not None:
            argmax = top_ids[:, 0].copy()
        else:
            argmax = self._argmax(last)
        return Captured(states, argmax, top_ids, top_values)

    def _argmax(self, normed: torch.Tensor, chunk: int = 1024) -> np.ndarray:
        head = self.model.get_output_embeddings()
        parts = [head(normed[s : s + chunk]).argmax(dim=-1) for s in range(0, normed.shape[0], chunk)]
        return torch.cat(parts).to("cpu", torch.int32).numpy()

    def _topk(self, normed: torch.Tensor, k: int, budget: int = 1 << 24) -> tuple[np.ndarray, np.ndarray]:
        """The K largest next-token log-probabilities at each of ``normed``'s positions (post-norm states
        ``[T, H]``): int32 ids and float32 ``log_softmax`` values ``[T, K]``, descending, ties to the lower
        id; at most ``budget`` logits are held at once."""
        head = self.model.get_output_embeddings()
        vocab = int(head.weight.shape[0])
        chunk = max(1, min(1024, budget // vocab))
        ids, values = [], []
        for s in range(0, normed.shape[0], chunk):
            logits = head(normed[s : s + chunk]).float()  # bf16 → float32 is exact
            top = _ordered_topk(logits, k)
            ids.append(top)
            values.append(torch.log_softmax(logits, dim=-1).gather(-1, top))
        return torch.cat(ids).to("cpu", torch.int32).numpy(), torch.cat(values).to("cpu").numpy()

    @torch.inference_mode()
    def generate(self, prompts: Sequence[np.ndarray], sampling: Sampling, stop_ids: Sequence[int]) -> list[Generated]:
        """Generate one answer per prompt (int32 ``[T_i]``), all prompts in one left-padded batch.

        Each answer is cut after the first of ``stop_ids`` it contains (kept: finish reason ``"stop"``); one
        without a stop id ran to ``sampling.max_new_tokens`` (``"length"``). Greedy when
        ``sampling.temperature == 0``; otherwise multinomial sampling with temperature and top-p only (no
        top-k, no repetition penalty, whatever the model's generation config says).
        """
        if not prompts:
            return []
        lengths = [len(p) for p in prompts]
        width = max(lengths)
        input_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, ids in enumerate(prompts):
            input_ids[i, width - lengths[i]:] = torch.from_numpy(np.asarray(ids, dtype=np.int64))
            attention[i, width - lengths[i]:] = 1
        stops = [int(t) for t in stop_ids]
        options = dict(max_new_tokens=sampling.max_new_tokens, min_new_tokens=0, eos_token_id=stops,
                       pad_token_id=self.pad_id, num_beams=1, repetition_penalty=1.0, no_repeat_ngram_size=0)
        if sampling.temperature > 0:
            options.update(do_sample=True, temperature=float(sampling.temperature), top_p=float(sampling.top_p),
                           top_k=0, min_p=0.0, typical_p=1.0)
            torch.manual_seed(sampling.seed)
        else:
            options.update(do_sample=False)
        out = self.model.generate(input_ids=input_ids.to(self.device), attention_mask=attention.to(self.device),
                                  **options)[:, width:].cpu().numpy()
        result = []
        for row in out:
            hits = np.flatnonzero(np.isin(row, stops))
            if hits.size:
                result.append(Generated(row[: hits[0] + 1].astype(np.int32), "stop"))
            else:
                result.append(Generated(row.astype(np.int32), "length"))
        return result
