"""Dataset rows → normalized conversations, streamed.

:func:`iter_conversations` reads a dataset's rows (:func:`capture.dataset.iter_rows`) one at a time; nothing
holds the whole corpus in memory. Every row read is either yielded
as a :class:`Conversation` or counted in :class:`ReadStats` under exactly one skip reason, so
``rows_read == yielded + sum(skipped.values())`` always holds.

Conventions and where they come from:

* Row formats: ShareGPT (``conversations: [{from, value}]``, the format of ShareGPT V3 and
  Open-PerfectBlend) and OpenAI chat (``messages: [{role, content}]``, the format of the OpenAI chat API
  and of most Hugging Face SFT sets). When both columns hold a value, ``conversations`` wins. A turn may
  use either key pair (``from``/``value`` or ``role``/``content``), since mixed files occur in the wild.
* Role names: ``human``/``user`` → user; ``gpt``/``chatgpt``/``bing``/``bard`` (ShareGPT V3 names of the
  chat services the logs came from), ``assistant`` (OpenAI) and ``model`` (Gemini) → assistant;
  ``system`` → system; ``tool`` / ``observation`` → tool (a tool result; structured rows only, below).
  Matched case-insensitively after stripping whitespace.
* Turn order: the chat templates of current instruction models expect ``[system] user assistant
  (user assistant)*``; see :func:`iter_conversations` for how rows are brought into that shape.
* Structured rows (OpenAI ``messages`` with ``reasoning_content`` on assistant turns, ``tool_calls``, or
  ``role: tool`` results; any row with one of these) keep them in :attr:`Conversation.extras` and are
  checked, never repaired: see :func:`_normalize_structured`. Every other row takes the plain path below,
  so ShareGPT / Open-PerfectBlend reading is unchanged.
* Content is never altered: whitespace inside and around a turn is real data and kept byte-exact.
  The one exception is merging two consecutive turns of one role, joined with ``"\\n\\n"`` (the
  paragraph break that the merged text would have carried had it been written as one turn).
"""

from __future__ import annotations

import collections
import itertools
import json
import logging
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from capture.dataset import DatasetRef, InvalidLine, ReadStats, iter_rows
from common.errors import CaptureError

log = logging.getLogger(__name__)

Role = Literal["system", "user", "assistant", "tool"]
Alternation = Literal["normalize", "skip"]

_ROLES: dict[str, Role] = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "system": "system",
    "tool": "tool",  # OpenAI tool results; GLM renders them in an <|observation|> turn
    "observation": "tool",
}


@dataclass(frozen=True)
class Conversation:
    """One normalized conversation: ``[system?] user assistant (user assistant)*``."""

    sample_id: str  # f"{dataset.name}:{row_index}", stable across reads
    row_index: int  # 0-based index of the row in the raw dataset (before any filter)
    source: str  # the row's `source` column if a non-empty string, else the dataset name
    messages: tuple[tuple[Role, str], ...]
    # per message, aligned with `messages`: {"reasoning_content": str, "tool_calls": [{"name", "arguments": dict}]}
    # (only the keys a turn has); empty for plain rows (ShareGPT, Open-PerfectBlend). See `_normalize_structured`.
    extras: tuple[dict, ...] = ()


def iter_conversations(
    ref: DatasetRef,
    stats: ReadStats,
    *,
    limit: int | None = None,
    skip: int = 0,
    sources: Collection[str] = (),
    exclude_sources: Collection[str] = (),
    source_caps: Mapping[str, int] | None = None,
    alternation: Alternation = "normalize",
    source_column: str = "source",
) -> Iterator[Conversation]:
    """Yield the dataset's rows as normalized :class:`Conversation` objects, streaming.

    ``skip`` raw rows are passed over first (their row indices, and so the sample ids of the rows
    after them, are kept: ``skip=1000`` starts at ``<dataset>:1000``); ``limit`` then caps the raw rows
    read (before any filter or skip reason). ``source_column`` names the column
    that gives a row's source (Open-PerfectBlend: ``source``). Each row read is either yielded or
    skipped with exactly one reason, counted in ``stats.skipped`` and logged at DEBUG:

    * ``source_not_selected`` / ``source_excluded``: filtered by ``sources`` / ``exclude_sources``;
    * ``source_cap``: ``source_caps[source]`` rows of that source were already yielded;
    * ``no_conversation_column``: neither ``conversations`` nor ``messages`` holds a value;
    * ``malformed_turn``: the column is not a list, or a turn is not a dict;
    * ``unknown_role``: a role outside the table in the module docstring (or missing);
    * ``non_string_content``: a turn's content is not a string (null, number, list of parts);
    * ``invalid_text``: content that is not valid Unicode text (a lone surrogate escape such as ``\\ud800``);
    * ``empty_conversation``: no turn with non-whitespace content;
    * ``system_not_first``: a system turn anywhere but first (never repaired);
    * ``no_assistant_turn``: no assistant turn that answers a user turn.

    With ``alternation="normalize"`` these fixes are applied in order, each counted once per yielded row
    in ``stats.normalized``: ``empty_turn_removed`` (empty or whitespace-only turns dropped),
    ``leading_assistant_removed`` (assistant turns before the first user turn dropped),
    ``same_role_merged`` (consecutive same-role turns joined with ``"\\n\\n"``), ``trailing_user_removed``
    (an unanswered final user turn dropped). With ``alternation="skip"`` a row needing any of them is
    skipped with the fix's name as reason.

    The ``sharegpt`` alias is read with ``ijson``; its file is cut off mid-record, so at the parse error
    ``stats.truncated`` is set, a warning is logged and iteration ends normally. Other datasets are read
    with ``json`` line by line (.jsonl), ijson (.json) or ``datasets.load_dataset(..., streaming=True)``
    (Parquet, Arrow, hub ids). Raises :class:`CaptureError` on bad arguments, or
    if a dataset cannot be loaded or a row cannot be read (message names the dataset).
    """
    if alternation not in ("normalize", "skip"):
        raise CaptureError(f"alternation must be 'normalize' or 'skip', got {alternation!r}")
    if limit is not None and limit < 0:
        raise CaptureError(f"limit must be >= 0, got {limit}")
    if skip < 0:
        raise CaptureError(f"skip must be >= 0, got {skip}")
    caps = dict(source_caps or {})
    for src, cap in caps.items():
        if cap < 0:
            raise CaptureError(f"source cap for {src!r} must be >= 0, got {cap}")
    sources, exclude_sources = set(sources), set(exclude_sources)
    per_source: collections.Counter = collections.Counter()

    # islice stops before pulling row `skip + limit`, so the reader never looks past it
    end = None if limit is None else skip + limit
    for row_index, row in enumerate(itertools.islice(iter_rows(ref, stats), skip, end), start=skip):
        stats.rows_read += 1
        sample_id = f"{ref.name}:{row_index}"
        src = row.get(source_column) if isinstance(row, dict) else None
        src = src if isinstance(src, str) and src else ref.name
        if sources and src not in sources:
            reason = "source_not_selected"
        elif src in exclude_sources:
            reason = "source_excluded"
        elif src in caps and per_source[src] >= caps[src]:
            reason = "source_cap"
        else:
            messages, outcome = _normalize(row, alternation)
            if messages is not None:
                stats.yielded += 1
                stats.normalized.update(outcome)
                per_source[src] += 1
                extras: tuple[dict, ...] = ()
                if isinstance(messages, _Structured):
                    messages, extras = messages.messages, messages.extras
                yield Conversation(sample_id=sample_id, row_index=row_index, source=src, messages=messages,
                                   extras=extras)
                continue
            reason = outcome[0]
        stats.skipped[reason] += 1
        log.debug("skip %s: %s", sample_id, reason)


# --- normalization ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Structured:
    messages: tuple[tuple[Role, str], ...]
    extras: tuple[dict, ...]


def _is_structured(turns: list) -> bool:
    """A row with reasoning, tool calls or tool results (OpenAI style) anywhere."""
    for t in turns:
        if not isinstance(t, dict):
            continue
        role = _first_present(t, "from", "role")
        if isinstance(role, str) and _ROLES.get(role.strip().lower()) == "tool":
            return True
        if t.get("tool_calls") or (isinstance(t.get("reasoning_content"), str) and t["reasoning_content"].strip()):
            return True
    return False


def _normalize(row: Any, alternation: Alternation) -> tuple[Any, list[str]]:
    """``(messages, fixes applied)`` for a usable row, ``(None, [skip reason])`` otherwise."""
    turns = _column(row)
    if isinstance(turns, str):  # a skip reason
        return None, [turns]
    if _is_structured(turns):
        return _normalize_structured(turns, alternation)
    parsed: list[tuple[Role, str]] = []
    for turn in turns:
        role_content = _role_and_content(turn)
        if isinstance(role_content, str):
            return None, [role_content]
        role, content = role_content
        if not isinstance(content, str):
            return None, ["non_string_content"]
        if not _is_utf8(content):
            return None, ["invalid_text"]
        parsed.append((role, content))

    fixes: list[str] = []

    def fix(name: str) -> bool:
        """Record that fix `name` is needed; False when the policy says to skip instead."""
        fixes.append(name)
        return alternation == "normalize"

    kept = [(role, content) for role, content in parsed if content.strip()]
    if len(kept) < len(parsed) and not fix("empty_turn_removed"):
        return None, ["empty_turn_removed"]
    if not kept:
        return None, ["empty_conversation"]
    if any(role == "system" for role, _ in kept[1:]):
        return None, ["system_not_first"]
    head, body = (kept[:1], kept[1:]) if kept[0][0] == "system" else ([], kept)
    if not any(role == "assistant" for role, _ in body):
        return None, ["no_assistant_turn"]

    first_user = next((i for i, (role, _) in enumerate(body) if role == "user"), len(body))
    if first_user and not fix("leading_assistant_removed"):
        return None, ["leading_assistant_removed"]
    body = body[first_user:]

    merged: list[tuple[Role, str]] = []
    for role, content in body:
        if merged and merged[-1][0] == role:
            merged[-1] = (role, merged[-1][1] + "\n\n" + content)
        else:
            merged.append((role, content))
    if len(merged) < len(body) and not fix("same_role_merged"):
        return None, ["same_role_merged"]

    if merged and merged[-1][0] == "user":
        if not fix("trailing_user_removed"):
            return None, ["trailing_user_removed"]
        merged.pop()
    if not merged:  # only assistant turns, none answering a user turn
        return None, ["no_assistant_turn"]
    return tuple(head + merged), fixes


def _tool_calls(value: Any) -> list[dict] | None:
    """OpenAI ``tool_calls`` (``[{"function": {"name", "arguments"}}]``, arguments a JSON object or its
    JSON text) or bare ``[{"name", "arguments"}]`` → ``[{"name": str, "arguments": dict}]``; None if malformed."""
    if not isinstance(value, list):
        return None
    out = []
    for call in value:
        f = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            return None
        args = f.get("arguments") or {}
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if not isinstance(args, dict):
            return None
        out.append({"name": f["name"], "arguments": args})
    return out


def _normalize_structured(turns: list, alternation: Alternation) -> tuple[_Structured | None, list[str]]:
    """Rows with reasoning / tool calls / tool results. Checked, not repaired (merging or dropping turns
    would break the call → result pairing); the one fix is ``trailing_user_removed`` (unanswered user or
    tool turns at the end). Skip reasons besides the plain path's: ``malformed_tool_call`` (a call without
    a string name, or arguments that are not a JSON object) and ``turn_order``: the body must be
    ``user (assistant | tool | user)*`` where a tool turn follows an assistant turn with tool calls or
    another tool turn, an assistant turn follows a user or tool turn, and a user turn opens the body or
    follows an assistant turn without calls or a tool turn (so a call is always answered by its results
    before anything else, and two user turns never meet: they are not merged here).
    An assistant turn's content may be null or empty when it has tool calls or reasoning."""
    messages: list[tuple[Role, str]] = []
    extras: list[dict] = []
    for turn in turns:
        role_content = _role_and_content(turn)
        if isinstance(role_content, str):
            return None, [role_content]
        role, content = role_content
        extra: dict = {}
        if role == "assistant":
            if isinstance(turn.get("reasoning_content"), str) and turn["reasoning_content"].strip():
                extra["reasoning_content"] = turn["reasoning_content"]
            if turn.get("tool_calls"):
                calls = _tool_calls(turn["tool_calls"])
                if calls is None:
                    return None, ["malformed_tool_call"]
                extra["tool_calls"] = calls
            if content is None and extra:
                content = ""
        if not isinstance(content, str):
            return None, ["non_string_content"]
        texts = [content, extra.get("reasoning_content", ""), json.dumps(extra.get("tool_calls", []))]
        if not all(_is_utf8(t) for t in texts):
            return None, ["invalid_text"]
        messages.append((role, content))
        extras.append(extra)
    if any(role == "system" for role, _ in messages[1:]):
        return None, ["system_not_first"]
    start = 1 if messages and messages[0][0] == "system" else 0
    fixes: list[str] = []
    end = len(messages)
    while end > start and messages[end - 1][0] in ("user", "tool"):
        end -= 1
    if end < len(messages):
        if alternation == "skip":
            return None, ["trailing_user_removed"]
        fixes.append("trailing_user_removed")
    if not any(role == "assistant" for role, _ in messages[start:end]):
        return None, ["no_assistant_turn"]
    prev = None  # role of the previous body turn, "assistant+calls" for an assistant turn with tool calls
    for (role, _), extra in zip(messages[start:end], extras[start:end]):
        ok = {"user": prev in (None, "assistant", "tool"), "assistant": prev in ("user", "tool"),
              "tool": prev in ("assistant+calls", "tool")}[role]
        if not ok:
            return None, ["turn_order"]
        prev = "assistant+calls" if role == "assistant" and extra.get("tool_calls") else role
    return _Structured(tuple(messages[:end]), tuple(extras[:end])), fixes


def _column(row: Any) -> list | str:
    """The row's list of turns, or a skip reason."""
    if isinstance(row, InvalidLine):
        return "invalid_json"
    if not isinstance(row, dict):
        return "no_conversation_column"
    for column in ("conversations", "messages"):
        value = row.get(column)
        if value is not None:
            return value if isinstance(value, list) else "malformed_turn"
    return "no_conversation_column"


def _is_utf8(text: str) -> bool:
    """False for text no tokenizer can take, e.g. a lone surrogate ``"\\ud800"`` that JSON can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _role_and_content(turn: Any) -> tuple[Role, Any] | str:
    """A turn's normalized role and its raw content (either key pair), or the skip reason
    (``malformed_turn``: not a dict; ``unknown_role``)."""
    if not isinstance(turn, dict):
        return "malformed_turn"
    role_name = _first_present(turn, "from", "role")
    role = _ROLES.get(role_name.strip().lower()) if isinstance(role_name, str) else None
    if role is None:
        return "unknown_role"
    return role, _first_present(turn, "value", "content")


def _first_present(turn: dict, *keys: str) -> Any:
    """The first of ``keys`` whose value is not None (a `datasets` schema union fills absent keys with None)."""
    for key in keys:
        if turn.get(key) is not None:
            return turn[key]
    return None
