"""``capture provenance verify``: recompute every hash a run folder records.

Checked: every weight file of ``provenance.json`` (size and SHA-256), the chat template's SHA-256 against
the template text of the run header, the tokenizer's SHA-256 against the tokenizer in the model folder, and every shard the manifest names (size and SHA-256, with
:meth:`shards.run.Location.check_file`, the check ``capture shards verify`` starts with). The shards' contents
(rows, schema, decoding) are ``capture shards verify``'s job.
"""

from __future__ import annotations

import dataclasses
import os

from common.errors import CaptureError
from common.hashing import text_sha256
from provenance.record import read
from shards import manifest as manifest_mod
from shards.run import MANIFEST, FileMismatch, Location, as_location, check_file


@dataclasses.dataclass
class Report:
    """What was rechecked: ``weights`` and ``shards`` files, and every mismatch (``kind`` ``weight``,
    ``shard``, ``chat_template`` or ``tokenizer``, with the file's path, the field, expected and actual values)."""

    weights: int = 0
    shards: int = 0
    tokenizer: bool = False  # the tokenizer hash was recomputed
    mismatches: list[dict] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.mismatches


def verify(run_dir: str | os.PathLike | Location) -> Report:
    """Recheck ``run_dir`` (a path, a URI or a Location). Mismatches are listed, never raised. Raises
    CaptureError when ``run_dir`` holds no run (no manifest with a header) or its ``provenance.json`` is
    missing or invalid."""
    loc = as_location(run_dir)
    if not loc.is_folder():
        raise CaptureError(f"{run_dir} is not a folder")
    manifest = manifest_mod.read(loc)
    if manifest.header is None:
        raise CaptureError(f"{run_dir} holds no capture run ({loc.manifest_name} with a header)")
    data = read(loc)
    report = Report()

    def add(kind: str, bad: FileMismatch | None) -> None:
        if bad is not None:
            report.mismatches.append({"kind": kind, **dataclasses.asdict(bad)})

    for w in data["weights"]:
        report.weights += 1
        add("weight", check_file(w["path"], w["bytes"], w["sha256"]))
    template = manifest.header.chat_template
    if text_sha256(template) != data["chat_template_sha256"]:
        add("chat_template", FileMismatch(loc.join(MANIFEST), "chat_template_sha256",
                                          data["chat_template_sha256"], text_sha256(template)))
    if data.get("model_dir"):
        report.tokenizer = True
        found = _tokenizer_sha256(data["model_dir"])
        if found != data["tokenizer_sha256"]:
            add("tokenizer", FileMismatch(data["model_dir"], "tokenizer_sha256", data["tokenizer_sha256"], found))
    for entry in manifest.shards:
        report.shards += 1
        add("shard", loc.check_file(entry["path"], entry["bytes"], entry["sha256"]))
    return report


def _tokenizer_sha256(model_dir: str) -> str | None:
    """:func:`common.hashing.tokenizer_sha256` of the model folder's tokenizer; None when it cannot be loaded."""
    from transformers import AutoTokenizer

    from common.hashing import tokenizer_sha256

    try:
        return tokenizer_sha256(AutoTokenizer.from_pretrained(model_dir))
    except (OSError, ValueError):
        return None
