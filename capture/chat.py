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

Template boilerplate (``ChatEncoder.boilerplate``): token ids a template inserts at the start of an
assistant turn that the model never generates there, left out of the mask. The one known case is GLM's
empty ``<think></think>`` in a turn without reasoning (GLM-5.x always thinks, so it never writes an empty
block); :func:`load_encoder` sets it when the template text contains ``<think></think>``. Tool results
(``tool`` turns, GLM's ``<|observation|>``) are never supervised; an assistant turn's reasoning, answer,
tool calls and closing token are (see docs/glm.md "GLM chat format and loss mask policy").

Self-distillation (``--responses regenerate``, :mod:`capture.regenerate`): :meth:`ChatEncoder.encode_prompt`
gives the token-id :class:`Prompt` segments of a conversation that do not depend on its answers (the
prompt up to the first regenerated turn's generation prompt, then the template's text between turns),
found with placeholder answers and checked the same way; the target's generated ids are spliced between
them as they are, never decoded and re-encoded.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Literal, Sequence

import numpy as np

from capture.conversation import Conversation
from common.errors import CaptureError
from common.hashing import text_sha256
from common.records import Prompt, Tokenized

SpecialTextPolicy = Literal["text", "drop", "keep"]
_MASK = 0xF0000  # Supplementary Private Use Area-A: code point _MASK + k stands in for special string k


@dataclasses.dataclass(frozen=True)
class ChatEncoder:
    """Renders and tokenizes conversations with one tokenizer and one chat template.

    ``end_ids``: token ids that end an assistant turn (the tokenizer's EOS and the generation config's
    ``eos_token_id`` list). ``special_text``: what to do with a row whose content contains the text of a
    special token (e.g. a user typing ``<|im_end|>``), which the tokenizer would turn into a real control
    token: ``text`` (default: the row is kept and that text tokenized as plain text, as the tokenizer's
    ``split_special_tokens`` does, so it forges no turn boundary; the template's own control tokens stay
    tokens), ``drop`` (the row is skipped, counted as ``special_token_text``) or ``keep`` (tokenized as is:
    control tokens in content, what a server does with raw text).
    ``template_kwargs``: extra template variables passed to every rendering (e.g. ``enable_thinking``,
    ``reasoning_effort``). ``boilerplate``: token ids that, opening an assistant turn, are template text
    the model never generates (GLM: ``<think></think>``); unsupervised.
    """

    tokenizer: object
    template: str
    end_ids: frozenset[int]
    system_prompt: str | None = None
    special_text: SpecialTextPolicy = "text"
    template_kwargs: tuple[tuple[str, object], ...] = ()
    boilerplate: tuple[int, ...] = ()

    @property
    def template_sha256(self) -> str:
        return text_sha256(self.template)

    def special_strings(self) -> tuple[str, ...]:
        tok = self.tokenizer
        added = [t.content for t in getattr(tok, "added_tokens_decoder", {}).values() if t.special]
        return tuple(sorted(set(tok.all_special_tokens) | set(added), key=len, reverse=True))

    def _render(self, messages: Sequence[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=generation_prompt, chat_template=self.template,
            **dict(self.template_kwargs),
        )

    def _messages(self, conv: Conversation, specials: tuple[str, ...] = ()) -> list[dict]:
        """The template's messages of ``conv``; under the ``text`` policy every occurrence of a string of
        ``specials`` in them (content, reasoning, tool calls) replaced by its mask (:meth:`_tokenize`)."""
        extras = conv.extras or ({},) * len(conv.messages)
        messages = [{"role": r, "content": c, **x} for (r, c), x in zip(conv.messages, extras)]
        if self.system_prompt is not None and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        if self.special_text == "text" and specials:
            messages = _masked(messages, specials)
        return messages

    def encode(self, conv: Conversation, specials: tuple[str, ...] = ()) -> Tokenized | str:
        """Tokenize ``conv``. Returns :class:`Tokenized`, or a skip reason string (``special_token_text``).

        Raises CaptureError where a rendered prefix is not a prefix of the whole rendering, where a turn
        boundary falls inside a token, or where an assistant turn has no end-of-turn token.
        """
        if self._has_special_text(conv, specials):
            return "special_token_text"
        messages = self._messages(conv, specials)
        text = self._render(messages, generation_prompt=False)
        ids, _, boundary = self._tokenize(text, specials)
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
            start += self._boilerplate_at(ids, start)
            mask[start : ends[-1] + 1] = True
        return Tokenized(conv.sample_id, conv.row_index, conv.source, np.asarray(ids, dtype=np.int32), mask)

    def message_starts(self, conv: Conversation, specials: tuple[str, ...] = ()) -> list[tuple[str, int]]:
        """``(role, first token)`` of every rendered message of ``conv`` (the system turn, given or
        ``system_prompt``, first), as indices into :meth:`encode`'s ``input_ids``: message i starts at the
        first token at or after the end of the rendering of ``messages[:i]``. For diagnoses (``capture
        audit``): a template that breaks the prefix property there gives the nearest token, not an error."""
        messages = self._messages(conv, specials)
        text = self._render(messages, generation_prompt=False)
        _, starts, _ = self._tokenize(text, specials)
        out = []
        for i, m in enumerate(messages):
            end = len(self._render(messages[:i], generation_prompt=False)) if i else 0
            out.append((m["role"], next((j for j, s in enumerate(starts) if s >= end), len(starts))))
        return out

    def _boilerplate_at(self, ids: Sequence[int], start: int) -> int:
        """``len(self.boilerplate)`` when the assistant turn starting at token ``start`` opens with it, else 0."""
        n = len(self.boilerplate)
        return n if n and tuple(ids[start : start + n]) == self.boilerplate else 0

    def _has_special_text(self, conv: Conversation, specials: tuple[str, ...]) -> bool:
        """Whether ``conv`` is skipped as ``special_token_text``: under ``drop``, any of its text (content,
        reasoning, tool calls) holds a string of ``specials``; under ``text``, such text also holds
        characters of the mask range (U+F0000 and up, :func:`_masked`); never under ``keep``."""
        if self.special_text == "keep":
            return False
        texts = [content for _, content in conv.messages]
        texts += [x.get("reasoning_content", "") + json.dumps(x.get("tool_calls", []), ensure_ascii=False)
                  for x in conv.extras]
        special = [t for t in texts if any(s in t for s in specials)]
        if self.special_text == "drop":
            return bool(special)
        return any(ord(c) >= _MASK for t in special for c in t)

    def _tokenize(self, text: str, specials: tuple[str, ...] = ()) -> tuple[list[int], list[int], dict[int, int]]:
        """Token ids of ``text``, each token's first character, and the token index that starts at each
        character offset (the end of the text counts as a boundary).

        ``text`` may hold masks (``text`` policy, :func:`_masked`): special-token strings typed in the
        content, each replaced by as many copies of its own private-use character. Then the text is cut at
        the strings of ``specials`` that remain (the template's own control tokens, one token each) and
        every piece between them is tokenized with its masks turned back into their strings and
        ``split_special_tokens=True`` (plain text). Same-length masks keep every character offset, so the
        boundaries of the masked renderings are the boundaries of these tokens. Without masks this is the
        tokenizer's own call (the tokenizer cuts at control tokens the same way; tests/test_chat.py checks
        the two agree on real rows)."""
        if not any(ord(c) >= _MASK for c in text):
            enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
            ids, starts = enc["input_ids"], [start for start, _ in enc["offset_mapping"]]
        else:
            ids, starts = self._tokenize_pieces(text, specials)
        boundary = {start: j for j, start in reversed(list(enumerate(starts)))}
        boundary[len(text)] = len(ids)
        return ids, starts, boundary

    def _tokenize_pieces(self, text: str, specials: tuple[str, ...]) -> tuple[list[int], list[int]]:
        """:meth:`_tokenize`'s ids and token starts of a masked ``text``."""
        ids, starts, pos = [], [], 0
        for piece in re.split("(" + "|".join(map(re.escape, specials)) + ")", text):
            if piece in specials:
                ids.append(self.tokenizer.convert_tokens_to_ids(piece))
                starts.append(pos)
            elif piece:
                plain = _unmasked(piece, specials)
                enc = self.tokenizer(plain, add_special_tokens=False, return_offsets_mapping=True,
                                     split_special_tokens=True)
                ids += enc["input_ids"]
                starts += [pos + start for start, _ in enc["offset_mapping"]]
            pos += len(piece)
        return ids, starts

    def encode_prompt(self, conv: Conversation, policy: str = "last", specials: tuple[str, ...] = ()) -> Prompt | str:
        """The :class:`Prompt` segments for regenerating ``conv``'s assistant turns: ``policy="last"``
        regenerates the last one (everything after the last user turn is dropped; earlier answers stay as
        the dataset has them), ``"every"`` all of them in order. Returns a skip reason string like
        :meth:`encode` (``special_token_text``).

        The segments are cut out of the conversation rendered with placeholder answers: every generation
        prompt must end on a token boundary of that rendering (as in :meth:`encode`), every regenerated
        answer but the last must be rendered as its content followed directly by an end-of-turn token,
        and rendering with other placeholder text must give the same segments. Raises CaptureError
        naming the row otherwise.
        """
        if self._has_special_text(conv, specials):
            return "special_token_text"
        messages = self._messages(conv, specials)
        answers = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        turns = answers if policy == "every" else answers[-1:]
        if policy not in ("last", "every") or not turns:
            raise ValueError(f"encode_prompt: policy {policy!r} / {len(turns)} assistant turns")
        messages = messages[: turns[-1] + 1]
        first = self._segments(conv, messages, turns, "Answer number {k}.", specials)
        second = self._segments(conv, messages, turns, "a different, longer placeholder reply {k}", specials)
        if first[1] != second[1] or any(not np.array_equal(a, b) for a, b in zip(first[0], second[0])):
            raise CaptureError(
                f"{conv.sample_id}: the chat template renders the text between turns differently depending on "
                "the answers' content, so generated answers cannot be spliced into it"
            )
        return Prompt(conv.sample_id, conv.row_index, conv.source, *first)

    def _segments(self, conv: Conversation, messages: list[dict], turns: list[int], placeholder: str,
                  specials: tuple[str, ...] = ()) -> tuple[tuple[np.ndarray, ...], tuple[int, ...]]:
        """Segments and turn-end tokens of ``messages`` with the ``turns`` answered by placeholders."""
        texts = {t: placeholder.format(k=k) for k, t in enumerate(turns)}
        shown = [{"role": "assistant", "content": texts[i]} if i in texts else m for i, m in enumerate(messages)]
        text = self._render(shown, generation_prompt=False)
        ids, starts, boundary = self._tokenize(text, specials)
        begins = [self._boundary(text, boundary, self._render(shown[:t], generation_prompt=True), conv, t)
                  for t in turns]
        segments, ends, pos = [], [], 0
        for k, (t, begin) in enumerate(zip(turns, begins)):
            segments.append(np.asarray(ids[pos:begin], dtype=np.int32))
            if k == len(turns) - 1:
                break
            close = next((j for j in range(begin, begins[k + 1]) if ids[j] in self.end_ids), None)
            body = begin + self._boilerplate_at(ids, begin)
            if close is None or text[starts[body]:starts[close]] != texts[t]:
                raise CaptureError(
                    f"{conv.sample_id}: the chat template does not render assistant turn {t} as its content followed "
                    f"by an end-of-turn token (ids {sorted(self.end_ids)}), so a generated answer cannot be spliced in"
                )
            ends.append(int(ids[close]))
            pos = close + 1
        return tuple(segments), tuple(ends)

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
    special_text: SpecialTextPolicy = "text",
    template_kwargs: tuple[tuple[str, object], ...] = (),
) -> ChatEncoder:
    """Tokenizer and chat template of the model folder; ``chat_template_file`` overrides the template;
    ``template_kwargs`` are extra variables for every rendering.

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
    return ChatEncoder(tok, template, frozenset(end_ids), system_prompt, special_text, tuple(template_kwargs),
                       template_boilerplate(tok, template))


def packaged_template(name: str) -> str | None:
    """Path of the chat template this package ships for chat format ``name`` (``capture/templates/
    <name>.jinja``: ``glm``), or None. Presets with such a format use it unless ``--chat-template`` is
    given: the model's own serving template leaves the last assistant turn open (GLM ends a turn at the
    next role token), which the loss mask cannot close."""
    from importlib.resources import files

    path = files("capture").joinpath(f"templates/{name}.jinja")
    return str(path) if name and path.is_file() else None


def template_boilerplate(tokenizer, template: str) -> tuple[int, ...]:
    """Token ids of GLM's empty ``<think></think>`` when ``template`` inserts one (its text contains it),
    else ``()``. See the module docstring."""
    if "<think></think>" not in template:
        return ()
    return tuple(tokenizer("<think></think>", add_special_tokens=False)["input_ids"])


def _masked(value, specials: tuple[str, ...]):
    """``value`` (a message list, dict, string) with every string of ``specials`` in its strings replaced by
    its mask: ``len(s)`` copies of ``chr(_MASK + k)`` for ``specials[k]``, so that rendering keeps every
    character offset (text that already holds mask characters is skipped before, see
    :meth:`ChatEncoder._has_special_text`)."""
    if isinstance(value, str):
        for k, s in enumerate(specials):
            value = value.replace(s, chr(_MASK + k) * len(s))
        return value
    if isinstance(value, dict):
        return {key: _masked(v, specials) for key, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_masked(v, specials) for v in value)
    return value


def _unmasked(text: str, specials: tuple[str, ...]) -> str:
    """``text`` with every mask turned back into its special string (a run of ``n * len(s)`` copies of s's
    character is n copies of s)."""
    def restore(m: re.Match) -> str:
        s = specials[ord(m[1]) - _MASK]
        return s * (len(m[0]) // len(s))

    return re.sub(f"([{chr(_MASK)}-{chr(_MASK + len(specials) - 1)}])\\1*", restore, text)
