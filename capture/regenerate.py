"""Self-distillation (``--responses regenerate``): the target writes the assistant turns it is captured on.

Engine-agnostic: an engine only needs ``generate(prompts, sampling, stop_ids) -> list[Generated]`` (see
:mod:`capture.engines.base`); the states of the finished records come from the same prefill
(``engine.forward``) as in dataset mode.

A :class:`capture.chat.Prompt` holds the token-id segments of a conversation that do not depend on the
answers. Round j generates answer j for every conversation still going, in one ``generate`` call per
batch of at most ``batch_tokens`` padded tokens (longest prompt + ``max_new_tokens``, times the batch
size; ``None``: the whole round in one call). The record is ``segments[0] + answer_0 + segments[1] +
answer_1 + …``: every answer exactly the ids the target produced, its stop token included, never decoded
and re-encoded. A conversation stops after an answer that did not end with the template's own
end-of-turn token for that turn (it ran out of ``max_new_tokens``, finish reason ``"length"``, or
ended with another stop id): that answer is kept, later turns are not generated. The loss mask is True
on exactly the generated tokens.

Policies (:meth:`capture.chat.ChatEncoder.encode_prompt`): ``last`` regenerates only the last assistant
turn (one round; earlier answers are the dataset's); ``every`` regenerates every assistant turn, each
conditioned on the target's own earlier answers.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np

from common.records import Prompt, Tokenized
from capture.engines.base import Sampling

MODES = ("dataset", "regenerate")
POLICIES = ("last", "every")


def sampling_of(responses: dict) -> Sampling:
    """The :class:`Sampling` recorded in a run header's ``responses`` entry (regenerate mode)."""
    return Sampling(**{f.name: responses[f.name] for f in dataclasses.fields(Sampling)})


def responses_header(cfg, stop_ids: Sequence[int]) -> dict:
    """The run header's ``responses`` entry for a :class:`capture.config.RunConfig`: ``mode`` and the
    chat template kwargs; in regenerate mode also the policy, the :class:`Sampling` fields and the stop
    token ids generation ends at."""
    out = {"mode": cfg.responses, "chat_template_kwargs": dict(cfg.chat_template_kwargs)}
    if cfg.responses == "regenerate":
        sampling = Sampling(temperature=float(cfg.temperature), top_p=float(cfg.top_p),
                            max_new_tokens=cfg.max_new_tokens, seed=cfg.seed)
        out |= {"policy": cfg.regenerate_policy, **dataclasses.asdict(sampling), "stop_ids": sorted(stop_ids)}
    return out


def generation_batches(prompts: Sequence[np.ndarray], max_new_tokens: int,
                       batch_tokens: int | None) -> list[list[int]]:
    """Indices of ``prompts`` grouped longest first into batches of at most ``batch_tokens`` padded
    tokens (longest prompt + ``max_new_tokens``, times the batch size); one batch when None."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]), reverse=True)
    if batch_tokens is None:
        return [order] if order else []
    batches: list[list[int]] = []
    for i in order:
        if batches and (len(batches[-1]) + 1) * (len(prompts[batches[-1][0]]) + max_new_tokens) <= batch_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def regenerate(engine, prompts: Sequence[Prompt], sampling: Sampling, stop_ids: Sequence[int], *,
               batch_tokens: int | None = None, on_batch: Callable[[int], None] | None = None,
               budget: int | None = None) -> list[Tokenized]:
    """Generate the answers of ``prompts`` with ``engine``; one :class:`Tokenized` each, in order:
    ``input_ids`` int32 ``[T]`` (segments and generated ids), ``loss_mask`` bool ``[T]`` (True on the
    generated ids), ``finish_reasons`` one ``"stop"``/``"length"`` per generated turn. ``on_batch``: called
    after each generation call with the tokens it generated (for progress). ``budget``: the length
    filter's ``max_tokens``: a conversation whose record already holds more tokens before its next answer
    would start stops there (a prompt longer than that is not answered at all). The filter then gives
    the same result as after generating the rest (``truncate`` cuts every later answer whole, ``drop`` drops the record either way), without the
    generation time (with ``--regenerate-policy every``, most of it for long conversations)."""
    parts: list[list[np.ndarray]] = [[p.segments[0]] for p in prompts]
    masks: list[list[np.ndarray]] = [[np.zeros(len(p.segments[0]), dtype=bool)] for p in prompts]
    reasons: list[list[str]] = [[] for _ in prompts]
    # a prompt already past the budget gets no answer: the filter would cut every generated token
    active = [i for i, p in enumerate(prompts) if budget is None or len(p.segments[0]) <= budget]
    while active:
        contexts = [np.concatenate(parts[i]) for i in active]
        going = []
        for batch in generation_batches(contexts, sampling.max_new_tokens, batch_tokens):
            outs = engine.generate([contexts[b] for b in batch], sampling, stop_ids)
            if on_batch is not None:
                on_batch(sum(len(gen.token_ids) for gen in outs))
            for b, gen in zip(batch, outs):
                i = active[b]
                turn, prompt = len(reasons[i]), prompts[i]
                ids = np.asarray(gen.token_ids, dtype=np.int32)
                parts[i].append(ids)
                masks[i].append(np.ones(len(ids), dtype=bool))
                reasons[i].append(gen.finish_reason)
                if (turn + 1 < prompt.turns and gen.finish_reason == "stop" and len(ids)
                        and ids[-1] == prompt.turn_ends[turn]):
                    parts[i].append(prompt.segments[turn + 1])
                    masks[i].append(np.zeros(len(prompt.segments[turn + 1]), dtype=bool))
                    if budget is None or sum(len(p) for p in parts[i]) <= budget:
                        going.append(i)
        active = sorted(going)
    return [Tokenized(p.sample_id, p.row_index, p.source, np.concatenate(parts[i]), np.concatenate(masks[i]),
                      tuple(reasons[i])) for i, p in enumerate(prompts)]
