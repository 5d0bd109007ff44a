"""Same-host shared memory for the SDK: regions, their registration, and leases.

A client whose server runs on the same host (``Client(shared_memory="auto")``, the
default) passes large inputs, ``put``/``get`` and the outputs of op calls through
POSIX shared memory (``multiprocessing.shared_memory``) instead of the network: it
copies an array into a region and sends (region, offset, dtype, shape); the server
copies it out (or writes outputs in) with one system call.

Same host is proven, not assumed: the first region is registered with a random
nonce written at its start, and the server accepts it only if it reads that nonce
back from ``/dev/shm/<key>`` (a server elsewhere cannot open the object, or opens
another one). Until that succeeds — and for string tensors, which stay on the wire —
everything goes over gRPC as before.

Regions are pooled: a call leases what it needs (``Lease``) and gives it back after
its reply is read, so concurrent calls of one client never share a region. A region
is created at its full size with ``posix_fallocate``: a ``/dev/shm`` too small for
it (Docker's default is 64 MB) fails there, cleanly, and the tensor goes on the wire,
instead of SIGBUS on a later write. The pool holds at most ``max_bytes`` of regions;
past that, idle regions are dropped first, then the wire is used.

``get`` and op calls are zero-copy for large results: the arrays they return live in
the region the server wrote them into (``SharedMemoryPool.pin``, ``pin_outputs``),
which is the caller's until those arrays and every view of them are gone; only then
is the region leased again. See ``Pinned`` for the rules that make this safe.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import secrets
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from multiprocessing import shared_memory
from typing import Any, NamedTuple

import numpy as np
from google.protobuf.message import Message

from gradserve import codec, dtypes
from gradserve.client._errors import server_done
from gradserve.client._queues import take_all
from gradserve.errors import AlreadyExistsError, GradserveError, NotFoundError
from gradserve.protocol import OUTPUT_REGION_METADATA_KEY, SHM_RESERVED_BYTES
from gradserve.v1 import shared_memory_pb2, tensor_pb2

log = logging.getLogger(__name__)

#: Offsets of tensors in a region are multiples of this.
ALIGN = 64
#: The first region (the same-host proof) and the least any region holds.
FIRST_REGION_BYTES = 1 << 20
#: A new region is at least this large (unless the tensor needs more), so that a
#: few regions serve many calls.
MIN_REGION_BYTES = 4 << 20
#: Regions one client holds at most (the server allows a session 64).
MAX_REGIONS = 16
#: Default ceiling of all regions of one client together.
DEFAULT_MAX_BYTES = 4 << 30
NONCE_BYTES = 32
SHM_DIR = "/dev/shm"
#: ``get`` and op calls return tensors of at least this many bytes in their region,
#: without a copy (smaller ones are copied out: cheap, and they would tie up a region
#: each).
ZERO_COPY_MIN_BYTES = 1 << 20
#: Regions that arrays returned by ``get`` may hold at once (the rest of the pool
#: stays for puts and op calls; past it, ``get`` copies out).
MAX_PINNED_REGIONS = MAX_REGIONS // 2


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def aligned_total(sizes: Sequence[int]) -> int:
    """The bytes outputs of these sizes take in a region (each at an aligned offset)."""
    return sum(_aligned(n) for n in sizes)


def _typed(flat: np.ndarray, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """Bytes of a region (uint8) as a little-endian array of ``dtype`` and ``shape``."""
    return flat.view(dtype.newbyteorder("<")).reshape(shape)


class _OpenPin(NamedTuple):
    """A call's pinned outputs: the offset in the region where ``flat`` starts."""

    start: int
    flat: np.ndarray


class Region:
    """One shared-memory object, registered with the session under ``name``."""

    def __init__(self, size: int) -> None:
        name = f"gradserve_{secrets.token_hex(12)}"
        self.shm = shared_memory.SharedMemory(name=name, create=True, size=size)
        self.name = self.shm.name
        self.size = size
        self.last_need = 0
        #: What registered it (kept here: the region's first bytes are never data, but
        #: the client keeps its own copy to register it again).
        self.nonce = b""
        try:
            # Reserve its pages now: ENOSPC here rather than SIGBUS on a write later.
            fd = os.open(os.path.join(SHM_DIR, self.name), os.O_RDWR | os.O_CLOEXEC)
            try:
                os.posix_fallocate(fd, 0, size)
            finally:
                os.close(fd)
        except BaseException:
            self.destroy()
            raise

    def view(self, offset: int, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        """The region's bytes at ``offset`` as an array (no copy)."""
        count = int(np.prod(shape, dtype=np.int64))
        flat = np.frombuffer(self.buf, dtype.newbyteorder("<"), count, offset)
        return flat.reshape(shape)

    def address(self, offset: int) -> int:
        """Where byte ``offset`` of the region is mapped in this process."""
        probe = np.frombuffer(self.buf, np.uint8, 1, offset)
        return int(probe.__array_interface__["data"][0])

    @property
    def buf(self) -> memoryview:
        buf = self.shm.buf
        assert buf is not None  # until destroyed
        return buf

    def destroy(self) -> None:
        with contextlib.suppress(OSError, BufferError):
            self.shm.close()
        with contextlib.suppress(OSError):
            self.shm.unlink()


class Pinned:
    """The owner of the memory of an array returned without a copy: ``base`` of that
    array, so that the array and every view of it (each holds its base) keep it.

    While it lives, its region is the caller's alone:

    - the pool never leases it (it is not free) nor drops it to make room;
    - ``view`` (a slice of the region's memoryview, held by its finalizer) is an
      export of the mapping, so nothing can unmap it: ``SharedMemory.close`` raises
      ``BufferError`` and the pool's ``close`` only unlinks the region (POSIX keeps
      an unlinked object's memory while it is mapped);
    - the server writes a region only where a call names it as output, and no call
      names a pinned region, so the caller may write into the array freely: the
      server's tensor is its own copy.

    A child process forked while the arrays live shares their memory (a ``MAP_SHARED``
    mapping): its in-place writes are the parent's too. That is documented rather
    than prevented: a private copy-on-write mapping per pin would cost a ``mmap`` and
    a page fault per page on every zero-copy result.

    When the last array goes, its finalizer (``SharedMemoryPool._unpin``) releases
    ``view`` and hands the region back: to the pool, or, once the pool is closed, to
    be unmapped.
    """

    __slots__ = ("__array_interface__", "__weakref__", "region")

    def __init__(self, region: str, address: int, nbytes: int) -> None:
        self.region = region  #: the region's name
        self.__array_interface__ = {
            "version": 3,
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (address, False),
        }


class Lease:
    """The regions one call uses: inputs placed one after another (``place``), and an
    output region (``output``). ``release`` gives them back to the pool."""

    def __init__(self, pool: SharedMemoryPool) -> None:
        self.pool = pool
        self._inputs: list[tuple[Region, int]] = []  # (region, bytes used)
        self.out: Region | None = None

    def place(self, array: np.ndarray, msg: tensor_pb2.SharedTensor) -> bool:
        """Copy ``array`` (not strings) into a leased region and describe it in ``msg``;
        False when the pool cannot hold it (the caller sends it on the wire)."""
        nbytes = array.nbytes
        region, used = self._inputs[-1] if self._inputs else (None, 0)
        start = _aligned(max(used, SHM_RESERVED_BYTES))  # never over the nonce
        if region is None or start + nbytes > region.size:
            region = self.pool.acquire(SHM_RESERVED_BYTES + nbytes)
            if region is None:
                return False
            self._inputs.append((region, 0))
            start = SHM_RESERVED_BYTES
        if nbytes:
            region.view(start, array.dtype, array.shape)[...] = array
        self._inputs[-1] = (region, start + nbytes)
        msg.region = region.name
        msg.offset = start
        msg.dtype = codec.dtype_to_enum(array.dtype)
        msg.shape[:] = array.shape
        return True

    def output(self, nbytes: int) -> Region | None:
        """A region of at least ``nbytes`` for the call's outputs (None: none free)."""
        if self.out is None:
            self.out = self.pool.acquire(nbytes)
        return self.out

    def renew_output(self) -> None:
        """Before a call is repeated (UNAVAILABLE): the attempt that got no reply may
        still write its outputs into the output region, so it is discarded and the
        next ``output`` leases another."""
        if self.out is not None:
            self.pool.discard([self.out])
            self.out = None

    def release(self) -> None:
        self.pool.give_back(self._taken())

    def release_later(self) -> None:
        """``release`` from a finalizer (``SharedMemoryPool.give_back_later``)."""
        self.pool.give_back_later(self._taken())

    def discard(self) -> None:
        """The call ended without a reply (deadline, cancel, lost connection): the
        server may still read these regions or write outputs into them, so they are
        never leased again: unregistered and unlinked instead."""
        self.pool.discard(self._taken())

    def _taken(self) -> list[Region]:
        """Every region of the lease, which holds none from now on."""
        regions = [r for r, _ in self._inputs] + ([self.out] if self.out else [])
        self._inputs, self.out = [], None
        return regions


class SharedMemoryPool:
    """A client's regions: created, registered and dropped through ``call``
    (``call(rpc, request)`` runs one RPC of the session)."""

    def __init__(self, call: Callable[[str, Any], Any], max_bytes: int = DEFAULT_MAX_BYTES):
        self._call = call
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._free: list[Region] = []
        self._all: dict[str, Region] = {}
        self._held = 0
        #: The most output bytes a call has needed: output regions are leased this big.
        self.output_hint = FIRST_REGION_BYTES
        self.closed = False
        #: Regions held by arrays ``get`` returned (``pin``), and their bytes.
        self._pinned: set[str] = set()
        self._pinned_bytes = 0
        #: Regions whose arrays are gone, not yet back in ``_free``: a finalizer runs
        #: wherever the garbage collector does, maybe inside ``_lock``, so it only
        #: appends here (atomic) and ``_reclaim`` takes them back under the lock.
        self._returned: collections.deque[Region] = collections.deque()
        #: Leased regions a finalizer gave back (``give_back_later``), likewise.
        self._given_back: collections.deque[Region] = collections.deque()
        #: Regions whose call's outputs are being read as views (``pin_outputs``),
        #: by region name: a region is leased to one call, so calls never collide.
        self._open_pins: dict[str, _OpenPin] = {}

    def start(self) -> None:
        """Create and register the first region: raises if the server cannot read it
        (another host, another /dev/shm, a server without shared memory)."""
        region = self._create(FIRST_REGION_BYTES)
        with self._lock:
            self._free.append(region)

    def _create(self, size: int) -> Region:
        region = Region(size)
        try:
            nonce = region.nonce = os.urandom(NONCE_BYTES)
            region.buf[:NONCE_BYTES] = nonce
            request = shared_memory_pb2.RegisterSharedMemoryRequest(
                name=region.name, key=region.name, byte_size=size, nonce=nonce
            )
            self._call("RegisterSharedMemory", request)
        except BaseException:
            region.destroy()
            raise
        with self._lock:
            self._all[region.name] = region
            self._held += size
        return region

    def acquire(self, nbytes: int) -> Region | None:
        """A free region of at least ``nbytes``, made if need be; None when the pool's
        ceiling (after dropping idle regions) or the host cannot hold one."""
        with self._lock:
            if self.closed:
                return None
            self._reclaim()
            fits = [r for r in self._free if r.size >= nbytes]
            if fits:
                region = min(fits, key=lambda r: r.size)
                self._free.remove(region)
                return region
            size = max(_aligned(nbytes), MIN_REGION_BYTES)
            evict = []
            while self._free and (
                self._held + size > self.max_bytes or len(self._all) >= MAX_REGIONS
            ):
                victim = self._free.pop(0)
                evict.append(victim)
                self._held -= victim.size
                del self._all[victim.name]
            room = self._held + size <= self.max_bytes and len(self._all) < MAX_REGIONS
        self._drop(evict)
        if not room:
            return None
        try:
            return self._create(size)
        except (OSError, GradserveError) as e:  # /dev/shm full, a limit of the server
            log.info("no shared memory region of %d bytes (%s): using the wire", size, e)
            return None

    def give_back(self, regions: list[Region]) -> None:
        with self._lock:
            if not self.closed:
                self._free.extend(regions)
                return
        for region in regions:
            region.destroy()

    def give_back_later(self, regions: list[Region]) -> None:
        """``give_back`` from a finalizer (a batch dropped unrun): it runs wherever the
        garbage collector does, maybe inside ``_lock`` on this thread, where taking the
        lock deadlocked (helper-75), so it only appends; ``_reclaim`` takes them back."""
        self._given_back.extend(regions)
        if self.closed:  # after ``close`` took what was given back before
            _destroy_all(self._given_back)

    def region(self, name: str) -> Region:
        with self._lock:
            return self._all[name]

    def read(self, msg: tensor_pb2.SharedTensor) -> np.ndarray:
        """An output the server wrote into one of our regions: a view of the region
        when the call's outputs were pinned there (``pin_outputs``), else a copy."""
        region, dtype, shape, count = self._located(msg)
        nbytes = count * dtype.itemsize
        pinned = self._open_pins.get(msg.region)
        if pinned is not None and nbytes >= ZERO_COPY_MIN_BYTES:
            start = msg.offset - pinned.start
            if 0 <= start and start + nbytes <= pinned.flat.size:
                return _typed(pinned.flat[start : start + nbytes], dtype, shape)
        out = np.empty(shape, dtype)
        if count:
            out[...] = region.view(msg.offset, dtype, shape)
        return out

    def _located(
        self, msg: tensor_pb2.SharedTensor
    ) -> tuple[Region, np.dtype, tuple[int, ...], int]:
        dtype = codec.dtype_from_enum(msg.dtype, field="output")
        try:
            region = self.region(msg.region)
        except KeyError:  # the client closed meanwhile (its regions forgotten)
            raise GradserveError(f"shared memory region {msg.region!r} is gone") from None
        shape = tuple(msg.shape)
        count = int(np.prod(shape, dtype=np.int64))
        if msg.offset < 0 or msg.offset + count * dtype.itemsize > region.size:
            raise GradserveError(f"output outside shared memory region {msg.region!r}")
        return region, dtype, shape, count

    def pin(self, region: Region, msg: tensor_pb2.SharedTensor) -> np.ndarray | None:
        """The tensor ``msg`` names in ``region`` (leased by the caller, who gives it
        up on success) as an array backed by the region itself, no copy: the region
        stays out of the pool until that array and its views are gone (``Pinned``).
        None (keep the lease, copy out) when the tensor is small, when the region is
        much larger than it, or when arrays already hold their share of the pool."""
        located, dtype, shape, count = self._located(msg)
        if located is not region:
            return None
        flat = self._pin_span(region, msg.offset, count * dtype.itemsize)
        return None if flat is None else _typed(flat, dtype, shape)

    def pin_outputs(self, region: Region, outputs: list[tensor_pb2.SharedTensor]) -> bool:
        """Pin the span of ``region`` that holds a call's large ``outputs`` (of at least
        ``ZERO_COPY_MIN_BYTES`` each), so that ``read`` returns them as views of it
        until ``end_outputs``: they share one ``Pinned``, and the region comes back
        when the last of them goes. False (``read`` copies; the caller keeps its
        lease) as for ``pin``."""
        spans = []  # only large outputs are views (``read``): small ones are copied,
        for msg in outputs:  # so that one kept bias gradient holds no region
            located, dtype, _, count = self._located(msg)
            if located is region and count * dtype.itemsize >= ZERO_COPY_MIN_BYTES:
                spans.append((msg.offset, msg.offset + count * dtype.itemsize))
        if not spans:
            return False
        start = min(a for a, _ in spans)
        flat = self._pin_span(region, start, max(b for _, b in spans) - start)
        if flat is None:
            return False
        self._open_pins[region.name] = _OpenPin(start, flat)
        return True

    def end_outputs(self, region: Region) -> None:
        """The call's outputs are read: the pin is held by its arrays alone now."""
        self._open_pins.pop(region.name, None)

    def _pin_span(self, region: Region, offset: int, nbytes: int) -> np.ndarray | None:
        """``nbytes`` of ``region`` from ``offset`` as a uint8 array whose base is a
        ``Pinned``, or None (too small, region much larger, pool share spent)."""
        if nbytes < ZERO_COPY_MIN_BYTES or 4 * nbytes < region.size:
            return None  # a small array would tie up a large region
        with self._lock:
            self._reclaim()
            if (
                self.closed
                or region.name not in self._all
                or len(self._pinned) >= MAX_PINNED_REGIONS
                or self._pinned_bytes + region.size > self.max_bytes // 2
            ):
                return None
            self._pinned.add(region.name)
            self._pinned_bytes += region.size
        try:
            view = region.buf[offset : offset + nbytes]
            owner = Pinned(region.name, region.address(offset), nbytes)
        except BaseException:
            with self._lock:
                self._pinned.discard(region.name)
                self._pinned_bytes -= region.size
            raise
        finalizer = weakref.finalize(owner, self._unpin, region, view)
        finalizer.atexit = False  # at exit, arrays may still be in use: leave the mapping
        flat: np.ndarray = np.asarray(owner)  # its base is ``owner``
        del owner  # only arrays hold it now
        return flat

    def _unpin(self, region: Region, view: memoryview) -> None:
        """(the finalizer of a ``Pinned``: any thread, any time, maybe inside ``_lock``)"""
        view.release()  # the mapping may be closed from now on
        self._returned.append(region)
        if self.closed:  # after ``close`` took what was returned before
            self._destroy_returned()

    def _reclaim(self) -> None:
        """Regions whose arrays are gone, or that a finalizer gave back, go back to
        ``_free`` (caller holds ``_lock``; the pool is open)."""
        for region in take_all(self._returned):
            self._pinned.discard(region.name)
            self._pinned_bytes -= region.size
            self._to_free(region)
        for region in take_all(self._given_back):
            self._to_free(region)

    def _to_free(self, region: Region) -> None:
        """(caller holds ``_lock``) A region back in ``_free``, or unmapped if it is
        not ours any more (never happens while open)."""
        if self._all.get(region.name) is region:
            self._free.append(region)
        else:
            region.destroy()

    def _destroy_returned(self) -> None:
        _destroy_all(self._returned)
        _destroy_all(self._given_back)

    def reregister(self) -> None:
        """Register every region again (the server lost them: it restarted and
        restored the session from a snapshot, which holds no descriptors). Its
        first bytes still hold the nonce (no data goes there), which the client kept."""
        with self._lock:
            regions = list(self._all.values())
        for region in regions:
            request = shared_memory_pb2.RegisterSharedMemoryRequest(
                name=region.name,
                key=region.name,
                byte_size=region.size,
                nonce=region.nonce,
            )
            with contextlib.suppress(AlreadyExistsError):  # it did keep this one
                self._call("RegisterSharedMemory", request)

    def note_output_need(self, nbytes: int) -> None:
        """A call returned ``nbytes`` of outputs: lease output regions that large."""
        if nbytes > self.output_hint:
            self.output_hint = min(_aligned(nbytes), self.max_bytes // 2)

    def discard(self, regions: list[Region]) -> None:
        """Drop leased regions for good (``Lease.discard``)."""
        with self._lock:
            for region in regions:
                if self._all.pop(region.name, None) is region:
                    self._held -= region.size
        self._drop(regions)

    def _drop(self, regions: list[Region]) -> None:
        if not regions:
            return
        for region in regions:
            with contextlib.suppress(GradserveError):
                self._call(
                    "UnregisterSharedMemory",
                    shared_memory_pb2.UnregisterSharedMemoryRequest(name=region.name),
                )
            region.destroy()

    def close(self, unregister: bool) -> None:
        """Unlink every region (and unregister them, if the session stays open)."""
        with self._lock:
            self.closed = True
            regions = list(self._all.values())
            free = set(map(id, self._free))
            self._all.clear()
            self._free.clear()
            self._held = 0
            self._pinned.clear()
            self._pinned_bytes = 0
        self._destroy_returned()  # arrays gone: not leased, not pinned any more
        for region in regions if unregister else ():  # only ours: others may share the session
            with contextlib.suppress(GradserveError):
                self._call(
                    "UnregisterSharedMemory",
                    shared_memory_pb2.UnregisterSharedMemoryRequest(name=region.name),
                )
        for region in regions:
            if id(region) in free:
                region.destroy()
            else:  # leased now, or held by arrays: destroyed when given back
                with contextlib.suppress(OSError):
                    region.shm.unlink()


def usable(array: np.ndarray) -> bool:
    """Whether ``array`` can travel in shared memory (strings cannot)."""
    return array.dtype != dtypes.STRING


#: Inputs smaller than this go inline even when shared memory is on: copying them
#: into a region costs about what sending them does.
DEFAULT_MIN_BYTES = 64 << 10


class ClientSharedMemory:
    """What a ``Client`` does with shared memory: inputs placed in regions, outputs
    written into one, ``put``/``get`` by region. Every method answers None (or False)
    where the wire should be used instead."""

    def __init__(
        self, pool: SharedMemoryPool, min_bytes: int, call: Callable[[str, Any], Any]
    ) -> None:
        self.pool = pool
        self.min_bytes = min_bytes
        #: Runs ``put``'s and ``get``'s RPCs (the pool's own calls may be tried once):
        #: the client's, which registers the regions again where a server lost them
        #: (``recover``).
        self._call = call

    @classmethod
    def connect(
        cls,
        call: Callable[[str, Any], Any],
        mode: bool | str,
        min_bytes: int,
        *,
        housekeeping: Callable[[str, Any], Any] | None = None,
    ) -> ClientSharedMemory | None:
        """Shared memory with the server of ``call``, if ``mode`` asks for it and the
        server proves it shares this host. ``mode``: "auto" (the wire otherwise),
        True (raise otherwise) or False (never). ``housekeeping`` (default ``call``)
        runs the pool's own RPCs, which registering and dropping regions make inside
        other calls."""
        if mode not in (True, False, "auto"):
            raise ValueError(f"shared_memory must be 'auto', True or False, not {mode!r}")
        if mode is False:
            return None
        pool = SharedMemoryPool(housekeeping or call)
        try:
            pool.start()
        except (OSError, GradserveError) as e:
            if mode is True:
                raise
            log.info("shared memory unavailable (%s): using the wire", e)
            return None
        return cls(pool, min_bytes, call)

    # ---------------------------------------------------------------- op calls
    def encode_input(self, array: np.ndarray, msg: tensor_pb2.TensorInput, temps: list) -> bool:
        """Place ``array`` in a region leased for this request's ``temps`` (the lease
        is released with them, ``release_temps``)."""
        if array.nbytes < self.min_bytes or not usable(array):
            return False
        lease = next((t for t in temps if isinstance(t, Lease)), None)
        if lease is None:
            lease = Lease(self.pool)
            temps.append(lease)
        return lease.place(array, msg.shared)

    def recover(self, error: NotFoundError) -> bool:
        """After a call failed because the server does not know one of our regions
        (it restarted; nothing ran): register them again; True if the call may be
        repeated, False (the error stands) otherwise."""
        if error.reason != "REGION_NOT_FOUND":
            return False
        try:
            self.pool.reregister()
        except GradserveError as e:
            log.warning("could not register shared memory again: %s", e)
            return False
        return True

    def output_lease(self) -> Lease:
        return Lease(self.pool)

    def output_metadata(self, lease: Lease, metadata: tuple) -> tuple | None:
        """The call's metadata naming its output region (None: no region free)."""
        region = lease.output(SHM_RESERVED_BYTES + self.pool.output_hint)
        if region is None:
            return None
        return (*metadata, (OUTPUT_REGION_METADATA_KEY, region.name))

    def read_output(self, msg: tensor_pb2.TensorOutput) -> np.ndarray:
        return self.pool.read(msg.shared)

    @contextlib.contextmanager
    def outputs_in_place(self, lease: Lease, reply: Any) -> Iterator[None]:
        """While the reply is parsed, its outputs in ``lease``'s output region are
        read as views of the region (``SharedMemoryPool.pin_outputs``); the region
        then belongs to those arrays, not to the lease. Without a pin, copies."""
        region = lease.out
        outputs = [o.shared for o in tensor_outputs(reply) if o.WhichOneof("result") == "shared"]
        if region is None or not self.pool.pin_outputs(region, outputs):
            yield
            return
        lease.out = None  # the arrays hold the region now
        try:
            yield
        finally:
            self.pool.end_outputs(region)

    def note_reply(self, reply: Any) -> None:
        """Size output regions for the outputs this reply returned."""
        self.pool.note_output_need(returned_bytes(reply))

    @staticmethod
    def release_temps(temps: list, discard: bool = False, later: bool = False) -> list:
        """Release the leases among a request's temporaries (``discard``: the call got
        no reply, see ``Lease.discard``; ``later``: from a finalizer, see
        ``Lease.release_later``); returns the rest (ids)."""
        rest = []
        for item in temps:
            if not isinstance(item, Lease):
                rest.append(item)
            elif discard:
                item.discard()
            else:
                item.release_later() if later else item.release()
        return rest

    # ---------------------------------------------------------------- put / get
    def put(self, array: np.ndarray) -> Any | None:
        """``PutSharedTensor`` of ``array``: the reply (a ``ResidentTensor``), or None."""
        if not usable(array):
            return None
        lease = Lease(self.pool)
        try:
            request = shared_memory_pb2.PutSharedTensorRequest()
            if not lease.place(array, request.tensor):
                lease.release()
                return None
            reply = self._call("PutSharedTensor", request)
        except BaseException as e:
            _end(lease, e)
            raise
        lease.release()
        return reply

    def get(self, tensor_id: str, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray | None:
        """``GetSharedTensor`` of a resident tensor of known dtype and shape, or None.
        A large one comes back in the region the server wrote it to (``pool.pin``):
        an array of the caller's own, writable, that holds the region until it goes."""
        if dtype == dtypes.STRING:
            return None
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        lease = Lease(self.pool)
        try:
            region = lease.output(SHM_RESERVED_BYTES + nbytes)
            if region is None:
                lease.release()
                return None
            request = shared_memory_pb2.GetSharedTensorRequest(
                id=tensor_id,
                region=region.name,
                offset=SHM_RESERVED_BYTES,
            )
            reply = self._call("GetSharedTensor", request)
            out = self.pool.pin(region, reply.tensor)
            if out is None:
                out = self.pool.read(reply.tensor)
            else:  # the array holds the region now
                lease.out = None
        except BaseException as e:
            _end(lease, e)
            raise
        lease.release()
        return out

    def close(self, unregister: bool) -> None:
        self.pool.close(unregister)


def _destroy_all(regions: collections.deque[Region]) -> None:
    for region in take_all(regions):
        region.destroy()


def tensor_outputs(message: Any) -> Iterator[tensor_pb2.TensorOutput]:
    """Every ``TensorOutput`` in a reply, however deeply nested."""
    for field, value in message.ListFields():
        if field.message_type is None:
            continue
        for item in [value] if isinstance(value, Message) else value:
            if isinstance(item, tensor_pb2.TensorOutput):
                yield item
            elif isinstance(item, Message):
                yield from tensor_outputs(item)


def returned_bytes(message: Any) -> int:
    """The bytes of the tensor outputs a reply returned (shared, inline or transient)."""
    total = 0
    for item in tensor_outputs(message):
        which = item.WhichOneof("result")
        if which == "ref" and not item.ref.transient:
            continue
        meta = getattr(item, which) if which else None
        if meta is not None and meta.dtype:
            dtype = codec.dtype_from_enum(meta.dtype)
            count = int(np.prod(tuple(meta.shape), dtype=np.int64))
            total += _aligned(count * dtype.itemsize)
    return total


def _end(lease: Lease, error: BaseException) -> None:
    """Give back a failed call's lease, or discard it if the server may still be at
    work on the call (``server_done``)."""
    lease.release() if server_done(error) else lease.discard()
