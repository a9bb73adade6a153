"""The vector cache's second tier: users evicted from RAM, kept in files on local disk under a byte budget.

A user the vector cache evicts for room (or releases idle) is written here as it was (``UserVectors.spill_parts``:
arrays and Arrow data, no Python objects), and their next read maps the file back instead of querying LanceDB
and building the entry again. Mapped, not read (files of ``MAP_MIN_BYTES`` and more; a small user's is read):
the entry's arrays and columns are the file's pages where the OS page cache holds them (a private mapping: a
write to the entry copies the page it changes), so reading a 1,000-memory user back costs ~0.7 ms of CPU (the
ids' index, mostly), small enough to do on the event loop, against ~11 ms to load them from LanceDB (a count and
a scan, sorting and transposing the vectors) and ~2 ms to read the same file into new memory under load (page
faults on fresh pages a third of it). The read still makes the records its arms return again (they are not
written: making them from the columns is the cheapest form there is), so a miss stays dearer than a hit. A file
is never changed where it lies: a write goes aside and is renamed over, so the mappings of the old one stay
whole.

A file is exactly the evicted entry, and stays exact the way the RAM tier does: every write the store applies
to the cache reaches this tier too (``VectorCache``): a record written (the turns each exchange adds) or an access
time is kept as a patch to replay onto the file's entry when it is read, a record deleted drops the user's file
(read from LanceDB next time). So a file plus its patches is the user's entry as it is now, whether the entry is
in RAM or not: a file read back stays, and when its user is evicted again it is kept as it is (no write) unless
many patches piled up on it. Patches are held in RAM, bounded per user (``MAX_PATCHES``) and in all
(``MAX_PATCH_BYTES``): past either, the user's file is dropped. Files
live only as long as their process: each cache keeps its own directory, removed when it closes, and those of
processes that died are removed when another writes its first. The files hold what LanceDB's own files hold
(the same rows), in the same data directory; forgetting a user (``drop``) deletes theirs.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import shutil
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import orjson
import pyarrow as pa
import structlog

from proxy.memory.store.records import MemoryRecord
from proxy.memory.store.user_vectors import SpillParts, UserVectors

log = structlog.get_logger("memproxy.store")

SPILL_DIR = "vector-spill"  # under the data directory; one directory per process inside it
MAX_PATCHES = 64  # patches kept for one user's file (in RAM); past it the file is dropped (read from LanceDB)
MAX_PATCH_BYTES = 32 * 2**20  # patches kept for all files together (in RAM); past it, the patched user's is dropped
REWRITE_AFTER = 16  # a user evicted with more patches on their file than this is written again
MAX_WRITE_BYTES = 32 * 2**20  # entries bigger than this (~13k memories) are not written: ~20 ms on the event loop
_RECORD_BYTES = 1_000
_TOUCH_BYTES = 400  # the closure and the changes' dict
_TOUCH_ID_BYTES = 80  # an id (its string, in the list)
_MAGIC = b"MPVSPILL2\n"
_HEADER = 4  # bytes of the header's length, after the magic
_ALIGN = 64  # each array and stream starts at a multiple of this many bytes (a cache line)
MAP_MIN_BYTES = 256 * 2**10  # files this large are mapped (~120 memories), smaller ones read into memory
_ARRAYS = (
    "vectors",
    "created",
    "kind",
    "valid",
    "alive",
    "accessed",
    "base",
    "piece_values",
    "piece_offsets",
    "piece_held",
)


@dataclass
class Spilled:
    """One user's file, and the patches that came after it was written, to replay onto what it holds (appended
    on the event loop; a read in a thread replays those there were when it started)."""

    path: Path
    nbytes: int
    patches: list[Callable[[UserVectors], object]] = field(default_factory=list)
    patch_bytes: int = 0  # what the patches hold in RAM (an estimate)

    def read(self, user_id: str, patches: int) -> UserVectors:
        """The entry the file holds, its first ``patches`` patches replayed."""
        entry = UserVectors.from_spill(user_id, read_parts(self.path))
        for patch in self.patches[:patches]:
            patch(entry)
        return entry


class VectorSpill:
    """Users' files in one directory of this process, least recently evicted or read dropped first."""

    def __init__(self, root: Path, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._root = root
        self.directory = root / str(os.getpid())
        self._files: OrderedDict[str, Spilled] = OrderedDict()  # oldest first
        self._total = 0
        self.patch_bytes = 0  # RAM the files' patches hold, together
        self._written = 0  # files written: the next one's name
        self._made = False  # the directory (made at the first write)

    @property
    def nbytes(self) -> int:
        """Bytes of the files kept."""
        return self._total

    def __len__(self) -> int:
        return len(self._files)

    def __contains__(self, user_id: object) -> bool:
        return user_id in self._files

    def put(self, user_id: str, entry: UserVectors, *, write: bool = True) -> bool:
        """Keep the evicted entry: its file as it is if it has one with few patches, else written again (not if
        ``write`` is False, or the entry is over ``MAX_WRITE_BYTES``: the write runs on the event loop); False if
        it was not kept (the user's next read loads them from LanceDB)."""
        kept = self._files.get(user_id)
        if kept is not None and len(kept.patches) <= REWRITE_AFTER:
            self._files.move_to_end(user_id)
            return True
        self.discard(user_id)
        if not write or entry.nbytes > MAX_WRITE_BYTES:
            return False
        path = self.directory / f"{self._written + 1}.spill"
        try:
            parts = entry.spill_parts()
            size = parts_nbytes(parts)
            if size > self.max_bytes:
                return False
            if not self._made:
                _remove_dead(self._root)
                shutil.rmtree(self.directory, ignore_errors=True)  # a process of the same pid before this one
                self.directory.mkdir(parents=True, mode=0o700)
                self._made = True
            self._written += 1
            write_parts(path, parts)
        except Exception as exc:  # a full or read-only disk, or anything else: LanceDB reads later, not a failed read
            _remove(path)
            log.warning("store.vector_spill_failed", error=type(exc).__name__)
            return False
        self._files[user_id] = Spilled(path, size)
        self._total += size
        while self._total > self.max_bytes:
            self.discard(next(iter(self._files)))
        return True

    def get(self, user_id: str) -> Spilled | None:
        """The user's file (kept: it stays theirs while only patches change them), marked recently used."""
        spilled = self._files.get(user_id)
        if spilled is not None:
            self._files.move_to_end(user_id)
        return spilled

    def patch(self, user_id: str, write: Callable[[UserVectors], object], nbytes: int) -> None:
        """A patch of a user with a file (``nbytes``: what it holds in RAM), replayed whenever it is read (too
        many for the user, or too many bytes in all: the user's file is dropped)."""
        spilled = self._files.get(user_id)
        if spilled is None:
            return
        if len(spilled.patches) >= MAX_PATCHES or self.patch_bytes + nbytes > MAX_PATCH_BYTES:
            self.discard(user_id)
        else:
            spilled.patches.append(write)
            spilled.patch_bytes += nbytes
            self.patch_bytes += nbytes

    def discard(self, user_id: str) -> None:
        """Drop the user's file (their records changed, or they were forgotten, or it could not be read)."""
        spilled = self._files.pop(user_id, None)
        if spilled is not None:
            self._total -= spilled.nbytes
            self.patch_bytes -= spilled.patch_bytes
            _remove(spilled.path)

    def clear(self) -> None:
        """Drop every file."""
        for user_id in list(self._files):
            self.discard(user_id)

    def close(self) -> None:
        """Drop every file and the directory."""
        self._files.clear()
        self._total = self.patch_bytes = 0
        shutil.rmtree(self.directory, ignore_errors=True)


def upsert_bytes(record: MemoryRecord, vector: npt.NDArray[np.float32], pieces: npt.NDArray[np.int64] | None) -> int:
    """What a patch writing ``record`` holds in RAM: the record (its text and ~1 kB of the rest), its vector
    and word pieces."""
    return _RECORD_BYTES + len(record.text) + vector.nbytes + (pieces.nbytes if pieces is not None else 0)


def touch_bytes(ids: Sequence[str]) -> int:
    """What a patch of access times on ``ids`` holds in RAM."""
    return _TOUCH_BYTES + _TOUCH_ID_BYTES * len(ids)


def parts_nbytes(parts: SpillParts) -> int:
    """About the bytes a file of ``parts`` takes (its arrays and Arrow data)."""
    arrays = sum(array.nbytes for array in parts.arrays.values())
    columns = parts.columns.get_total_buffer_size() if parts.columns is not None else 0
    return arrays + int(parts.ids.get_total_buffer_size()) + int(columns)


def write_parts(path: Path, parts: SpillParts) -> None:
    """Write ``parts``: a magic line, a JSON header (counts; each array's dtype, shape and offset; the Arrow
    streams' offsets and lengths), then the arrays' bytes and the ids and the columns as Arrow IPC streams, each
    at an offset that is a multiple of ``_ALIGN`` (``read_parts`` maps the file and uses them where they lie)."""
    ids = _ipc(pa.table({"id": parts.ids}))
    columns = _ipc(parts.columns) if parts.columns is not None else None
    arrays = [np.ascontiguousarray(parts.arrays[name]) for name in _ARRAYS]
    blobs: list[memoryview | pa.Buffer] = [_raw(array) for array in arrays] + [ids]
    if columns is not None:
        blobs.append(columns)
    room = 1024  # bytes left for the header (its offsets depend on its length: once more if it needs more)
    while True:
        offsets, at = [], _aligned(len(_MAGIC) + _HEADER + room)
        for blob in blobs:
            offsets.append(at)
            at = _aligned(at + _size(blob))
        header = orjson.dumps(
            {
                "n": parts.n,
                "dead": parts.dead,
                "sorted": parts.sorted,
                "generation": parts.generation,
                "arrays": [[a.dtype.str, list(a.shape), o] for a, o in zip(arrays, offsets, strict=False)],
                "ids": [offsets[len(arrays)], ids.size],
                "columns": [offsets[-1], columns.size] if columns is not None else None,
                "size": offsets[-1] + _size(blobs[-1]),
            }
        )
        if len(header) <= room:
            break
        room = len(header)
    # Written aside, then renamed over ``path``: a file is never changed where it lies, because a mapping of it
    # (an entry read back) would fault (SIGBUS) on pages a truncation took away. Renamed over, the old file
    # lives on for its mappings.
    part = path.with_name(path.name + ".part")
    try:
        with part.open("wb") as out:
            out.write(_MAGIC + len(header).to_bytes(_HEADER, "little") + header)
            for offset, blob in zip(offsets, blobs, strict=True):
                out.write(b"\0" * (offset - out.tell()))
                out.write(blob)
        part.replace(path)
    except BaseException:
        _remove(part)
        raise


def read_parts(path: Path) -> SpillParts:
    """What ``write_parts`` wrote (ValueError if the file is not whole). A file of ``MAP_MIN_BYTES`` or more is
    mapped rather than read: the arrays and the Arrow data are the file's pages as the OS page cache holds them
    (private: a write to an array copies its page, the file stays as written), not a copy in newly allocated
    memory (reading a 1,000-memory user's 2 MB into new arrays cost ~2 ms of a read under load, a third of it
    page faults). A smaller one is read into one buffer the arrays and the Arrow data are views of."""
    with path.open("rb") as source:
        size = os.fstat(source.fileno()).st_size
        if size < len(_MAGIC) + _HEADER:
            raise ValueError(f"{path} is cut short")
        mapped: mmap.mmap | bytearray
        if size >= MAP_MIN_BYTES:
            mapped = mmap.mmap(source.fileno(), size, access=mmap.ACCESS_COPY)
        else:  # a small user's file is read: a mapping each would be thousands of them in a full cache
            mapped = bytearray(size)
            if source.readinto(mapped) != size:
                raise ValueError(f"{path} is cut short")
    if mapped[: len(_MAGIC)] != _MAGIC:
        raise ValueError(f"{path} is not a vector spill file")
    start = len(_MAGIC) + _HEADER
    length = int.from_bytes(mapped[len(_MAGIC) : start], "little")
    if start + length > size:
        raise ValueError(f"{path} is cut short")
    header: dict[str, Any] = orjson.loads(mapped[start : start + length])
    if header["size"] > size:
        raise ValueError(f"{path} is cut short")
    arrays = {}
    for name, (dtype, shape, offset) in zip(_ARRAYS, header["arrays"], strict=True):
        kind = np.dtype(dtype)
        count = math.prod(shape)
        if count == 0:
            arrays[name] = np.empty(shape, dtype=kind)
        else:
            arrays[name] = np.frombuffer(mapped, dtype=kind, count=count, offset=offset).reshape(shape)
    data = pa.py_buffer(mapped)
    ids = _read_ipc(data, *header["ids"])
    columns = _read_ipc(data, *header["columns"]) if header["columns"] else None
    return SpillParts(
        header["n"], header["dead"], header["sorted"], header["generation"], arrays, ids["id"].combine_chunks(), columns
    )


def _aligned(at: int) -> int:
    return -(-at // _ALIGN) * _ALIGN


def _size(blob: memoryview | pa.Buffer) -> int:
    return blob.nbytes if isinstance(blob, memoryview) else blob.size


def _raw(array: npt.NDArray[Any]) -> memoryview:
    """A contiguous array's bytes, as a view (empty ones included)."""
    return array.reshape(-1).view(np.uint8).data


def _ipc(table: pa.Table) -> pa.Buffer:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue()


def _read_ipc(data: pa.Buffer, offset: int, length: int) -> pa.Table:
    return pa.ipc.open_stream(data.slice(offset, length)).read_all()


def _remove(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink(missing_ok=True)


def _remove_dead(root: Path) -> None:
    """Remove the directories of processes that no longer run (a kill -9 left them)."""
    if not root.is_dir():
        return
    for child in root.iterdir():
        if child.name.isdigit() and not _running(int(child.name)):
            shutil.rmtree(child, ignore_errors=True)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
