"""Admission: which calls the server takes, and when it drains.

The server is asyncio (``grpc.aio``): a call that waits — for a slow client's next
chunk, a compute slot, the network — is a suspended coroutine, not a thread. Work
that computes runs off the event loop on one of two bounded lanes (``lanes.Lane``):

- ``light``: small ops (TensorArray ops, StopGradient, tensor copies), ``--workers``
  threads;
- ``compute``: heavy ops (LSTM), ``--compute-slots`` threads, at most
  ``--max-queued-compute`` calls waiting; past that RESOURCE_EXHAUSTED at once.

Health and reflection never pass through either lane, so they answer while every
lane is busy. ``Admission`` counts the calls in flight (``--max-concurrent-rpcs``,
and ``--max-concurrent-rpcs-per-principal`` of one principal; health excluded) and
refuses every new call with UNAVAILABLE once the server drains, before it does
anything: a call the SDK may safely repeat goes elsewhere. Fetches and deletes of what
this replica holds (``DRAIN_CALLS``) are still admitted: no other replica could answer
them, and an op that ended in the drain sends its largest outputs that way.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from gradserve.errors import DRAINING_REASON, ResourceExhaustedError, UnavailableError


class Admission:
    """Calls in flight, their limits, and draining. Used from the event loop only.

    Unary calls count against ``max_calls`` (``--max-concurrent-rpcs``) and
    ``max_calls_per_principal``: one principal flooding slow calls never holds every
    slot (another principal's calls were refused 266 times out of 266). With several
    principals, the last slots of each limit (``_reserve``) go only to a principal
    with nothing in flight there: two principals flooding together (each within its
    half) left a third none (refused 299 times of 300). Streams
    (PutTensor, GetTensor) count apart, against ``max_streams`` and
    ``max_streams_per_principal``: a stalled stream costs no thread but holds a call,
    so streams — however many stall — never take the slots of small calls, and one
    principal's streams never take all of another's.

    A unary call leaves its slot when its handler returns; its reply may then wait in
    gRPC for a client that does not read it, for as long as the connection lives.
    Such replies count apart, in bytes, once gRPC has held them a second
    (``reply_waiting``, ``reply_taken``; ``boundary._Reply``): once a principal's
    waiting replies pass ``reply_allowance`` and the room its bytes budget has left,
    or its share of the server's (``reply_room``), its calls are refused, but
    those that free or keep what it has (``FREEING_CALLS``), until it reads them or
    goes. Counting them as calls in flight (66bd133) let one client without a token
    lock every other out with 256 unread replies of 1 MiB; not counting them let
    eight unread 32 MiB replies hold 512 MiB nothing saw.
    """

    #: Calls admitted whatever replies their principal leaves unread: they free what
    #: it holds, or keep its session from expiring.
    FREEING_CALLS = frozenset(
        {"KeepAlive", "CloseSession", "DeleteTensor", "ReleaseTape",
         "UnregisterSharedMemory", "TensorArrayCloseV3"}
    )  # fmt: skip

    #: Calls admitted while the server drains: they read or free what only this
    #: replica holds, and no other could answer them. An op that ended in the drain
    #: sends outputs that do not fit its reply by GetTensor calls after it; refused,
    #: its results were lost (found rerunning helper-81's drain script; an LSTM of 4.8 MB
    #: outputs). The drain waits for them as for any call, within ``--grace``.
    DRAIN_CALLS = frozenset({"GetTensor", "GetTensorInline", "DeleteTensor", "CloseSession"})

    #: A drain waits for this long after the last call it admitted (or saw end) before
    #: it stops the server: calls gRPC has received but not yet handed over are refused, not
    #: cancelled. Clients that keep calling (a worker repeating DRAINING refusals
    #: through a proxy) can still land a call in gRPC core's queue as it stops, which
    #: core ends CANCELLED (grpc/grpc#41785); the SDK counts that as UNAVAILABLE.
    QUIET_SECONDS = 0.25

    #: While outputs an op's reply handed out wait for their client's fetch, the
    #: drain looks again this often: a client slower to fetch than ``QUIET_SECONDS``
    #: (its process busy, the reply long on its way) found the server stopped and the
    #: op's results lost.
    UNFETCHED_POLL_SECONDS = 0.02

    #: A session's handed-out outputs hold a drain up only while its client is about
    #: it: their reply is on its way, a call on the session runs, or their reply left
    #: or a call ended less than this long ago (``Session.unfetched_outputs``; a
    #: client that crashed after its reply would otherwise hold every drain for all
    #: of ``--grace``).
    FETCH_PATIENCE_SECONDS = 5.0

    def __init__(
        self,
        max_calls: int | None,
        max_streams: int | None = None,
        max_streams_per_principal: int | None = None,
        max_calls_per_principal: int | None = None,
        *,
        reserve_for_newcomers: bool = False,
        reply_room: Callable[[str], tuple[int | None, int | None]] | None = None,
        reply_allowance: int = 0,
    ) -> None:
        self.max_calls = max_calls
        #: The bytes a principal's budget and the server's have left (None: no limit).
        self.reply_room = reply_room
        #: Bytes of waiting replies a principal may have whatever its room: one
        #: large reply on its way is no reason to refuse the next call.
        self.reply_allowance = reply_allowance
        self.reply_bytes = 0
        self._reply_bytes_of: dict[str, int] = {}
        self.max_calls_per_principal = max_calls_per_principal
        #: The last calls and streams of each limit that only a principal with none in
        #: flight may take (``reserve_for_newcomers``, with several principals).
        self.calls_reserved = _reserve(max_calls) if reserve_for_newcomers else 0
        self.streams_reserved = _reserve(max_streams) if reserve_for_newcomers else 0
        self.max_streams = max_streams
        self.max_streams_per_principal = max_streams_per_principal
        self.in_flight = 0
        self.streams = 0
        self._streams_of: dict[str, int] = {}
        self._calls_of: dict[str, int] = {}
        self.draining = False
        self._last_activity = 0.0
        self._idle: asyncio.Event | None = None

    def enter(self, principal: str, *, stream: bool = False, method: str = "") -> None:
        """Admit a call of ``method``, or refuse it (changing nothing)."""
        if self.draining and method not in self.DRAIN_CALLS:
            raise UnavailableError(
                "the server is shutting down: call another replica (or retry)",
                reason=DRAINING_REASON,
            )
        if method not in self.FREEING_CALLS:
            self._check_replies(principal)
        if stream:
            owned = self._streams_of.get(principal, 0)
            if self.max_streams is not None and self.streams >= self.max_streams:
                raise ResourceExhaustedError(
                    f"{self.streams} streams open, the server's limit (--max-streams); retry later",
                    reason="TOO_MANY_STREAMS",
                )
            limit = self.max_streams_per_principal
            if limit is not None and owned >= limit:
                raise ResourceExhaustedError(
                    f"principal {principal!r} has {owned} streams open, its limit "
                    "(--max-streams-per-principal); retry later",
                    reason="TOO_MANY_STREAMS_FOR_PRINCIPAL",
                )
            if owned and self._in_reserve(self.streams, self.max_streams, self.streams_reserved):
                raise ResourceExhaustedError(
                    f"{self.streams} streams open: the last {self.streams_reserved} of "
                    "--max-streams are kept for principals with none open; retry later",
                    reason="TOO_MANY_STREAMS",
                )
            self.streams += 1
            self._streams_of[principal] = owned + 1
        else:
            owned = self._calls_of.get(principal, 0)
            calls = self.in_flight - self.streams
            if self.max_calls is not None and calls >= self.max_calls:
                raise ResourceExhaustedError(
                    f"{calls} calls in flight, the server's limit "
                    "(--max-concurrent-rpcs); retry later",
                    reason="TOO_MANY_CALLS",
                )
            if owned and self._in_reserve(calls, self.max_calls, self.calls_reserved):
                raise ResourceExhaustedError(
                    f"{calls} calls in flight: the last {self.calls_reserved} of "
                    "--max-concurrent-rpcs are kept for principals with none in flight; "
                    "retry later",
                    reason="TOO_MANY_CALLS",
                )
            limit = self.max_calls_per_principal
            if limit is not None and owned >= limit:
                raise ResourceExhaustedError(
                    f"principal {principal!r} has {owned} calls in flight, its limit "
                    "(--max-concurrent-rpcs-per-principal); retry later",
                    reason="TOO_MANY_CALLS_FOR_PRINCIPAL",
                )
            self._calls_of[principal] = owned + 1
        self.in_flight += 1
        self._last_activity = time.monotonic()
        self._event().clear()

    @staticmethod
    def _in_reserve(used: int, limit: int | None, reserved: int) -> bool:
        return limit is not None and used >= limit - reserved

    def exit(self, principal: str, *, stream: bool = False) -> None:
        counts = self._streams_of if stream else self._calls_of
        left = counts[principal] - 1
        if left:
            counts[principal] = left
        else:
            del counts[principal]
        if stream:
            self.streams -= 1
        self.in_flight -= 1
        self._last_activity = time.monotonic()
        if self.in_flight == 0:
            self._event().set()

    def call_done(self) -> None:
        """gRPC is done with a unary call (its reply sent): the drain's quiet time
        counts from here too. A client fetches the outputs that did not fit an op's
        reply once it has the reply; counted from the op's arrival, the drain stopped
        the server as the op ended, and the fetches found nothing listening."""
        self._last_activity = time.monotonic()

    def reply_waiting(self, principal: str, nbytes: int) -> None:
        """A unary reply of ``nbytes`` has waited in gRPC past the grace
        (``boundary._Reply``); ``reply_taken`` once gRPC is done with its call."""
        self.reply_bytes += nbytes
        self._reply_bytes_of[principal] = self._reply_bytes_of.get(principal, 0) + nbytes

    def reply_taken(self, principal: str, nbytes: int) -> None:
        self.reply_bytes -= nbytes
        left = self._reply_bytes_of[principal] - nbytes
        if left:
            self._reply_bytes_of[principal] = left
        else:
            del self._reply_bytes_of[principal]

    def replies_of(self, principal: str) -> int:
        """Bytes of ``principal``'s replies gRPC has not finished with."""
        return self._reply_bytes_of.get(principal, 0)

    def _check_replies(self, principal: str) -> None:
        waiting = self.replies_of(principal)
        if waiting <= self.reply_allowance or self.reply_room is None:
            return
        principal_room, server_room = self.reply_room(principal)
        if principal_room is not None and waiting > principal_room:
            raise ResourceExhaustedError(
                f"principal {principal!r} has {waiting} bytes of replies its clients have "
                f"not read, more than its budget has left ({principal_room} bytes, "
                "--max-principal-bytes): read or cancel them",
                reason="REPLIES_UNREAD",
            )
        # Past the server's room, only a principal over its share of it is refused:
        # one principal's unread replies do not refuse another's calls.
        if server_room is None or self.reply_bytes <= server_room:
            return
        share = server_room // len(self._reply_bytes_of)
        if waiting > share:
            raise ResourceExhaustedError(
                f"{self.reply_bytes} bytes of replies wait for clients that have not read "
                f"them, {waiting} of them yours, more than your share of what the "
                f"server's budget has left ({share} bytes, --max-server-bytes): read or "
                "cancel them",
                reason="REPLIES_UNREAD",
            )

    async def drain(self, timeout: float, unfetched: Callable[[], int] | None = None) -> bool:
        """Refuse new calls (but ``DRAIN_CALLS``); wait up to ``timeout`` s for those in
        flight to finish, for ``QUIET_SECONDS`` without a call arriving, ending, or
        its reply leaving, and until ``unfetched()`` (the outputs replies handed out
        that their clients are still to fetch) is 0. Returns True when no call is left."""
        self.draining = True
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return self.in_flight == 0
            if self.in_flight:
                try:
                    await asyncio.wait_for(self._event().wait(), left)
                except TimeoutError:
                    return False
                continue
            quiet = time.monotonic() - self._last_activity
            if quiet < self.QUIET_SECONDS:
                await asyncio.sleep(min(self.QUIET_SECONDS - quiet, left))
            elif unfetched is not None and unfetched():
                await asyncio.sleep(min(self.UNFETCHED_POLL_SECONDS, left))
            else:
                return True

    def _event(self) -> asyncio.Event:
        if self._idle is None:
            self._idle = asyncio.Event()
            self._idle.set()
        return self._idle


def _reserve(limit: int | None) -> int:
    """How many of ``limit``'s last places only a principal with none may take: one
    in sixteen (16 of the default 256 calls), at least one, and none of a limit of 1."""
    if limit is None or limit < 2:
        return 0
    return max(1, limit // 16)
