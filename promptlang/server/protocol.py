"""The HTTP/1.1 protocol `serve` runs: uvicorn's h11 protocol, with a deadline on each request's
line and headers.

uvicorn closes an idle keep-alive connection (`timeout_keep_alive`) but arms no timer while
a request's headers arrive: a client that sends one header byte at a time holds its
connection, and one of the `limit_concurrency` slots, for ever. Here each connection gets
`header_timeout` seconds from its opening -- and from the end of each response on a
keep-alive connection -- to finish the next request's line and headers; past that it is
answered 408 and closed. The body has a deadline of its own (the app's `body_timeout`).

The line and headers are also bounded in bytes (`h11_max_incomplete_event_size`, which
`serve` sets): h11 applies it only to headers still incomplete, so headers that arrive whole
in one read are measured here too, and past the bound answered 431 and closed. h11 rather
than httptools (uvicorn's "auto" where httptools is installed), which has no such bound.
"""

from __future__ import annotations

import asyncio
import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

HEADER_TIMEOUT_S = 10.0          # seconds a request's line and headers may take to arrive
H11_DEFAULT_BOUND = 16 << 10     # h11's own bound where uvicorn is given none


def with_header_timeout(seconds: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a `seconds` deadline on each request's headers (uvicorn
    takes the class as `http=`)."""
    if not seconds > 0:
        raise ValueError(f"header timeout must be > 0 seconds, not {seconds!r}")
    return type("HeaderDeadlineProtocol", (HeaderDeadlineProtocol,), {"header_timeout": seconds})


class HeaderDeadlineProtocol(H11Protocol):
    header_timeout = HEADER_TIMEOUT_S
    _deadline: asyncio.TimerHandle | None = None
    _head = b""                      # the current request's bytes so far, while in its headers

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        bound = config.h11_max_incomplete_event_size
        self.max_header_bytes = H11_DEFAULT_BOUND if bound is None else bound

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE and self._too_long(data):
            self._refuse(431, "Request Header Fields Too Large", f"the request's line and "
                         f"headers pass {self.max_header_bytes:,} bytes")
            return
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:          # the headers are in
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._arm()                                    # the next request's headers

    def _too_long(self, data: bytes) -> bool:
        """Whether the headers `data` continues pass the byte bound (or end past it)."""
        limit = self.max_header_bytes
        head = self._head + data[:limit + 4]
        end = head.find(b"\r\n\r\n")
        self._head = b"" if end >= 0 else head[-(limit + 4):]
        return end > limit or (end < 0 and len(head) > limit)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.header_timeout, self._late)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _late(self) -> None:
        """The deadline passed with the headers incomplete: 408, then close."""
        self._deadline = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        self._refuse(408, "Request Timeout", f"the request's headers did not arrive within "
                                             f"{self.header_timeout:g} s")

    def _refuse(self, status: int, reason: str, message: str) -> None:
        """An OpenAI-style error `status`, then close (the request never reached the app)."""
        self._disarm()
        body = json.dumps({"error": {"message": message, "type": "invalid_request_error",
                                     "param": None, "code": None}}).encode()
        head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode()
        self.transport.write(head + body)
        self.transport.close()
