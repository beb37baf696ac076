"""The KV connector that hands vLLM's extracted hidden states to capture (loaded by vLLM from
``kv_connector_module_path="capture.engines.vllm_connector"``).

vLLM's ``extract_hidden_states`` speculative method runs a cache-only "draft" layer that writes the
target's aux hidden states into a KV-cache group of their own: for every token, a ``[L, H]`` slab (one
row per aux layer id, ids in ascending order, as ``SupportsEagle3._set_aux_hidden_state_layers`` sorts
them). A KV connector reads them out when the request finishes. vLLM's example connector
(``ExampleHiddenStatesConnector``) does that with CUDA streams and pinned memory and writes one
safetensors file per request; this one reuses its scheduler side (which delays freeing the blocks until
the states are read) and replaces the worker side:

* the slab is gathered from the cache with the request's block ids and kept in memory, keyed by the
  request's ``kv_transfer_params["capture_key"]``, until the engine takes it with
  :func:`take_captured` (a ``collective_rpc`` call; in-process that is a plain function call, across
  processes vLLM serializes the tensors once);
* on CUDA the gather runs on a side stream with an async copy into pinned host memory (an event marks
  completion; ``take_captured`` waits for it); on CPU it is a plain copy: no streams, no pinned memory;
* only TP rank 0 keeps states (every rank holds the same replicated slab).

Token ids: the scheduler records the request's prompt ids (or all ids but the last one with
``include_output_tokens``: the last output token never went through a forward) next to the states, so the
engine can check them against the ids it sent.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.distributed.kv_transfer import get_kv_transfer_group
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)


class _Ready:
    """Completion marker on CPU (the copy is synchronous); quacks like ``torch.cuda.Event``."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class CaptureConnector(ExampleHiddenStatesConnector):
    """Store-only connector: keeps each finished request's hidden states ``[T, L, H]`` (the cache dtype)
    and token ids ``[T]`` (int64) in worker memory until :func:`take_captured` collects them."""

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        self.use_lock = False  # no files, so no lock files
        self._captured: dict[str, tuple[torch.Tensor, torch.Tensor, Any]] = {}

    def request_finished(self, request, block_ids):
        """Keep the blocks of requests that carry a ``capture_key`` until their states are read; other
        requests (e.g. self-distillation generation) are not extracted."""
        key = (request.kv_transfer_params or {}).get("capture_key")
        delay, params = super().request_finished(request, block_ids)
        pending = self._pending_saves.get(request.request_id)
        if pending is None:
            return delay, params
        if key is None:
            del self._pending_saves[request.request_id]
            return False, None
        pending.filename = key  # the key travels where the example connector keeps a file name
        return True, {"capture_key": key}

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        cache = self._kv_cache
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (blocks[:, None] * self._block_size + torch.arange(self._block_size)[None, :]).flatten()
        n = pending.token_ids.shape[0]
        if cache.is_cuda:
            stream = self._get_copy_stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                states = extract_from_kv_cache(cache, slots.to(cache.device, non_blocking=True), n)
                host = torch.empty(states.shape, dtype=states.dtype, pin_memory=True)
                host.copy_(states, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        else:
            host, done = extract_from_kv_cache(cache, slots, n).clone(), _Ready()
        self._captured[pending.filename] = (host, pending.token_ids.clone(), done)
        self._req_copy_events[pending.req_id] = done

    def take(self, keys) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Hand over (and forget) the states of ``keys`` that are ready: ``{key: (states [T, L, H],
        token_ids [T])}``. Keys not finished yet are left for a later call."""
        out = {}
        for key in keys:
            item = self._captured.pop(key, None)
            if item is not None:
                states, ids, done = item
                done.synchronize()
                out[key] = (states, ids)
        return out


def take_captured(worker, keys) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``LLM.collective_rpc`` target: run on every worker; TP rank > 0 returns ``{}``."""
    return get_kv_transfer_group().take(keys)
