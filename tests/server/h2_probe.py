"""A raw HTTP/2 client for what gRPC's own clients never send, or send in an order
the test cannot choose: a call whose request message is declared large and never
finished; a request stream half-closed and then cancelled (the ``h2`` library frames
them)."""

from __future__ import annotations

import socket
import struct
import time

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions


def _connect(port: int, wait: float) -> tuple[socket.socket, h2.connection.H2Connection]:
    sock = socket.create_connection(("127.0.0.1", port), timeout=wait)
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    return sock, conn


def _headers(port: int, method: str, metadata: tuple = ()) -> list[tuple[str, str]]:
    return [
        (":method", "POST"),
        (":scheme", "http"),
        (":authority", f"127.0.0.1:{port}"),
        (":path", f"/gradserve.v1.GradServe/{method}"),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
        *metadata,
    ]


def half_closed_then_cancelled(
    port: int, method: str, message: bytes, metadata: tuple = (), *, gap: float | None
) -> int | None:
    """Send one whole request ``message`` on a call of ``method`` and half-close the
    stream (END_STREAM), then cancel it ``gap`` seconds later (RST_STREAM CANCEL;
    None: never): what a server sees of a cancelled upload when the cancellation
    comes after the end of its request stream. Returns the grpc-status the server
    sent within 5 s, or None."""
    sock, conn = _connect(port, 5.0)
    try:
        conn.send_headers(1, _headers(port, method, metadata))
        conn.send_data(1, struct.pack(">BI", 0, len(message)) + message, end_stream=True)
        sock.sendall(conn.data_to_send())
        if gap is not None:
            time.sleep(gap)
            conn.reset_stream(1, error_code=h2.errors.ErrorCodes.CANCEL)
            sock.sendall(conn.data_to_send())
        return _status(sock, conn, time.monotonic() + 5.0)
    finally:
        sock.close()


def _status(sock: socket.socket, conn: h2.connection.H2Connection, deadline: float) -> int | None:
    """The grpc-status of stream 1 once the server sends it (None: the connection
    or the stream closed first, or ``deadline`` passed)."""
    sock.settimeout(0.1)
    while time.monotonic() < deadline:
        status = _receive_status(sock, conn)
        if status != _PENDING:
            return status
    return None


#: ``_receive_status``: nothing that ends the call yet.
_PENDING = -1


def _receive_status(sock: socket.socket, conn: h2.connection.H2Connection) -> int | None:
    """Send what ``conn`` has to send, read once: the grpc-status of stream 1 if it
    came, None if the connection or the stream closed, ``_PENDING`` otherwise."""
    sock.sendall(conn.data_to_send())
    try:
        data = sock.recv(1 << 16)
    except TimeoutError:
        return _PENDING
    if not data:
        return None
    for event in conn.receive_data(data):
        if isinstance(event, (h2.events.ResponseReceived, h2.events.TrailersReceived)):
            fields = {bytes(k): bytes(v) for k, v in event.headers}
            if b"grpc-status" in fields:
                return int(fields[b"grpc-status"])
        if isinstance(event, h2.events.StreamReset):
            return None
    return _PENDING


def unfinished_call(
    port: int,
    method: str,
    token: str | None,
    *,
    declared: int = 100 << 20,
    sent: int = 64 << 10,
    wait: float = 5.0,
) -> int | None:
    """Open a GradServe call of ``method`` on 127.0.0.1:``port``, send the first
    ``sent`` bytes of a message declared ``declared`` bytes long, and keep the call
    open. Returns the grpc-status the server ended it with within ``wait`` seconds,
    or None if it had not ended it by then."""
    sock, conn = _connect(port, wait)
    try:
        headers = _headers(port, method)
        if token is not None:
            headers.append(("authorization", f"Bearer {token}"))
        conn.send_headers(1, headers)
        body = struct.pack(">BI", 0, declared) + bytes(sent)  # gRPC's length prefix
        deadline = time.monotonic() + wait
        sock.settimeout(0.1)
        while time.monotonic() < deadline:
            window = min(conn.local_flow_control_window(1), conn.max_outbound_frame_size)
            if body and window > 0:
                try:
                    conn.send_data(1, body[:window])
                except h2.exceptions.StreamClosedError:  # the server ended the call
                    window = len(body)
                body = body[window:]
            status = _receive_status(sock, conn)
            if status != _PENDING:
                return status
        return None
    finally:
        sock.close()
