"""Where a run lives: the one owner of every file operation on a run folder, local or on an object store.

A run is named by a plain path (a local folder), a URI pyarrow understands (``s3://bucket/run``,
``gs://...``, ``hdfs://...``, ``file:///abs/path``; see ``pyarrow.fs.FileSystem.from_uri``), or
``objstore+file:///abs/path``: a local folder accessed with object-store semantics (:class:`NoRenameFS`),
the supported way to check object-store behaviour without a bucket. :func:`as_location` turns any of
them into a :class:`Location`; every command and reader takes its run through it, and nothing outside
this module asks which kind of store it has.

The folder's layout: ``manifest.jsonl`` (the commit log, :mod:`shards.manifest`), the committed shards
``shard-<utc time>-<random>.arrow``, ``provenance.json``, and ``.capture.lock`` while a process writes.

The two kinds differ only here:

=====================  ===========================================  ============================================
operation              local folder                                 object store (``local`` False)
=====================  ===========================================  ============================================
lock                   ``filelock`` on ``.capture.lock``            advisory ``.capture.lock`` object (host,
                                                                    pid, start); a killed writer leaves it
new shard              ``.tmp-<name>`` → fsync → rename → dir fsync  streamed to its final name, visible on close
manifest               one appended, fsynced ``manifest.jsonl``     one object per entry,
                       (a torn last line is cut before appending)   ``manifest.d/<seq:010d>-<kind>.json``
whole-file write       temporary file → fsync → ``os.replace``      one object, visible whole on close
read a shard           memory-mapped (untouched columns never read)  fetched whole (an IPC stream has no index)
free space             ``shutil.disk_usage``                        not known (None)
=====================  ===========================================  ============================================
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import time
from pathlib import Path
from typing import Iterator

import pyarrow as pa
import pyarrow.fs as pafs
from fsspec.implementations.local import LocalFileOpener
from fsspec.implementations.local import LocalFileSystem as FsspecLocalFS

from common.errors import CaptureError
from shards.format import FormatError, read_ipc

log = logging.getLogger(__name__)

OBJSTORE_SCHEME = "objstore+file://"
MANIFEST = "manifest.jsonl"
MANIFEST_DIR = "manifest.d"  # the manifest of a run on an object store: one object per entry
ENTRY = re.compile(r"(\d{10})-[a-z]+\.json")
LOCK = ".capture.lock"  # held by the one process writing a run folder (capture run, recode)
TMP_PREFIX = ".tmp-"


def plain_name(name: object) -> bool:
    """Whether ``name`` is a plain file name: a non-empty string, not ``.`` or ``..``, with no ``/``, ``\\``,
    NUL or other control character (what every file of a run is called; see the layout above)."""
    return (isinstance(name, str) and name not in ("", ".", "..")
            and not any(c in "/\\" or ord(c) < 32 for c in name))


@dataclasses.dataclass(frozen=True)
class FileMismatch:
    """A file that is not what a record says: ``field`` is ``missing``, ``bytes`` or ``sha256``;
    ``expected``/``actual`` are the recorded and the found values (sizes in bytes, hashes as hex)."""

    path: str
    field: str
    expected: str | int | None
    actual: str | int | None


@dataclasses.dataclass(frozen=True)
class Location:
    """A run folder: ``path`` on ``filesystem``. A ``pyarrow.fs.LocalFileSystem`` is a local folder
    (rename, append and fsync available); any other file system follows object-store rules."""

    filesystem: pafs.FileSystem
    path: str

    @property
    def local(self) -> bool:
        return isinstance(self.filesystem, pafs.LocalFileSystem)

    def __str__(self) -> str:
        return self.path

    @property
    def manifest_name(self) -> str:
        """What holds the manifest here, for messages: ``manifest.jsonl`` or ``manifest.d/``."""
        return MANIFEST if self.local else f"{MANIFEST_DIR}/"

    def absolute(self) -> "Location":
        """The same run with an absolute local path (what another process, e.g. a replica, can open)."""
        return Location(self.filesystem, os.path.abspath(self.path)) if self.local else self

    def contains(self, local_path: str | os.PathLike) -> bool:
        """Whether the local ``local_path`` lies inside this run folder (never, for an object store)."""
        return self.local and Path(local_path).resolve().is_relative_to(Path(self.path).resolve())

    # ------------------------------------------------------------ names and whole files

    def join(self, name: str) -> str:
        """Path of ``name`` (relative to the run folder: plain names, ``/``-separated for a subfolder such as
        ``manifest.d/``) on the file system. Raises CaptureError for any other name (``..``, an absolute
        path, a backslash, an empty part): names come from manifests and acks, which runs that are shared
        and downloaded may carry crafted, and nothing outside the run folder is ever opened or deleted."""
        if not isinstance(name, str) or not all(map(plain_name, name.split("/"))):
            raise CaptureError(f"{self.path}: {name!r} is not a file name inside the run folder; refused "
                               "(a damaged or crafted manifest or ack)")
        return f"{self.path.rstrip('/')}/{name}"

    def names(self, sub: str = "") -> list[str]:
        """Names of the files directly in the run folder (or its subfolder ``sub``), sorted; none when
        the folder does not exist."""
        base = self.join(sub) if sub else self.path
        infos = self.filesystem.get_file_info(pafs.FileSelector(base, allow_not_found=True))
        return sorted(i.base_name for i in infos if i.type == pafs.FileType.File)

    def entries(self) -> list[str]:
        """Names of everything directly in the run folder (files and folders), sorted."""
        infos = self.filesystem.get_file_info(pafs.FileSelector(self.path, allow_not_found=True))
        return sorted(i.base_name for i in infos)

    def kind(self) -> pafs.FileType:
        """What the run path itself is: ``Directory``, ``File`` or ``NotFound`` (an object-store prefix
        with no object under it is ``NotFound`` or ``Directory``, by store)."""
        return self.filesystem.get_file_info(self.path).type

    def is_folder(self) -> bool:
        """Whether the run path is an existing folder; always True on an object store, where a prefix
        exists as soon as it is named (an empty one holds no run, which readers then say)."""
        return not self.local or self.kind() == pafs.FileType.Directory

    def exists(self, name: str) -> bool:
        return self.filesystem.get_file_info(self.join(name)).type == pafs.FileType.File

    def size(self, name: str) -> int | None:
        """Bytes of the file ``name``; None when there is none."""
        info = self.filesystem.get_file_info(self.join(name))
        return info.size if info.type == pafs.FileType.File else None

    def read_bytes(self, name: str) -> bytes:
        """The whole file ``name``; raises FileNotFoundError when there is none."""
        with self.filesystem.open_input_stream(self.join(name)) as f:
            return f.read()

    def write_bytes(self, name: str, data: bytes) -> None:
        """Replace ``name`` whole and atomically: a reader sees the old or the new content, never a mix
        (local: temporary file, fsync, ``os.replace``, folder fsync; object store: one object, visible
        when closed). Raises OSError from the store."""
        if not self.local:
            with self.filesystem.open_output_stream(self.join(name)) as f:
                f.write(data)
            return
        folder = Path(self.path)
        tmp = folder / f".{name}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, folder / name)
        _fsync_dir(folder)

    def delete(self, name: str) -> None:
        """Remove file ``name``; a missing one is fine."""
        try:
            self.filesystem.delete_file(self.join(name))
        except FileNotFoundError:
            pass

    def create(self) -> None:
        """Make the run folder (and its parents); an existing one is fine. Raises OSError."""
        if self.local:
            Path(self.path).mkdir(parents=True, exist_ok=True)
        else:
            self.filesystem.create_dir(self.path, recursive=True)

    def free_bytes(self) -> int | None:
        """Free bytes where the run folder is (or would be: its nearest existing parent); None on an
        object store, which has no free space to speak of."""
        if not self.local:
            return None
        path = Path(self.path).resolve()
        existing = next(p for p in (path, *path.parents) if p.exists())
        return shutil.disk_usage(existing).free

    # ------------------------------------------------------------ the run lock

    @contextlib.contextmanager
    def lock(self, busy: str) -> Iterator[None]:
        """Hold the run's write lock for the ``with`` block (the folder is created first). Raises
        CaptureError(``busy``) when another process holds it, or when the folder cannot be written.

        Local: ``filelock`` on ``.capture.lock`` (released by the OS if the process dies). Object store:
        the advisory ``.capture.lock`` object (an object store has no atomic create-if-absent, so two
        writers started at the same instant are not told apart); a killed writer leaves it behind and
        the message says how to remove it; a failing delete at the end is logged, not raised.
        """
        if self.local:
            from filelock import FileLock, Timeout

            lock = FileLock(os.path.join(self.path, LOCK))
            try:
                self.create()
                lock.acquire(timeout=0)
            except Timeout:
                raise CaptureError(busy) from None
            except OSError as e:
                raise CaptureError(f"cannot write to {self.path}: {e.strerror or e}") from None
            try:
                yield
            finally:
                lock.release()
            return
        if self.exists(LOCK):
            raise CaptureError(f"{busy}; if no process writes, delete {self.join(LOCK)} and rerun")
        try:
            self.write_bytes(LOCK, json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                               "start": time.time()}).encode() + b"\n")
        except OSError as e:
            raise CaptureError(f"cannot write to {self.path}: {e}") from None
        try:
            yield
        finally:
            try:
                self.delete(LOCK)
            except OSError as e:  # the store fails: the caller's own outcome is what to report
                log.warning("cannot remove %s: %s; delete it before the next run", self.join(LOCK), e)

    # ------------------------------------------------------------ shards

    def open_shard(self, name: str) -> "ShardSink":
        """A new shard file ``name`` to stream into; it becomes visible under ``name`` only at
        :meth:`ShardSink.finish` (local: written as ``.tmp-<name>``, never overwriting; object store:
        streamed to ``name``, visible on close)."""
        return ShardSink(self, name)

    def read_table(self, name: str, columns: list[str] | None = None, rows: int | None = None) -> pa.Table:
        """The shard ``name`` as a table, or only ``columns`` (see :func:`shards.format.read_ipc`): local
        shards are memory-mapped, others fetched whole. ``rows``: the row count its manifest line records,
        checked. Raises FormatError for an unreadable shard, an unknown format version or an unknown
        column, or a row count other than ``rows``."""
        path = self.join(name)
        try:
            if self.local:
                with pa.memory_map(path) as source:
                    table = read_ipc(source, path, columns)
            else:
                with self.filesystem.open_input_file(path) as source:
                    table = read_ipc(source, path, columns)
        except (OSError, pa.ArrowInvalid) as e:
            raise FormatError(f"cannot read shard {path}: {e}; `capture shards verify` checks the whole run") from None
        if rows is not None and table.num_rows != rows:
            raise FormatError(f"shard {path} holds {table.num_rows} rows where the manifest records {rows}; the run "
                              "is damaged (`capture shards verify` checks the whole run)")
        return table

    def check_file(self, name: str, size: int, sha256: str) -> FileMismatch | None:
        """Recheck file ``name`` against its recorded size (bytes) and SHA-256 (hex), hashed streamed in
        1 MiB reads. None when both match, else the first difference; never raises for a missing file."""
        path = self.join(name)
        info = self.filesystem.get_file_info(path)
        if info.type != pafs.FileType.File:
            return FileMismatch(path, "missing", size, None)
        if info.size != size:
            return FileMismatch(path, "bytes", size, info.size)
        sha = hashlib.sha256()
        with self.filesystem.open_input_stream(path) as f:
            while chunk := f.read(1 << 20):
                sha.update(chunk)
        if sha.hexdigest() != sha256:
            return FileMismatch(path, "sha256", sha256, sha.hexdigest())
        return None

    def garbage(self, committed: set[str]) -> list[str]:
        """Names of shard files no manifest line names (``committed``): temporary files of an interrupted
        write and shards closed but never committed. Only names the shard writer makes count
        (``shard-*.arrow``, ``.tmp-shard-*.arrow``)."""
        return [n for n in self.names() if n not in committed and n.endswith(".arrow")
                and n.removeprefix(TMP_PREFIX).startswith("shard-")]

    # ------------------------------------------------------------ the manifest log

    def read_manifest(self) -> tuple[bytes, str]:
        """The manifest's bytes (one JSON line per entry, maybe a torn last line) and its name for
        errors: ``manifest.jsonl`` when there is one, else the entries of ``manifest.d/`` in order;
        neither gives ``b""``. Raises CaptureError for a missing or malformed entry object."""
        try:
            return self.read_bytes(MANIFEST), self.join(MANIFEST)
        except FileNotFoundError:
            pass
        except NotADirectoryError:
            raise CaptureError(f"{self.path} is not a folder (it, or a folder above it, is a file)") from None
        data = []
        for i, name in enumerate(n for n in self.names(MANIFEST_DIR) if ENTRY.fullmatch(n)):
            entry = self.read_bytes(f"{MANIFEST_DIR}/{name}")
            if int(name[:10]) != i:
                raise CaptureError(f"{self.join(MANIFEST_DIR)}: entry {i} is missing (next is {name}); the manifest is damaged")
            if not entry.endswith(b"\n") or b"\n" in entry[:-1]:
                raise CaptureError(f"{self.join(MANIFEST_DIR)}/{name} is not one manifest line; the manifest is damaged")
            data.append(entry)
        return b"".join(data), self.join(MANIFEST if self.local else MANIFEST_DIR)

    def delete_manifest(self) -> None:
        """Remove the manifest (``manifest.jsonl``, or every entry object of ``manifest.d/``): for a run
        that holds nothing yet (:func:`shards.manifest.reset`)."""
        if self.local:
            self.delete(MANIFEST)
        else:
            for name in self.names(MANIFEST_DIR):
                self.delete(f"{MANIFEST_DIR}/{name}")

    def manifest_log(self, committed_bytes: int) -> "ManifestLog":
        """The writer of the manifest log, for the run's one writer (the driver, or recode): local, the
        appended ``manifest.jsonl``, cut first to its ``committed_bytes`` (a torn last line goes); object
        store, entry objects numbered after the existing ones. Raises CaptureError for an object-store
        run that holds a ``manifest.jsonl`` (copied from a local folder: it could never be appended)."""
        if self.local:
            path = Path(self.path) / MANIFEST
            if not path.exists() and any(ENTRY.fullmatch(n) for n in self.names(MANIFEST_DIR)):
                raise CaptureError(f"{self.path} keeps its manifest in {MANIFEST_DIR}/ (a run made on an object store); "
                                   f"extend it as objstore+file://{Path(self.path).resolve()} or on its store")
            with open(path, "ab") as f:
                f.truncate(committed_bytes)
            return ManifestLog(self, path=path)
        if self.exists(MANIFEST):
            raise CaptureError(f"{self.path} holds a {MANIFEST} (a run copied from a local folder); runs on an "
                               f"object store keep their manifest in {MANIFEST_DIR}/: extend it locally")
        entries = [n for n in self.names(MANIFEST_DIR) if ENTRY.fullmatch(n)]
        return ManifestLog(self, seq=int(entries[-1][:10]) + 1 if entries else 0)


@dataclasses.dataclass
class ManifestLog:
    """Appends manifest entries (see :meth:`Location.manifest_log`); one writer only."""

    location: Location
    path: Path | None = None  # local: manifest.jsonl
    seq: int = 0  # object store: the next entry number

    def append(self, entry: dict) -> None:
        """Commit one entry: an fsynced line (object store: one entry object, visible whole on close)."""
        line = json.dumps(entry, sort_keys=True).encode() + b"\n"
        if self.path is not None:
            with open(self.path, "ab") as f:
                f.write(line)
                f.flush()
                os.fsync(f.fileno())
            return
        self.location.write_bytes(f"{MANIFEST_DIR}/{self.seq:010d}-{entry['kind']}.json", line)
        self.seq += 1


class ShardSink:
    """A shard file being written (see :meth:`Location.open_shard`): a file-like sink for pyarrow that
    hashes (SHA-256) and counts the bytes as they are written. :meth:`finish` makes it visible under
    its name; :meth:`abort` removes what was written."""

    def __init__(self, location: Location, name: str):
        self.location, self.name = location, name
        self.sha = hashlib.sha256()
        self.size = 0
        self.closed = False
        if location.local:
            self._tmp = Path(location.path) / (TMP_PREFIX + name)
            self.file = open(self._tmp, "xb")  # never overwrite
        else:
            self._tmp = None
            self.file = location.filesystem.open_output_stream(location.join(name))

    def write(self, data) -> int:
        self.sha.update(data)
        self.size += len(memoryview(data))
        return self.file.write(data)

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        self.file.flush()

    def close(self) -> None:  # pyarrow closes its sink with the stream; the file is closed by finish()
        self.closed = True

    def finish(self) -> None:
        """Make the shard visible under its name: local, fsync, rename, folder fsync; object store,
        close the object. Raises OSError (e.g. ENOSPC)."""
        if self._tmp is None:
            self.file.close()
            return
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        os.rename(self._tmp, self._tmp.with_name(self.name))
        _fsync_dir(self._tmp.parent)

    def abort(self) -> None:
        """Drop the shard: close and remove the temporary file or the object (best effort on a failing
        store: a leftover is garbage, see :meth:`Location.garbage`)."""
        try:
            self.file.close()  # flushing the buffer can raise ENOSPC again: the file goes anyway
        except OSError:
            pass
        try:
            if self._tmp is not None:
                self._tmp.unlink(missing_ok=True)
            else:
                self.location.delete(self.name)
        except OSError:
            pass


def check_file(path: str | os.PathLike, size: int, sha256: str) -> FileMismatch | None:
    """:meth:`Location.check_file` for one file named by its path or URI (e.g. a weight file)."""
    folder, _, name = os.fspath(path).rpartition("/")
    return as_location(folder or ".").check_file(name, size, sha256)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def resolve(out: str) -> Location:
    """A path or URI → :class:`Location` (see the module docstring). Raises CaptureError for a URI
    pyarrow cannot open (unknown scheme, missing credentials or driver)."""
    if out.startswith(OBJSTORE_SCHEME):
        path = out[len(OBJSTORE_SCHEME):]
        if not path.startswith("/"):
            raise CaptureError(f"{out}: {OBJSTORE_SCHEME} needs an absolute path ({OBJSTORE_SCHEME}/abs/path)")
        return Location(pafs.PyFileSystem(pafs.FSSpecHandler(NoRenameFS())), path.rstrip("/") or "/")
    if "://" in out:
        try:
            filesystem, path = pafs.FileSystem.from_uri(out)
        except (ValueError, OSError, ImportError) as e:
            raise CaptureError(f"cannot open {out}: {e}") from None
        return Location(filesystem, path if isinstance(filesystem, pafs.LocalFileSystem) else path.rstrip("/"))
    return Location(pafs.LocalFileSystem(), str(out))


def as_location(run: "str | os.PathLike | Location") -> Location:
    """A Location as is; a ``str`` through :func:`resolve` (a path or a URI); another path-like: a local
    folder. Raises CaptureError as :func:`resolve` does."""
    if isinstance(run, Location):
        return run
    if isinstance(run, str):
        return resolve(run)
    return Location(pafs.LocalFileSystem(), str(Path(run)))


class _PutOnClose(LocalFileOpener):
    """A written object appears under its name only when closed (staged in the temp folder meanwhile)."""

    def close(self):
        if not self.autocommit and not self.f.closed:
            self.commit()  # closes the staged file, then moves it under its name
        return self.f.close()


class NoRenameFS(FsspecLocalFS):
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
