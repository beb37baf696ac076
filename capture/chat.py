"""Conversation → token ids and loss mask, through the target's own chat template.

The loss mask marks exactly the tokens the assistant produced: each assistant turn's content plus its
end-of-turn token. It is found without regex over decoded text and without ``{% generation %}`` tags:
for each assistant turn i the template renders the prefix ``messages[:i]`` with the generation prompt and
the prefix ``messages[:i+1]``; both must be text prefixes of the whole rendering, and both must end on a
token boundary of the whole conversation's tokenization (the fast tokenizer's offset mapping), which
makes them token prefixes of it. The conversation is tokenized once; the supervised span is the tokens
between the two boundaries, up to and including the last end-of-turn token (tokens the template adds after it, e.g. ChatML's ``\\n``, are boilerplate the
model never produces). A template that breaks either property, or renders an assistant turn without an
end-of-turn token, raises :class:`CaptureError` naming the row: nothing is silently mis-masked.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal, Sequence

import numpy as np

from capture.data import Conversation
from capture.errors import CaptureError
from capture.hashing import text_sha256, token_sha256

SpecialTextPolicy = Literal["drop", "keep"]


@dataclasses.dataclass(frozen=True)
class Tokenized:
    """One conversation, tokenized. ``input_ids`` int32 ``[T]``, ``loss_mask`` bool ``[T]``."""

    sample_id: str
    row_index: int
    source: str
    input_ids: np.ndarray
    loss_mask: np.ndarray

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())

    @functools.cached_property
    def token_sha256(self) -> str:
        """Computed once per record (dedup and the shard writer both need it)."""
        return token_sha256(self.input_ids)



@dataclasses.dataclass(frozen=True)
class ChatEncoder:
    """Renders and tokenizes conversations with one tokenizer and one chat template.

    ``end_ids``: token ids that end an assistant turn (the tokenizer's EOS and the generation config's
    ``eos_token_id`` list). ``special_text``: what to do with a row whose content contains the text of a
    special token (e.g. ``<|im_end|>``), which the tokenizer would turn into a real control token:
    ``drop`` (default, counted as ``special_token_text``) or ``keep`` (tokenized as is).
    """

    tokenizer: object
    template: str
    end_ids: frozenset[int]
    system_prompt: str | None = None
    special_text: SpecialTextPolicy = "drop"

    @property
    def template_sha256(self) -> str:
        return text_sha256(self.template)

    def special_strings(self) -> tuple[str, ...]:
        tok = self.tokenizer
        added = [t.content for t in getattr(tok, "added_tokens_decoder", {}).values() if t.special]
        return tuple(sorted(set(tok.all_special_tokens) | set(added), key=len, reverse=True))

    def _render(self, messages: Sequence[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=generation_prompt, chat_template=self.template
        )

    def encode(self, conv: Conversation, specials: tuple[str, ...] = ()) -> Tokenized | str:
        """Tokenize ``conv``. Returns :class:`Tokenized`, or a skip reason string (``special_token_text``).

        Raises CaptureError where a rendered prefix is not a prefix of the whole rendering, where a turn
        boundary falls inside a token, or where an assistant turn has no end-of-turn token.
        """
        if self.special_text == "drop" and specials:
            if any(s in content for _, content in conv.messages for s in specials):
                return "special_token_text"
        messages = [{"role": r, "content": c} for r, c in conv.messages]
        if self.system_prompt is not None and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        text = self._render(messages, generation_prompt=False)
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = enc["input_ids"]
        # token index that starts at each character offset (the end of the text counts as a boundary)
        boundary = {start: j for j, (start, _) in reversed(list(enumerate(enc["offset_mapping"])))}
        boundary[len(text)] = len(ids)
        mask = np.zeros(len(ids), dtype=bool)
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            start = self._boundary(text, boundary, self._render(messages[:i], generation_prompt=True), conv, i)
            stop = self._boundary(text, boundary, self._render(messages[: i + 1], generation_prompt=False), conv, i)
            ends = [j for j in range(start, stop) if ids[j] in self.end_ids]
            if not ends:
                raise CaptureError(
                    f"{conv.sample_id}: the chat template renders assistant turn {i} with no end-of-turn token "
                    f"(ids {sorted(self.end_ids)}); give a template that closes assistant turns"
                )
            mask[start : ends[-1] + 1] = True
        return Tokenized(conv.sample_id, conv.row_index, conv.source, np.asarray(ids, dtype=np.int32), mask)

    @staticmethod
    def _boundary(text: str, boundary: dict[int, int], prefix: str, conv: Conversation, turn: int) -> int:
        """Number of tokens of ``text`` that make up ``prefix``; raises unless it ends on a token boundary."""
        if not text.startswith(prefix):
            at = next((j for j, (a, b) in enumerate(zip(text, prefix)) if a != b), min(len(text), len(prefix)))
            raise CaptureError(
                f"{conv.sample_id}: chat template breaks the prefix property at turn {turn} (character {at}): "
                "rendering the conversation up to this turn does not give a prefix of the whole rendering"
            )
        if len(prefix) not in boundary:
            raise CaptureError(
                f"{conv.sample_id}: turn {turn} ends inside a token (character {len(prefix)}): the tokenizer "
                "merges across the template's turn boundary, so the loss mask would be ambiguous"
            )
        return boundary[len(prefix)]


def load_encoder(
    model_dir: str,
    *,
    chat_template_file: str | None = None,
    system_prompt: str | None = None,
    special_text: SpecialTextPolicy = "drop",
) -> ChatEncoder:
    """Tokenizer and chat template of the model folder; ``chat_template_file`` overrides the template.

    Raises CaptureError when neither the tokenizer nor the file provides a template.
    """
    from transformers import AutoTokenizer, GenerationConfig

    tok = AutoTokenizer.from_pretrained(model_dir)
    if chat_template_file:
        try:
            template = open(chat_template_file, encoding="utf-8").read()
        except OSError as e:
            raise CaptureError(f"cannot read --chat-template {chat_template_file}: {e.strerror}") from None
    else:
        template = tok.chat_template
    if not template:
        raise CaptureError(f"{model_dir}: the tokenizer has no chat template; pass --chat-template FILE")
    end_ids = {tok.eos_token_id} if tok.eos_token_id is not None else set()
    try:
        eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
        end_ids |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    except OSError:
        pass
    if not end_ids:
        raise CaptureError(f"{model_dir}: no EOS token id in the tokenizer or generation config")
    return ChatEncoder(tok, template, frozenset(end_ids), system_prompt, special_text)


def tokenizer_sha256(tokenizer) -> str:
    """SHA-256 of the fast tokenizer's serialized JSON (vocabulary, merges, normalizer, added tokens)."""
    return text_sha256(tokenizer.backend_tokenizer.to_str())
