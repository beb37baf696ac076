"""A replica loads the run's model with the run's code, or writes nothing.

On a cluster every node loads the model from its own disk, at the path the driver names. A node set up by
hand may hold other weights, another config, tokenizer or chat template, or another version of this code:
its states would be mixed into the run without a trace (the header records the driver's files). So the
driver fingerprints its model folder and code (:func:`of`), hands the fingerprint to every replica, and a
replica compares its own (:func:`check`) before it loads its engine: a difference is a CaptureError
naming the fields, which stops the run with one line (:mod:`capture.pool`: a CaptureError is fatal).

The fingerprint (:class:`ModelIdentity`), cheap enough for every replica start at GLM-5.3 size:

* ``config``: SHA-256 of ``config.json``;
* ``tokenizer``: SHA-256 over the tokenizer and template files present (``TOKENIZER_FILES``), name and bytes;
* ``weights``: per weight file (:func:`provenance.record.weight_files`, by file name): its size and a SHA-256
  of 4 windows of 1 MiB (the start, which holds a safetensors header, one third, two thirds and the end).
  Another checkpoint (other values, same shapes) differs in every window; a single flipped bit outside
  them is ``capture provenance verify``'s job (whole-file hashes);
* ``code``: SHA-256 over this project's Python sources (name and bytes), so a worker with another version
  of the code, even an edited checkout of the same version, is caught.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import socket
from pathlib import Path

from common.errors import CaptureError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "tokenizer.model", "added_tokens.json", "chat_template.jinja", "chat_template.json",
                   "generation_config.json")
WINDOW = 1 << 20  # bytes hashed per window of a weight file
PACKAGES = ("capture", "shards", "filters", "provenance", "common", "drafter")  # this project's sources, and cli.py


@dataclasses.dataclass(frozen=True)
class ModelIdentity:
    """What a replica's model folder and code must match (module docstring). SHA-256s as hex."""

    config: str
    tokenizer: str
    weights: tuple[tuple[str, int, str], ...]  # (file name, bytes, SHA-256 of its windows)
    code: str


def of(model_dir: str | os.PathLike, target_source: str | None = None) -> ModelIdentity:
    """The fingerprint of ``model_dir`` (``target_source``: the target's ``source``, for a converted GGUF's
    source file) and of the running code. Raises CaptureError when a file cannot be read."""
    from provenance.record import weight_files

    folder = Path(model_dir)
    try:
        config = hashlib.sha256((folder / "config.json").read_bytes()).hexdigest()
        tok = hashlib.sha256()
        for name in TOKENIZER_FILES:
            if (folder / name).is_file():
                tok.update(f"{name}\0".encode() + (folder / name).read_bytes() + b"\0")
        weights = tuple((p.name, p.stat().st_size, _windows(p)) for _, p in weight_files(folder, target_source))
    except OSError as e:
        raise CaptureError(f"cannot read the model folder {folder}: {e.strerror or e} ({e.filename})") from None
    return ModelIdentity(config, tok.hexdigest(), weights, code_sha256())


def check(model_dir: str | os.PathLike, expected: ModelIdentity, target_source: str | None = None) -> None:
    """Raise CaptureError, naming this host and every field that differs, when ``model_dir`` and the running
    code are not what ``expected`` (the driver's :func:`of`) describes."""
    found = of(model_dir, target_source)
    differ = []
    if found.config != expected.config:
        differ.append("config.json")
    if found.tokenizer != expected.tokenizer:
        differ.append("tokenizer or chat template files")
    if found.weights != expected.weights:
        mine, theirs = dict((n, (b, h)) for n, b, h in found.weights), dict((n, (b, h)) for n, b, h in expected.weights)
        names = sorted(n for n in mine.keys() | theirs.keys() if mine.get(n) != theirs.get(n))
        differ.append(f"weights ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})")
    if found.code != expected.code:
        differ.append("capture's code (another version or an edited checkout)")
    if differ:
        raise CaptureError(f"the replica on {socket.gethostname()} finds {model_dir} or its code unlike the driver's: "
                           f"{'; '.join(differ)} differ; it wrote nothing. Give every node the run's model files and "
                           "the same capture code")


def code_sha256() -> str:
    """SHA-256 over this project's Python sources (``PACKAGES`` and ``cli.py``, sorted relative names and
    bytes) as this process imports them."""
    root = Path(__file__).resolve().parents[1]
    files = sorted(p for pkg in PACKAGES for p in (root / pkg).rglob("*.py")) + [root / "cli.py"]
    digest = hashlib.sha256()
    for path in files:
        if path.is_file():
            digest.update(f"{path.relative_to(root)}\0".encode() + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _windows(path: Path) -> str:
    """SHA-256 of the size and 4 windows of ``WINDOW`` bytes of ``path`` (start, 1/3, 2/3, end)."""
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        for at in sorted({0, size // 3, 2 * size // 3, max(0, size - WINDOW)}):
            f.seek(at)
            digest.update(f.read(WINDOW))
    return digest.hexdigest()
