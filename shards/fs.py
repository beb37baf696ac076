"""Where a run folder lives: a local folder or a prefix on any file system pyarrow supports.

``--out`` is a plain path (a local folder), a URI pyarrow understands (``s3://bucket/run``,
``gs://...``, ``hdfs://...``, ``file:///abs/path``; see ``pyarrow.fs.FileSystem.from_uri``), or
``objstore+file:///abs/path``: a local folder accessed with object-store semantics (:class:`NoRenameFS`),
the supported way to check object-store behaviour without a bucket. Everything travels as that string:
a replica (a separate process) rebuilds the file system with :func:`resolve`.

On a local folder shards are written to a temporary name, fsynced and renamed, and the manifest is one
appended file (``manifest.jsonl``). Anywhere else (``local`` False) nothing is renamed or appended: each
object is written whole under its final, unique name and exists only once its stream is closed; the
manifest is one object per entry (``manifest.d/``, see :mod:`shards.manifest`).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pyarrow.fs as pafs
from fsspec.implementations.local import LocalFileOpener, LocalFileSystem

OBJSTORE_SCHEME = "objstore+file://"


@dataclasses.dataclass(frozen=True)
class Location:
    """A run folder: ``path`` on ``filesystem``. ``local``: a folder of the local file system (rename,
    append and fsync available); else object-store rules apply."""

    filesystem: pafs.FileSystem
    path: str
    local: bool

    def join(self, name: str) -> str:
        """Path of ``name`` (relative to the run folder) on the file system."""
        return f"{self.path.rstrip('/')}/{name}"

    def names(self, sub: str = "") -> list[str]:
        """Names of the files directly in the run folder (or its subfolder ``sub``), sorted; none when
        the folder does not exist."""
        base = self.join(sub) if sub else self.path
        infos = self.filesystem.get_file_info(pafs.FileSelector(base, allow_not_found=True))
        return sorted(i.base_name for i in infos if i.type == pafs.FileType.File)

    def exists(self, name: str) -> bool:
        return self.filesystem.get_file_info(self.join(name)).type == pafs.FileType.File

    def read_bytes(self, name: str) -> bytes:
        """The whole file ``name``; raises FileNotFoundError when there is none."""
        with self.filesystem.open_input_stream(self.join(name)) as f:
            return f.read()

    def write_bytes(self, name: str, data: bytes) -> None:
        """Write ``name`` whole (replacing it). Atomic where the store makes a closed object visible
        at once (object stores); not atomic on a local folder (local writers use rename instead)."""
        with self.filesystem.open_output_stream(self.join(name)) as f:
            f.write(data)

    def delete(self, name: str) -> None:
        """Remove file ``name``; a missing one is fine."""
        try:
            self.filesystem.delete_file(self.join(name))
        except FileNotFoundError:
            pass


def resolve(out: str) -> Location:
    """``--out`` → :class:`Location` (see the module docstring). Raises CaptureError for a URI pyarrow
    cannot open (unknown scheme, missing credentials or driver)."""
    from capture.errors import CaptureError

    if out.startswith(OBJSTORE_SCHEME):
        path = out[len(OBJSTORE_SCHEME):]
        if not path.startswith("/"):
            raise CaptureError(f"{out}: {OBJSTORE_SCHEME} needs an absolute path ({OBJSTORE_SCHEME}/abs/path)")
        return Location(pafs.PyFileSystem(pafs.FSSpecHandler(NoRenameFS())), path.rstrip("/") or "/", False)
    if "://" in out:
        try:
            filesystem, path = pafs.FileSystem.from_uri(out)
        except (ValueError, OSError, ImportError) as e:
            raise CaptureError(f"cannot open {out}: {e}") from None
        if isinstance(filesystem, pafs.LocalFileSystem):
            return Location(filesystem, path, True)
        return Location(filesystem, path.rstrip("/"), False)
    return Location(pafs.LocalFileSystem(), str(out), True)


def as_location(run: "str | os.PathLike | Location") -> Location:
    """A Location as is; a ``str`` through :func:`resolve` (a path or a URI); another path-like: local."""
    if isinstance(run, Location):
        return run
    if isinstance(run, str):
        return resolve(run)
    return Location(pafs.LocalFileSystem(), str(Path(run)), True)


class _PutOnClose(LocalFileOpener):
    """A written object appears under its name only when closed (staged in the temp folder meanwhile)."""

    def close(self):
        if not self.autocommit and not self.f.closed:
            self.commit()  # closes the staged file, then moves it under its name
        return self.f.close()


class NoRenameFS(LocalFileSystem):
    """Object-store semantics over a local folder (``objstore+file://``), to test an object-store run
    without a bucket: whole-object writes made visible on close, no rename or move, no append (each
    raises OSError). Folders are made as needed, like prefixes."""

    def __init__(self, **kwargs):
        super().__init__(auto_mkdir=True, **kwargs)

    def mv(self, path1, path2, *args, **kwargs):
        raise OSError(f"object store: no rename ({path1} -> {path2})")

    rename = move = mv_file = mv

    def _open(self, path, mode="rb", block_size=None, **kwargs):
        if "a" in mode or "+" in mode:
            raise OSError(f"object store: no append ({path}, mode {mode})")
        if "r" in mode:
            return super()._open(path, mode, block_size, **kwargs)
        path = self._strip_protocol(path)
        self.makedirs(self._parent(path), exist_ok=True)
        return _PutOnClose(path, mode.replace("x", "w"), autocommit=False, fs=self)
