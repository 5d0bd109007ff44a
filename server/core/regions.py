"""Same-host shared memory: the regions a session registered, and copies in and out.

A worker on the server's host registers POSIX shared-memory objects
(``/dev/shm/<key>``) with its session under names of its choosing, then passes
tensors as (region, offset, dtype, shape) instead of by value, and can have outputs
written into a region (as Triton's system shared memory). The table here is one
session's: a name from another session is simply not found.

Invariants
----------
- **Never mapped.** The server holds each region's file descriptor and copies with
  ``os.preadv`` / ``os.pwritev``. A mapping of a file that its owner truncates
  raises SIGBUS on the next touch of a lost page, which kills the process (Python
  cannot recover from it), and a worker may truncate its region at any time. Through
  the descriptor, a region that shrank is a short read (``RegionTruncatedError``)
  and one that vanished (unlinked) is seen by ``fstat``: clean errors, and the server
  serves on. The one cost is a copy per input, which TensorFlow's semantics need
  anyway wherever the value outlives the call (a TensorArray write, a resident
  tensor): the worker may overwrite its region once the call returns.
- **Opened once, by descriptor.** The name is resolved only at registration
  (``O_NOFOLLOW``, relative to ``/dev/shm``, a regular file only), so later renames or
  symlinks cannot redirect a session to another file.
- **Proof of the owner.** Registration compares the first bytes of the object with
  the nonce the worker wrote there: a server on another host (or with another
  ``/dev/shm``) reads other bytes and refuses, and a session cannot register an
  object whose contents it does not know. An object (by device and inode) is
  registered by at most one session at a time, so once its owner holds it no other
  session can read it through the server.
- **Bounded.** Names and keys are ``[A-Za-z0-9_.-]``, at most 128 characters, never
  ``.`` or ``..``, and keys start with ``gradserve_`` (a server running as root opens no
  other program's shared memory); at most ``max_regions`` regions per session, each at most
  ``max_region_bytes``; every tensor copied in or out is within its region.
- **Released.** Unregistering, or closing the session (its ``close`` closes this
  table), closes the descriptor once no copy is using it (``use``).

Thread-safe: one lock guards the name table and each region's use count; copies run
outside it.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import re
import stat
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from gradserve import dtypes, shapes
from gradserve.errors import (
    AlreadyExistsError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
)
from gradserve.warm_buffers import WarmBuffers

#: Where POSIX shared-memory objects live (``shm_open`` names) on Linux.
SHM_DIR = "/dev/shm"
#: Region names and keys: a portable file name, no path.
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,128}")
#: Every key starts with this: the server, which may run as root, opens only objects
#: made for it, never another program's shared memory that happens to be in /dev/shm.
KEY_PREFIX = "gradserve_"
MIN_NONCE_BYTES, MAX_NONCE_BYTES = 16, 64
#: A region's first bytes hold its nonce, never a tensor: a tensor read or written
#: there would give the nonce away or overwrite it (``protocol.SHM_RESERVED_BYTES``,
#: the same number for the SDK; a test checks they agree).
RESERVED_BYTES = MAX_NONCE_BYTES
#: Regions one session may hold (each holds a file descriptor of the server).
MAX_REGIONS_PER_SESSION = 64


def _descriptor_limit() -> int:
    """Region descriptors the whole server may hold: half its open-file limit, the rest
    left to connections and files. Sessions times regions per session (65,536 by
    default) could take every descriptor: one client that registered one object
    under many names in many sessions made the server unable to accept a connection
    (found by a review helper at ``ulimit -n 1024``)."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):
        return 512
    if soft == resource.RLIM_INFINITY:
        return 1 << 16
    return max(16, soft // 2)


#: The most region descriptors the server holds at once (``_descriptor_limit``).
MAX_OPEN_REGIONS = _descriptor_limit()
#: Region descriptors open now, all sessions together (under ``_claims_lock``).
_open_regions = 0

#: (st_dev, st_ino) of every registered object -> the id of the session holding it
#: and under how many names.
_claims: dict[tuple[int, int], tuple[str, int]] = {}
_claims_lock = threading.Lock()


class RegionTruncatedError(FailedPreconditionError):
    """The region is smaller than the tensor it should hold: its owner shrank it."""


def _copy_failed(error: OSError, region: str, field: str, action: str) -> Exception:
    """A copy into or out of ``region`` that the OS refused, as a typed error, so that
    an output region that fails this way is dropped for the call as one that shrank
    (``shm_wire.OutputArena``: the outputs go inline), not an INTERNAL error after an
    op that cannot be undone (a clearing read, Gradients on a non-persistent tape)
    changed state. A full ``/dev/shm`` (Docker's default is 64 MB) fails a write into
    pages the object never had (a sparse region, or one shrunk under the write)."""
    what = f"{field}: {action} shared memory region {region!r} failed: {error.strerror}"
    if error.errno in (errno.ENOSPC, errno.ENOMEM, errno.EDQUOT):
        return ResourceExhaustedError(
            f"{what} (/dev/shm is full: give it more room, e.g. docker --shm-size)",
            reason="REGION_NO_SPACE",
            field=field,
        )
    return FailedPreconditionError(what, reason="REGION_IO_ERROR", field=field)


def check_name(value: str, what: str) -> str:
    """``value`` if it is a valid region name or key, else INVALID_ARGUMENT."""
    if not _NAME.fullmatch(value) or value in (".", ".."):
        raise InvalidArgumentError(
            f"shared memory {what} {value[:140]!r} is not 1 to 128 of [A-Za-z0-9_.-] "
            "(no '/', not '.' or '..')",
            field=what,
        )
    return value


class Region:
    """One registered object: its descriptor, size and how many copies use it now."""

    def __init__(self, name: str, key: str, byte_size: int, fd: int, inode: tuple[int, int]):
        self.name = name
        self.key = key
        self.byte_size = byte_size
        self.fd = fd
        self.inode = inode
        #: Copies running on it now; the descriptor is closed when this is 0 and it
        #: is ``dropped``.
        self.users = 0
        #: Unregistered (or its session closed): close the descriptor after the last use.
        self.dropped = False

    def __repr__(self) -> str:
        return f"Region({self.name!r}, key={self.key!r}, {self.byte_size} bytes)"

    def _check_linked(self) -> None:
        """NOT_FOUND once the object was unlinked (its owner removed it)."""
        if os.fstat(self.fd).st_nlink == 0:
            raise NotFoundError(
                f"shared memory region {self.name!r} (/dev/shm/{self.key}) was unlinked; "
                "register a new one",
                reason="REGION_UNLINKED",
                field="region",
            )

    def check_bounds(self, offset: int, nbytes: int, field: str) -> None:
        if offset < 0 or offset + nbytes > self.byte_size:
            raise InvalidArgumentError(
                f"{field}: bytes [{offset}, {offset + nbytes}) are outside shared memory "
                f"region {self.name!r} of {self.byte_size} bytes",
                field=field,
            )
        if offset < RESERVED_BYTES and nbytes:
            raise InvalidArgumentError(
                f"{field}: bytes [{offset}, {offset + nbytes}) of shared memory region "
                f"{self.name!r}: its first {RESERVED_BYTES} bytes hold its nonce, never "
                "a tensor",
                field=field,
            )

    def read_into(self, offset: int, out: memoryview, field: str) -> None:
        """Fill ``out`` with the region's bytes from ``offset``; a short read (the
        object shrank) is ``RegionTruncatedError``. A large read is split in parts
        read at once (``_parallel_parts``)."""
        self.check_bounds(offset, len(out), field)
        self._check_linked()
        parts = _parallel_parts(len(out))
        if parts == 1:
            self._read_part(offset, out, field)
            return
        step = -(-len(out) // parts // PAGE) * PAGE
        pool = _readers()
        futures = [
            pool.submit(self._read_part, offset + start, out[start : start + step], field)
            for start in range(step, len(out), step)
        ]
        try:
            self._read_part(offset, out[:step], field)
        finally:
            errors = [f.exception() for f in futures]  # waits for every part
        for error in errors:
            if error is not None:
                raise error

    def _read_part(self, offset: int, out: memoryview, field: str) -> None:
        done, total = 0, len(out)
        while done < total:
            try:
                got = os.preadv(self.fd, [out[done:]], offset + done)
            except OSError as e:
                raise _copy_failed(e, self.name, field, "reading") from None
            if got == 0:
                raise RegionTruncatedError(
                    f"{field}: shared memory region {self.name!r} ended after "
                    f"{offset + done} bytes while reading [{offset}, {offset + total}): "
                    "it was truncated",
                    reason="REGION_TRUNCATED",
                    field=field,
                )
            done += got

    def write_from(self, offset: int, data: memoryview, field: str) -> None:
        """Write ``data`` at ``offset``. A region that is now smaller than that is
        ``RegionTruncatedError`` (checked first, so that the server does not grow its
        owner's object; one shrunk during the write grows back, harmlessly)."""
        self.check_bounds(offset, len(data), field)
        self._check_linked()
        size = os.fstat(self.fd).st_size
        if size < offset + len(data):
            raise RegionTruncatedError(
                f"{field}: shared memory region {self.name!r} is {size} bytes now, "
                f"too small for [{offset}, {offset + len(data)}): it was truncated",
                reason="REGION_TRUNCATED",
                field=field,
            )
        done = 0
        while done < len(data):
            try:
                done += os.pwritev(self.fd, [data[done:]], offset + done)
            except OSError as e:
                raise _copy_failed(e, self.name, field, "writing") from None


class RegionTable:
    """The shared-memory regions of one session, by name.

    ``owner`` is the session's id (one object is registered by one session at a
    time); ``max_region_bytes`` bounds each region (None: unbounded) and
    ``max_tensor_bytes`` each tensor copied in or out.
    """

    def __init__(
        self,
        owner: str,
        *,
        max_region_bytes: int | None = None,
        max_tensor_bytes: int | None = None,
        max_regions: int = MAX_REGIONS_PER_SESSION,
        shm_dir: str | None = None,
        buffers: WarmBuffers | None = None,
    ) -> None:
        self.owner = owner
        #: Where tensors read out of regions get their memory (none given: a cache
        #: that keeps nothing, i.e. ``np.empty``).
        self.buffers = buffers if buffers is not None else WarmBuffers(0)
        self.max_region_bytes = max_region_bytes
        self.max_tensor_bytes = max_tensor_bytes
        self.max_regions = max_regions
        self.shm_dir = shm_dir if shm_dir is not None else SHM_DIR
        self._lock = threading.Lock()
        self._regions: dict[str, Region] = {}
        self._closed = False

    def __len__(self) -> int:
        with self._lock:
            return len(self._regions)

    # ---------------------------------------------------------------- registration
    def register(self, name: str, key: str, byte_size: int, nonce: bytes) -> None:
        """Open ``/dev/shm/<key>`` and register its first ``byte_size`` bytes as ``name``.

        Preconditions: valid name and key, a nonce of 16 to 64 bytes equal to the
        object's first bytes, the object a regular file of at least ``byte_size``
        bytes not registered by another session, ``name`` new in this session, and
        room in the session's limits. Side effect: the server holds a descriptor of
        the object until ``unregister`` or ``close``.
        """
        check_name(name, "name")
        check_name(key, "key")
        if not key.startswith(KEY_PREFIX):
            raise InvalidArgumentError(
                f"key {key[:140]!r} does not start with {KEY_PREFIX!r}: the server opens "
                "only shared memory objects made for it",
                field="key",
            )
        if not MIN_NONCE_BYTES <= len(nonce) <= MAX_NONCE_BYTES:
            raise InvalidArgumentError(
                f"nonce: {len(nonce)} bytes, must be {MIN_NONCE_BYTES} to {MAX_NONCE_BYTES}",
                field="nonce",
            )
        if byte_size < len(nonce):
            raise InvalidArgumentError(
                f"byte_size: {byte_size} is less than the nonce it holds", field="byte_size"
            )
        if self.max_region_bytes is not None and byte_size > self.max_region_bytes:
            raise ResourceExhaustedError(
                f"shared memory region of {byte_size} bytes is over the session's limit of "
                f"{self.max_region_bytes} bytes",
                reason="REGION_TOO_LARGE",
            )
        with self._lock:
            self._check_room(name)
        fd = _open_counted(self._open, key)
        try:
            inode = self._check_object(fd, key, byte_size, nonce)
            with self._lock:
                self._check_room(name)
                with _claims_lock:
                    owner, names = _claims.get(inode, (self.owner, 0))
                    if owner != self.owner:
                        raise FailedPreconditionError(
                            f"shared memory object /dev/shm/{key} is registered by another session",
                            reason="REGION_IN_USE",
                            field="key",
                        )
                    _claims[inode] = (owner, names + 1)
                self._regions[name] = Region(name, key, byte_size, fd, inode)
        except BaseException:
            _close_counted(fd)
            raise

    def _check_room(self, name: str) -> None:
        """(caller holds ``_lock``)"""
        if self._closed:
            raise NotFoundError("the session is closed", reason="SESSION_NOT_FOUND")
        if name in self._regions:
            raise AlreadyExistsError(
                f"shared memory region {name!r} is already registered in this session",
                reason="REGION_EXISTS",
                field="name",
            )
        if len(self._regions) >= self.max_regions:
            raise ResourceExhaustedError(
                f"the session holds its limit of {self.max_regions} shared memory regions",
                reason="TOO_MANY_REGIONS",
            )

    def _open(self, key: str) -> int:
        flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY
        try:
            dir_fd = os.open(self.shm_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            if e.errno in (errno.EMFILE, errno.ENFILE):  # (the usual case, not the object's)
                raise _server_full() from None
            raise NotFoundError(
                f"the server has no {SHM_DIR} ({e.strerror}): no shared memory here",
                reason="SHARED_MEMORY_UNAVAILABLE",
            ) from None
        try:
            return os.open(key, flags, dir_fd=dir_fd)
        except OSError as e:
            if e.errno in (errno.EMFILE, errno.ENFILE):
                raise _server_full() from None
            why = "a symbolic link" if e.errno == errno.ELOOP else e.strerror
            raise NotFoundError(
                f"the server cannot open shared memory object /dev/shm/{key} ({why}): "
                "it does not share the worker's host and /dev/shm (Docker: --ipc=host)",
                reason="SHARED_MEMORY_UNAVAILABLE",
                field="key",
            ) from None
        finally:
            os.close(dir_fd)

    @staticmethod
    def _check_object(fd: int, key: str, byte_size: int, nonce: bytes) -> tuple[int, int]:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise InvalidArgumentError(
                f"/dev/shm/{key} is not a shared memory object (not a regular file)",
                field="key",
            )
        if info.st_size < byte_size:
            raise InvalidArgumentError(
                f"byte_size: shared memory object /dev/shm/{key} has {info.st_size} bytes, "
                f"fewer than the {byte_size} registered",
                field="byte_size",
            )
        head = os.pread(fd, len(nonce), 0)
        if head != nonce:
            raise FailedPreconditionError(
                f"shared memory object /dev/shm/{key} does not start with the nonce: the "
                "server opened another object of that name (another host or /dev/shm)",
                reason="SHARED_MEMORY_MISMATCH",
                field="nonce",
            )
        return info.st_dev, info.st_ino

    def unregister(self, name: str = "") -> int:
        """Drop the region ``name`` (every region when empty); returns how many. An
        unknown name is NOT_FOUND."""
        with self._lock:
            if name:
                region = self._regions.pop(name, None)
                if region is None:
                    raise self._not_found(name)
                dropped = [region]
            else:
                dropped = list(self._regions.values())
                self._regions.clear()
            closing = self._drop(dropped)
        _close(closing)
        return len(dropped)

    def close(self) -> None:
        """Drop every region; later registrations fail (the session closed)."""
        with self._lock:
            self._closed = True
            closing = self._drop(list(self._regions.values()))
            self._regions.clear()
        _close(closing)

    @staticmethod
    def _drop(regions: Sequence[Region]) -> list[Region]:
        """Mark regions dropped; returns those no copy uses (caller holds ``_lock``)."""
        for region in regions:
            region.dropped = True
        return [r for r in regions if r.users == 0]

    def _not_found(self, name: str) -> NotFoundError:
        """NOT_FOUND for ``name``: the session's (SESSION_NOT_FOUND) once it closed, so
        that a call racing CloseSession is told its session is gone, and the SDK does
        not register the region again (its answer to REGION_NOT_FOUND)."""
        if self._closed:
            return NotFoundError("the session is closed", reason="SESSION_NOT_FOUND")
        return NotFoundError(
            f"shared memory region {name[:140]!r} is not registered in this session",
            reason="REGION_NOT_FOUND",
            field="region",
        )

    @contextlib.contextmanager
    def use(self, name: str) -> Iterator[Region]:
        """The region ``name`` of this session, kept open while the block runs. One
        that was unlinked is dropped from the table (and NOT_FOUND)."""
        with self._lock:
            region = self._regions.get(name)
            if region is None:
                raise self._not_found(name)
            region.users += 1
        try:
            yield region
        except NotFoundError as e:
            if e.reason == "REGION_UNLINKED":
                with self._lock:
                    if self._regions.get(name) is region:
                        del self._regions[name]
                        region.dropped = True
            raise
        finally:
            with self._lock:
                region.users -= 1
                closing = self._drop([region]) if region.dropped else []
            _close(closing)

    def byte_size(self, name: str) -> int:
        """The registered size of region ``name`` (NOT_FOUND if none)."""
        with self._lock:
            region = self._regions.get(name)
        if region is None:
            raise self._not_found(name)
        return region.byte_size

    # ---------------------------------------------------------------- tensors
    def nbytes(self, dtype: np.dtype[Any], shape: Sequence[int], field: str) -> int:
        """The bytes of a (dtype, shape) tensor in a region; strings are refused."""
        if dtype == dtypes.STRING:
            raise InvalidArgumentError(
                f"{field}: string tensors cannot be passed in shared memory (their "
                "elements vary in length); send them inline",
                field=field,
            )
        count = shapes.num_elements(shape, dtype.itemsize, what=field)
        nbytes = count * dtype.itemsize
        if self.max_tensor_bytes is not None and nbytes > self.max_tensor_bytes:
            raise ResourceExhaustedError(
                f"{field}: tensor of {nbytes} bytes is over the server's max tensor size "
                f"of {self.max_tensor_bytes} bytes (--max-tensor-bytes)",
                reason="TENSOR_TOO_LARGE",
            )
        return nbytes

    def read(
        self, name: str, offset: int, dtype: np.dtype[Any], shape: Sequence[int], field: str
    ) -> np.ndarray:
        """A copy of the tensor at ``offset`` of region ``name``: a new read-only array
        that the worker's later writes to the region do not change."""
        nbytes = self.nbytes(dtype, shape, field)
        with self.use(name) as region:
            region.check_bounds(offset, nbytes, field)  # before allocating
            buffer = self.buffers.empty(nbytes)
            if nbytes:
                region.read_into(offset, buffer.data, field)
        array = buffer.view(dtype.newbyteorder("<")).reshape(tuple(shape))
        array.flags.writeable = False
        return array

    def write(self, name: str, offset: int, array: np.ndarray, field: str) -> None:
        """Write host array ``array`` (not strings) at ``offset`` of region ``name``."""
        dtype = dtypes.normalize(array.dtype)
        nbytes = self.nbytes(dtype, array.shape, field)
        little = np.ascontiguousarray(array.astype(dtype.newbyteorder("<"), copy=False))
        data = little.reshape(-1).view(np.uint8).data if nbytes else memoryview(b"")
        with self.use(name) as region:
            region.write_from(offset, data, field)


#: Reads of at least this many bytes are split in parts read by several threads: a
#: copy out of ``/dev/shm`` by ``preadv`` runs well below memcpy's speed (the kernel's
#: work per 4 KiB page) and its parts overlap (reads take no lock of the object).
#: Writes are not split: each holds the object's lock, so parts would only queue.
PARALLEL_READ_BYTES = 32 << 20
#: Parts of a split read (one thread each, the caller's among them) and the least
#: bytes of one part.
MAX_READ_PARTS = 4
MIN_PART_BYTES = 16 << 20
PAGE = 4096


def _parallel_parts(nbytes: int) -> int:
    if nbytes < PARALLEL_READ_BYTES:
        return 1
    return max(1, min(MAX_READ_PARTS, os.cpu_count() or 1, nbytes // MIN_PART_BYTES))


@functools.cache
def _readers() -> ThreadPoolExecutor:
    """The threads that read the parts of split reads but the first (made on first use;
    its threads start as parts arrive)."""
    return ThreadPoolExecutor(MAX_READ_PARTS - 1, thread_name_prefix="gradserve-shm-read")


def _close(regions: Sequence[Region]) -> None:
    """Close the descriptors of regions no longer registered nor used."""
    for region in regions:
        with _claims_lock:
            owner, names = _claims.pop(region.inode, ("", 1))
            if names > 1:
                _claims[region.inode] = (owner, names - 1)
        _close_counted(region.fd)


def _server_full() -> ResourceExhaustedError:
    return ResourceExhaustedError(
        f"the server holds its limit of {MAX_OPEN_REGIONS} shared memory regions (half its "
        "open-file limit), all sessions together; unregister some, or use the wire",
        reason="SERVER_REGIONS_FULL",
    )


def _open_counted(open_fd: Any, key: str) -> int:
    """``open_fd(key)``, counted against ``MAX_OPEN_REGIONS`` (refused past it)."""
    global _open_regions
    with _claims_lock:
        if _open_regions >= MAX_OPEN_REGIONS:
            raise _server_full()
        _open_regions += 1
    try:
        return int(open_fd(key))
    except BaseException:
        with _claims_lock:
            _open_regions -= 1
        raise


def _close_counted(fd: int) -> None:
    global _open_regions
    with _claims_lock:
        _open_regions -= 1
    with contextlib.suppress(OSError):
        os.close(fd)
