"""Session snapshots: every session written to a state directory and read back.

A replica started with ``--state-dir`` writes its sessions there when it stops
(SIGTERM, after the drain) and, with ``--snapshot-interval``, every so often while it
serves; on start it restores what it finds and serves those sessions by the same ids,
owners, handles and tensor ids. A survivor adopts a removed replica's files the same
way (``restore_dir`` on another directory).

One file per session, ``session-<sha256 of the id>.gss``, written whole or not at
all: to ``.tmp-<name>``, fsynced, renamed over the old file, the directory fsynced. A
write that fails (a full disk) removes its temporary file and leaves the session's
previous file as it was.

File layout (integers little-endian)::

    magic    8 bytes  b"GRADSNAP"
    version  u32      FORMAT_VERSION
    flags    u32      0 (reserved)
    length   u64      bytes of the payload
    sha256   32 bytes of the payload
    payload  u64 meta length, meta (UTF-8 JSON), tensor data

The JSON names every tensor by ``{"dtype", "shape", "offset", "nbytes"}`` into the
tensor data: fixed-size dtypes as their C-order native bytes (``.npy``'s raw data),
strings as each element's 8-byte length and bytes (as on the wire). No pickle
anywhere. A file whose magic, version, length, checksum or contents do not check out
is reported (``SnapshotError``) and skipped, never half-loaded: a session is built
whole from its file before the store sees it.

Gradient tapes are not persisted: a session that had some is restored without them
(logged), since a tape's recorded ops refer to a live computation.

One server per directory (``lock_directory``): a snapshot removes the files of
sessions it does not hold, so two replicas given the same ``--state-dir`` would delete
each other's sessions; the second one is refused at start instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import hashlib
import json
import logging
import os
import pathlib
import shutil
import stat
import struct
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, BinaryIO

import numpy as np

from gradserve import dtypes
from gradserve.errors import GradserveError
from gradserve.server.core.sessions import SessionState, SessionStore
from gradserve.server.core.tensor_array import Slot, TensorArrayState

log = logging.getLogger(__name__)

MAGIC = b"GRADSNAP"
FORMAT_VERSION = 1
SUFFIX = ".gss"
TEMP_PREFIX = ".tmp-"
REJECTED_SUFFIX = ".rejected"
#: A restored session's file, set aside until the next snapshot (``set_aside``).
RESTORED_SUFFIX = ".restored"
_HEADER = struct.Struct("<8sIIQ32s")
_U64 = struct.Struct("<Q")
#: Data is written to the file in pieces of at most this many bytes.
_PIECE = 16 << 20


#: The file a server holds locked (``flock``) in its state directory while it runs.
LOCK_NAME = ".lock"


class DirectoryInUseError(Exception):
    """Another process holds the state directory (``lock_directory``)."""


def lock_directory(directory: str | os.PathLike[str]) -> int:
    """Take ``directory`` (made if missing) for this server: an exclusive ``flock`` on
    its ``LOCK_NAME`` file, held until the returned descriptor is closed (at the
    latest when the process ends, however it ends). ``DirectoryInUseError`` if another
    process, or another server of this one, holds it; the lock file says whose."""
    path = pathlib.Path(directory)
    path.mkdir(mode=PRIVATE_DIR_MODE, parents=True, exist_ok=True)
    # Never through a link: in a directory others may write to (one the operator
    # made keeps its mode), a link planted there had this root-run server truncate
    # and write whatever it named (a review helper); ELOOP fails the start instead.
    flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
    fd = os.open(path / LOCK_NAME, flags, PRIVATE_FILE_MODE)
    with contextlib.suppress(OSError):  # (one an earlier server left keeps its mode)
        os.fchmod(fd, PRIVATE_FILE_MODE)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise DirectoryInUseError(
            f"{path} is the state directory of a server that is running ({holder}): "
            "give each replica its own"
        ) from None
    except OSError as e:  # no locks on this filesystem (NFS without its lock service)
        log.warning("%s cannot be locked (%s): a second server on it would not be noticed", path, e)
        return fd
    except BaseException:
        os.close(fd)
        raise
    try:  # whose it is, for the message above; the lock holds without it (a full disk)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()}\n".encode(), 0)
    except OSError:
        pass
    return fd


#: A state directory the server makes, and its files: they hold session ids (which
#: attach to a session, alone where there is no token file) and every tensor's bytes,
#: readable by other local users at the umask's usual 0755/0644 (a review helper).
PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600


def _create_private(path: pathlib.Path) -> BinaryIO:
    """``path`` made anew for writing, readable by this user alone: whatever was there
    (a temporary file a crash left, or a link someone planted, which the write
    followed: a review helper) is removed first, and the file is created, never
    opened through a link."""
    path.unlink(missing_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
    fd = os.open(path, flags, PRIVATE_FILE_MODE)
    return open(fd, "wb")


class SnapshotError(Exception):
    """A snapshot file that cannot be written, or read back as a whole session."""


@dataclasses.dataclass
class SnapshotReport:
    """What one ``write_snapshot`` did."""

    written: int = 0
    failed: int = 0
    bytes: int = 0
    seconds: float = 0.0
    tapes_dropped: int = 0
    #: Sessions taken while an op still changed them (``SessionState.torn``).
    torn: int = 0
    errors: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class RestoreReport:
    """What one ``restore_dir`` did."""

    restored: int = 0
    rejected: int = 0
    errors: list[str] = dataclasses.field(default_factory=list)
    stopped: bool = False  # ``stop()`` ended it before the last file
    files: list[pathlib.Path] = dataclasses.field(default_factory=list)  # those restored


def file_name(session_id: str) -> str:
    """The file of one session (the id hashed: any id is a safe name)."""
    return f"session-{hashlib.sha256(session_id.encode()).hexdigest()[:40]}{SUFFIX}"


# ----------------------------------------------------------------------------- encode
class _Blobs:
    """Tensor data laid out one after another, described in the JSON. An array held
    under several ids (a resident tensor and its aliases, ``Session.put``) is written
    once, each id's entry naming the same bytes, which ``_decode`` reads back as one
    array: written twice, it came back as two, charged twice, and a session near its
    limit could not be restored."""

    def __init__(self, to_host: Callable[[Any], Any]) -> None:
        self.to_host = to_host
        self.pieces: list[bytes | memoryview] = []
        self.size = 0
        #: By the identity of each array added: the array (alive while this lives, so
        #: that no other array takes its id) and its entry.
        self._added: dict[int, tuple[Any, dict[str, Any]]] = {}

    def add(self, array: Any) -> dict[str, Any]:
        added = self._added.get(id(array))
        if added is not None:
            return added[1]
        ref = self._add(array)
        self._added[id(array)] = (array, ref)
        return ref

    def _add(self, array: Any) -> dict[str, Any]:
        host = np.asarray(self.to_host(array))
        dtype = dtypes.normalize(host.dtype)
        if dtype == dtypes.STRING:
            parts: list[bytes] = []
            for element in host.reshape(-1):
                raw = element.encode() if isinstance(element, str) else bytes(element)
                parts += [_U64.pack(len(raw)), raw]
            data: bytes | memoryview = b"".join(parts)
        else:
            # Bytes through a uint8 view: bfloat16 has no buffer-protocol format.
            flat = np.ascontiguousarray(host, dtype=dtype).reshape(-1)
            data = flat.view(np.uint8).data
        ref = {
            "dtype": dtypes.name(dtype),
            "shape": list(host.shape),
            "offset": self.size,
            "nbytes": len(data),
        }
        self.pieces.append(data)
        self.size += len(data)
        return ref


def _shape_json(shape: Any) -> Any:
    return None if shape is None else [None if d is None else int(d) for d in shape]


def _encode(state: SessionState, to_host: Callable[[Any], Any]) -> tuple[bytes, list[Any]]:
    """The JSON and the tensor pieces of one session."""
    blobs = _Blobs(to_host)
    arrays = []
    for handle, ta in state.arrays.items():
        slots = []
        for index, slot in sorted(ta.slots.items()):
            slots.append(
                {
                    "index": index,
                    "shape": list(slot.shape),
                    "written": slot.written,
                    "read": slot.read,
                    "cleared": slot.cleared,
                    "value": None if slot.value is None else blobs.add(slot.value),
                }
            )
        arrays.append(
            {
                "handle": handle,
                "name": ta.name,
                "dtype": dtypes.name(ta.dtype),
                "size": ta.size,
                "element_shape": _shape_json(ta.element_shape),
                "identical_element_shapes": ta.identical_element_shapes,
                "dynamic_size": ta.dynamic_size,
                "clear_after_read": ta.clear_after_read,
                "multiple_writes_aggregate": ta.multiple_writes_aggregate,
                "is_grad": ta.is_grad,
                "marked_size": ta.marked_size,
                "gradients_disallowed": ta.gradients_disallowed,
                "closed": ta.closed,
                "slots": slots,
            }
        )
    meta = {
        "id": state.id,
        "principal": state.principal,
        "name_counter": state.name_counter,
        "idle_seconds_left": state.idle_seconds_left,
        "written_at": time.time(),
        "arrays": arrays,
        "grads": [[h, src, g] for (h, src), g in state.grads.items()],
        "resident": [{"id": t, "value": blobs.add(a)} for t, a in state.resident.items()],
        "closed_order": state.closed_order,
        "lost_tapes": state.lost_tapes,
        "released_tapes": state.released_tapes,
        "handed_out": state.handed_out,
        "fetched": state.fetched,
    }
    return json.dumps(meta, separators=(",", ":")).encode(), blobs.pieces


def _write_all(fh: BinaryIO, data: bytes | memoryview, digest: Any) -> None:
    view = memoryview(data).cast("B")
    for start in range(0, len(view), _PIECE):
        piece = view[start : start + _PIECE]
        digest.update(piece)
        fh.write(piece)


def write_session(
    state: SessionState, directory: pathlib.Path, to_host: Callable[[Any], Any] = np.asarray
) -> int:
    """Write one session's file atomically; returns its size in bytes. On failure
    (``SnapshotError``) the temporary file is gone and the old file untouched."""
    final = directory / file_name(state.id)
    temp = directory / f"{TEMP_PREFIX}{final.name}"
    meta, pieces = _encode(state, to_host)
    try:
        with _create_private(temp) as fh:
            fh.write(b"\0" * _HEADER.size)  # filled in once the checksum is known
            digest = hashlib.sha256()
            _write_all(fh, _U64.pack(len(meta)), digest)
            _write_all(fh, meta, digest)
            for piece in pieces:
                _write_all(fh, piece, digest)
            length = fh.tell() - _HEADER.size
            fh.seek(0)
            fh.write(_HEADER.pack(MAGIC, FORMAT_VERSION, 0, length, digest.digest()))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(temp, final)
    except OSError as e:
        temp.unlink(missing_ok=True)
        raise SnapshotError(f"could not write {final.name}: {e}") from e
    return _HEADER.size + length


def write_snapshot(
    states: Iterable[SessionState],
    directory: str | os.PathLike[str],
    to_host: Callable[[Any], Any] = np.asarray,
) -> SnapshotReport:
    """Write every session to ``directory``; drop the files of sessions no longer open.

    A session that cannot be written is reported in the result (and logged); its
    previous file, if any, stays as it was, and the others are still written.
    """
    started = time.monotonic()
    path = pathlib.Path(directory)
    report = SnapshotReport()
    try:
        path.mkdir(mode=PRIVATE_DIR_MODE, parents=True, exist_ok=True)
    except OSError as e:  # no session can be written: each one counts as not saved
        for state in states:
            report.failed += 1
            report.errors.append(f"session {state.id[:12]}…: {directory}: {e}")
        log.error(
            "snapshot: %s cannot be made: %s; %d session(s) not saved", path, e, report.failed
        )
        report.seconds = time.monotonic() - started
        return report
    keep: set[str] = set()
    failed: set[str] = set()
    for state in states:
        keep.add(file_name(state.id))
        report.tapes_dropped += state.tapes_dropped
        report.torn += state.torn
        try:
            report.bytes += write_session(state, path, to_host)
            report.written += 1
        except Exception as e:  # noqa: BLE001 - this session is not saved; the others go on
            # (not only a write: encoding it may fail too, e.g. a GPU tensor's copy)
            failed.add(file_name(state.id))
            report.failed += 1
            report.errors.append(str(e))
            log.error("snapshot: session %s… not saved: %s", state.id[:12], e)
    try:
        for stale in path.glob(f"*{SUFFIX}"):
            if stale.name not in keep:
                stale.unlink(missing_ok=True)
        for aside in path.glob(f"*{SUFFIX}{RESTORED_SUFFIX}"):
            # A session restored at start whose write failed now: its file as restored
            # is its previous file, and stays (as a write that fails keeps the old one).
            name = aside.name.removesuffix(RESTORED_SUFFIX)
            if name in failed and not (path / name).exists():
                aside.replace(path / name)
            else:
                aside.unlink(missing_ok=True)
        _fsync_dir(path)
    except OSError as e:  # the files written may not last a crash: not saved, then
        report.failed += report.written
        report.written = 0
        report.errors.append(f"{directory}: {e}")
        log.error("snapshot: %s could not be cleaned up or synced: %s", path, e)
    report.seconds = time.monotonic() - started
    if report.tapes_dropped:
        log.warning("snapshot: %d gradient tape(s) not persisted", report.tapes_dropped)
    if report.torn:
        log.warning(
            "snapshot: %d session(s) taken while an op still changed them (it ran "
            "past the snapshot's wait): such an op may be half in the file",
            report.torn,
        )
    return report


def remove_session_file(directory: str | os.PathLike[str], session_id: str) -> None:
    """Remove the file of session ``session_id`` from ``directory``, if there is one;
    a failure is logged (the next snapshot removes the files of sessions not open)."""
    path = pathlib.Path(directory) / file_name(session_id)
    try:
        path.unlink(missing_ok=True)
    except OSError as e:
        log.warning("could not remove %s of an ended session: %s", path, e)


def _fsync_dir(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------- decode
def read_session(path: str | os.PathLike[str]) -> SessionState:
    """The session in one file, or ``SnapshotError`` saying what is wrong with it.

    The file is never held whole in memory: its header is checked against its size
    before anything is allocated, its checksum computed over pieces, and each tensor
    read straight into its own array. Read into one buffer of the file's size first,
    a sparse file of 3 GB (4 KiB on disk) took 3 GB at every start before the header
    refused it, and a restore took twice its session's size at its peak (the buffer
    and every tensor's copy: a review helper)."""
    path = pathlib.Path(path)
    try:
        # Non-blocking, then a regular file only: opening a FIFO named like a session
        # file blocked the restore (the server never listened) or an adoption (and
        # then the drain, SIGTERM could not end it; found by a review helper).
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise SnapshotError(f"{path.name}: cannot read: {e}") from e
    try:
        payload = _checked_payload(path.name, fd)
        try:
            state = _decode(payload)
            changed = _identity(os.fstat(fd)) != payload.identity
        except (
            ValueError, KeyError, TypeError, IndexError, OverflowError, struct.error,
            GradserveError,
        ) as e:  # fmt: skip
            raise SnapshotError(f"{path.name}: malformed contents: {type(e).__name__}: {e}") from e
        except OSError as e:
            raise SnapshotError(f"{path.name}: cannot read: {e}") from e
    finally:
        os.close(fd)
    if changed:  # the checksum was of other bytes than those read
        raise SnapshotError(f"{path.name}: changed while it was read")
    return state


def _identity(info: os.stat_result) -> tuple[int, int, int]:
    """What changes when a file's contents do (its size, its times)."""
    return info.st_size, info.st_mtime_ns, info.st_ctime_ns


@dataclasses.dataclass(frozen=True)
class _Payload:
    """A snapshot file's payload, read by ``pread`` where a tensor needs it."""

    name: str
    fd: int
    start: int  # where it starts in the file (after the header)
    length: int
    #: The file's ``_identity`` when its checksum was computed.
    identity: tuple[int, int, int]

    def read(self, offset: int, nbytes: int) -> bytearray:
        data = bytearray(nbytes)
        self.read_into(offset, memoryview(data))
        return data

    def read_into(self, offset: int, into: memoryview) -> None:
        """``into`` filled from ``offset``, in as many reads as it takes (Linux reads
        at most 2 GiB at a time: a string tensor past that was refused)."""
        done = 0
        while done < len(into):
            got = os.preadv(self.fd, [into[done : done + _PIECE]], self.start + offset + done)
            if not got:
                raise ValueError(f"the file ended early ({done} of {len(into)} bytes read)")
            done += got


def _checked_payload(name: str, fd: int) -> _Payload:
    """The payload of the open file ``fd``, once its header, size and checksum check out."""
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise SnapshotError(f"{name}: not a regular file")
        header = os.pread(fd, _HEADER.size, 0)
        if len(header) < _HEADER.size or header[:8] != MAGIC:
            raise SnapshotError(f"{name}: not a gradserve snapshot (bad magic)")
        _, version, _flags, length, checksum = _HEADER.unpack(header)
        if version != FORMAT_VERSION:
            raise SnapshotError(
                f"{name}: format version {version}, this server reads only {FORMAT_VERSION}"
            )
        size = info.st_size - _HEADER.size
        if size != length:
            raise SnapshotError(
                f"{name}: truncated or padded: {size} payload bytes, header says {length}"
            )
        digest = hashlib.sha256()
        offset = 0
        while offset < length:  # (a read may give fewer bytes than asked)
            piece = os.pread(fd, min(_PIECE, length - offset), _HEADER.size + offset)
            if not piece:
                raise SnapshotError(f"{name}: truncated while read")
            digest.update(piece)
            offset += len(piece)
    except OSError as e:
        raise SnapshotError(f"{name}: cannot read: {e}") from e
    if digest.digest() != checksum:
        raise SnapshotError(f"{name}: checksum mismatch (corrupt)")
    return _Payload(name, fd, _HEADER.size, length, _identity(info))


def _decode(payload: _Payload) -> SessionState:
    (meta_len,) = _U64.unpack(payload.read(0, _U64.size))
    if meta_len > payload.length - _U64.size:
        raise ValueError(f"metadata of {meta_len} bytes past the payload's end")
    meta = json.loads(payload.read(_U64.size, meta_len))
    data_start = _U64.size + meta_len
    data_len = payload.length - data_start
    #: Arrays read so far, by where and what they are: entries naming the same bytes
    #: (``_Blobs``) are one array again (not empty ones: one after another, distinct
    #: tensors of no bytes start at the same offset).
    read: dict[tuple[Any, ...], np.ndarray] = {}

    def tensor(ref: dict[str, Any]) -> np.ndarray:
        if not int(ref["nbytes"]):  # where tensors of no bytes lie says nothing
            return _tensor(ref)
        key = (ref["dtype"], tuple(ref["shape"]), int(ref["offset"]), int(ref["nbytes"]))
        if key not in read:
            read[key] = _tensor(ref)
        return read[key]

    def _tensor(ref: dict[str, Any]) -> np.ndarray:
        dtype = dtypes.normalize(ref["dtype"])
        shape = tuple(int(d) for d in ref["shape"])
        start, nbytes = int(ref["offset"]), int(ref["nbytes"])
        if start < 0 or nbytes < 0 or start + nbytes > data_len:
            raise ValueError(f"tensor data out of bounds ({start}+{nbytes} of {data_len})")
        count = int(np.prod(shape, dtype=np.int64))
        if dtype == dtypes.STRING:
            if count < 0 or count * 8 > nbytes:  # each element has an 8-byte length
                raise ValueError(f"{count} strings cannot fit in {nbytes} bytes")
            raw = payload.read(data_start + start, nbytes)
            out = np.empty(count, dtypes.STRING)
            pos = 0
            for i in range(count):
                (n,) = _U64.unpack_from(raw, pos)
                if pos + 8 + n > len(raw):
                    raise ValueError("string element past its tensor's data")
                out[i] = bytes(raw[pos + 8 : pos + 8 + n])
                pos += 8 + n
            if pos != len(raw):
                raise ValueError("string tensor data longer than its elements")
            return out.reshape(shape)
        if count < 0 or count * dtype.itemsize != nbytes:
            raise ValueError(f"tensor of shape {shape} and dtype {dtype} is not {nbytes} bytes")
        # Read into an array of its own (a view of a buffer of the file would keep it
        # all alive, memory no budget sees, for as long as any one tensor lives).
        out = np.empty(count, dtype)
        payload.read_into(data_start + start, out.view(np.uint8).data)
        return out.reshape(shape)

    def shape(value: Any) -> Any:
        return None if value is None else tuple(None if d is None else int(d) for d in value)

    arrays = {}
    for a in meta["arrays"]:
        slots = {
            int(s["index"]): Slot(
                value=None if s["value"] is None else tensor(s["value"]),
                shape=tuple(int(d) for d in s["shape"]),
                written=bool(s["written"]),
                read=bool(s["read"]),
                cleared=bool(s["cleared"]),
            )
            for s in a["slots"]
        }
        arrays[str(a["handle"])] = TensorArrayState(
            name=str(a["name"]),
            dtype=dtypes.normalize(a["dtype"]),
            size=int(a["size"]),
            element_shape=shape(a["element_shape"]),
            identical_element_shapes=bool(a["identical_element_shapes"]),
            dynamic_size=bool(a["dynamic_size"]),
            clear_after_read=bool(a["clear_after_read"]),
            multiple_writes_aggregate=bool(a["multiple_writes_aggregate"]),
            is_grad=bool(a["is_grad"]),
            marked_size=int(a["marked_size"]),
            gradients_disallowed=bool(a["gradients_disallowed"]),
            closed=bool(a["closed"]),
            slots=slots,
        )
    closed = meta.get("closed_order")  # (absent from snapshots written before it was kept)
    return SessionState(
        id=str(meta["id"]),
        principal=str(meta["principal"]),
        name_counter=int(meta["name_counter"]),
        idle_seconds_left=float(meta["idle_seconds_left"]),
        arrays=arrays,
        grads={(str(h), str(src)): str(g) for h, src, g in meta["grads"]},
        resident={str(r["id"]): tensor(r["value"]) for r in meta["resident"]},
        closed_order=None if closed is None else [str(h) for h in closed],
        # (both absent from snapshots written before they were kept)
        lost_tapes=[str(t) for t in meta.get("lost_tapes") or ()],
        released_tapes=[str(t) for t in meta.get("released_tapes") or ()],
        handed_out=[str(t) for t in meta.get("handed_out") or ()],  # (absent before kept)
        fetched=[str(t) for t in meta.get("fetched") or ()],
    )


def snapshot_files(directory: str | os.PathLike[str]) -> Iterator[pathlib.Path]:
    """The session files in ``directory`` (temporary files of a write cut short are
    removed: their session's previous file, if any, is the one that counts)."""
    path = pathlib.Path(directory)
    if not path.is_dir():
        return
    for temp in path.glob(f"{TEMP_PREFIX}*"):
        temp.unlink(missing_ok=True)
    yield from sorted(path.glob(f"*{SUFFIX}"))


def _unused(path: pathlib.Path) -> pathlib.Path:
    """``path``, or ``path.1``, ``path.2``, …: the first that does not exist (a file
    set aside earlier is kept, for a person to look at)."""
    candidate, n = path, 0
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.name}.{n}")
    return candidate


def restore_dir(
    store: SessionStore,
    directory: str | os.PathLike[str],
    *,
    remove: bool = True,
    stop: Callable[[], bool] = lambda: False,
) -> RestoreReport:
    """Restore every session file in ``directory`` into ``store``; once ``stop()``
    says so, no more (the files not read yet stay where they are). The files
    restored are ``report.files``.

    With ``remove``, a restored session's file is removed: from then on the running
    server holds it, and its next snapshot writes it again, so that a crash never
    brings back an older state than that of the session it lost. Without (periodic
    snapshots on), it stays until the next snapshot rewrites it: a crash before then
    restores the same state again. A file that does not check out, or whose session
    cannot be restored (its id already open, a byte limit), is renamed to
    ``*.rejected`` (kept for a person to look at), logged and skipped.
    """
    report = RestoreReport()
    restored = report.files
    for path in snapshot_files(directory):
        if stop():
            report.stopped = True
            break
        try:
            state = read_session(path)
            store.restore(state)
        except Exception as e:  # noqa: BLE001 - reported, the file set aside, the rest go on
            report.rejected += 1
            report.errors.append(f"{path.name}: {e}")
            log.error("restore: skipped %s: %s", path.name, e)
            path.replace(_unused(path.with_name(path.name + REJECTED_SUFFIX)))
            continue
        restored.append(path)
        report.restored += 1
    if remove:  # only once every file is in: a crash mid-restore loses nothing
        for path in restored:
            path.unlink(missing_ok=True)
    return report


def set_aside(paths: Iterable[pathlib.Path]) -> None:
    """Rename restored files ``*.restored`` (the state dir without periodic snapshots,
    once the server serves their sessions): not restored again, so a crash before the
    next snapshot loses those sessions rather than bring back an older state; but the
    next snapshot puts one back should its session's write fail (``write_snapshot``),
    as a failed write keeps the previous file."""
    for path in paths:
        path.replace(path.with_name(path.name + RESTORED_SUFFIX))


#: An adopted file that could not be moved into the state dir (``take_over``): its
#: session is served, so it must not be restored again, and it is kept for a person.
ADOPTED_SUFFIX = ".adopted"


def take_over(
    paths: Iterable[pathlib.Path],
    directory: str | os.PathLike[str],
    *,
    aside: bool,
    stop: Callable[[], bool] = lambda: False,
) -> list[str]:
    """Move adopted session files into this server's state ``directory``, as its own
    restored files: ``*.restored`` with ``aside`` (no periodic snapshots: ``set_aside``),
    else as they are (the snapshot that follows rewrites them). Until its snapshot
    writes it, an adopted session's file is then where the server's own would be: a
    final snapshot that cannot write it puts it back in the state dir. Removed from
    the adopt dir at the restore, the session was in no file until that snapshot, and
    in none at all if the snapshot could not write it.

    A file on another filesystem (``--adopt-dir`` elsewhere) is copied to a temporary
    file here, synced and renamed, then removed there; once ``stop()`` says so (a
    drain: the final snapshot comes next and writes every session) it is removed
    without a copy, which could make the drain wait long. A file that cannot be moved is renamed ``*.adopted`` where it is
    (removed if even that fails), never left to be adopted a second time; the errors
    are returned, one line each. The caller holds off snapshots meanwhile: a file a
    snapshot wrote since the restore is newer than the adopted one, which is then
    only removed."""
    target = pathlib.Path(directory)
    sources, errors = set(), []
    for path in paths:
        sources.add(path.parent)
        try:
            _move_in(path, target, aside, stop)
        except OSError as e:
            errors.append(f"{path.name}: {e}")
            try:
                path.replace(_unused(path.with_name(path.name + ADOPTED_SUFFIX)))
            except OSError:
                path.unlink(missing_ok=True)
    for synced in (target, *sources):
        try:
            _fsync_dir(synced)
        except OSError as e:
            errors.append(f"{synced}: {e}")
    return errors


def _move_in(
    path: pathlib.Path, target: pathlib.Path, aside: bool, stop: Callable[[], bool]
) -> None:
    """One file of ``take_over``."""
    if (target / path.name).exists():  # a snapshot since the restore: newer
        path.unlink()
        return
    final = target / (path.name + (RESTORED_SUFFIX if aside else ""))
    try:
        path.replace(final)
        return
    except OSError as e:
        if e.errno != errno.EXDEV:
            raise
    if stop():  # draining: the last snapshot, next, writes it
        path.unlink()
        return
    temp = target / f"{TEMP_PREFIX}adopted-{path.name}"
    try:
        with _create_private(temp) as out, open(path, "rb") as source:
            shutil.copyfileobj(source, out, _PIECE)
            out.flush()
            os.fsync(out.fileno())
        temp.replace(final)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    _fsync_dir(target)
    path.unlink()


def clear_set_aside(directory: str | os.PathLike[str]) -> None:
    """Remove what ``set_aside`` left (at start: a crash came before the snapshot)."""
    for stale in pathlib.Path(directory).glob(f"*{SUFFIX}{RESTORED_SUFFIX}"):
        stale.unlink(missing_ok=True)
