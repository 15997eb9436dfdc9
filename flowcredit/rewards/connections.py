"""The reward server's connections: admission per client address, and bounds on each request head.

uvicorn's httptools protocol bounds neither the size nor the number of header lines (an endless head
grew one server by 2.8 GB in 9 s), and its ``limit_concurrency`` answers 503 to *every* request once
that many connections are open, even on connections opened long before, so one client opening
silent connections shut everyone out. :func:`guarded_protocol` subclasses it and adds:

- a deadline for each request head (``header_timeout_s``, from opening or from the last answer);
- a bound on each head, ``max_header_bytes`` and ``max_headers`` lines: past either, the answer is
  431 and the connection is closed, so a head costs at most the bound plus one read (256 KiB);
- admission when a connection opens (:class:`Admission`): per client address at most
  ``max_client_connections`` open and ``max_client_connects_per_s`` new ones a second, and
  ``max_connections`` open in all. Requests on connections already admitted are never refused for
  the count. Addresses are the socket's peer (behind a proxy: the proxy; see docs/rewards.md).
"""

from __future__ import annotations

import json
import time

REFUSED = (
    b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%sconnection: close\r\n\r\n"
)
_REASONS = {431: b"Request Header Fields Too Large", 503: b"Service Unavailable"}


class HeadTooLarge(Exception):
    """A request head over ``max_header_bytes`` or ``max_headers`` (answered 431)."""


def refusal(status: int, message: str) -> bytes:
    """A complete HTTP answer ``{"error": message}`` that closes the connection."""
    body = json.dumps({"error": message}).encode()
    retry = b"retry-after: 1\r\n" if status == 503 else b""
    return REFUSED % (status, _REASONS[status], len(body), retry) + body


class Admission:
    """Open connections per client address and in all, and a token bucket of new connections per
    address. When an address (or the server) is at its cap, its connection that has waited longest
    for a request head (silent, or sending its head) is closed to make room: a flood of silent
    connections displaces only itself, and a client that sends its request at once gets in. With
    none waiting, or past the address's rate, the new connection is refused (503, closed)."""

    def __init__(self, limits, clock=time.monotonic):
        self.limits, self.clock = limits, clock
        self.open: dict[str, set] = {}  # address → its admitted connections (protocol objects)
        self.total = 0
        self._buckets: dict[str, tuple[float, float]] = {}  # address → (tokens, when)

    def admit(self, conn, address: str) -> str | None:
        """Admit ``conn`` (with ``silent_since`` and ``evict()``); the reason it is refused, else None."""
        if not self._take_token(address):
            return f"over max_client_connects_per_s={self.limits.max_client_connects_per_s} from this address"
        mine = self.open.get(address, set())
        if len(mine) >= self.limits.max_client_connections and not self._evict(mine):
            return f"this address has max_client_connections={self.limits.max_client_connections} busy"
        if self.total >= self.limits.max_connections and not self._evict(
            c for conns in self.open.values() for c in conns
        ):
            return f"max_connections={self.limits.max_connections} busy"
        self.open.setdefault(address, set()).add(conn)
        self.total += 1
        return None

    def release(self, conn, address: str) -> None:
        """Forget ``conn`` (closed, or evicted); idempotent."""
        mine = self.open.get(address)
        if mine is not None and conn in mine:
            mine.discard(conn)
            self.total -= 1
            if not mine:
                del self.open[address]

    def _evict(self, conns) -> bool:
        waiting = [c for c in conns if c.silent_since is not None]
        if not waiting:
            return False
        min(waiting, key=lambda c: c.silent_since).evict()
        return True

    def _take_token(self, address: str) -> bool:
        rate, now = self.limits.max_client_connects_per_s, self.clock()
        tokens, when = self._buckets.get(address, (rate, now))
        tokens = min(rate, tokens + (now - when) * rate)
        if len(self._buckets) > 4 * self.limits.max_connections:  # forget addresses gone quiet
            self._buckets = {a: b for a, b in self._buckets.items() if a in self.open}
        if tokens < 1:
            self._buckets[address] = (tokens, now)
            return False
        self._buckets[address] = (tokens - 1, now)
        return True


def guarded_protocol(limits, admission: Admission):
    """uvicorn's httptools protocol with the head deadline, head bounds and admission above."""
    import httptools
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class GuardedProtocol(HttpToolsProtocol):
        _head_timer = None
        silent_since: float | None = None  # when it began waiting for a request head; None: in a request
        _address: str | None = None
        _in_head = True  # bytes received now belong to a request head
        _raw = 0  # bytes received since the current head began
        _lines = _size = 0  # header lines and bytes of the current head, as parsed

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._address = self.client[0] if self.client else "?"
            self._wait_for_head()
            refused = admission.admit(self, self._address)
            if refused is not None:
                self._address = None  # never admitted: nothing to release
                self._refuse(503, f"connection refused: {refused}; retry later")

        def connection_lost(self, exc) -> None:
            self._disarm()
            if self._address is not None:
                admission.release(self, self._address)
            super().connection_lost(exc)

        def evict(self) -> None:
            """Closed to make room for a new connection (see :class:`Admission`)."""
            admission.release(self, self._address)
            self._address = None
            self.transport.close()

        def data_received(self, data: bytes) -> None:
            if self.transport.is_closing():
                return
            self._unset_keepalive_if_required()
            if self._in_head:
                self._raw += len(data)
            try:
                self.parser.feed_data(data)
            except httptools.HttpParserCallbackError as exc:
                if isinstance(exc.__context__, HeadTooLarge):
                    return self._refuse(431, str(exc.__context__))
                self._bad_request()
            except httptools.HttpParserUpgrade:
                self._unsupported_upgrade_warning()
            except httptools.HttpParserError:
                self._bad_request()
            if self._in_head and self._raw > limits.max_header_bytes and not self.transport.is_closing():
                self._refuse(431, f"request head over max_header_bytes={limits.max_header_bytes}")

        def on_message_begin(self) -> None:
            self._lines = self._size = 0
            super().on_message_begin()

        def on_url(self, url: bytes) -> None:
            self._count(len(url), 0)
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._count(len(name) + len(value) + 4, 1)
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._disarm()
            self.silent_since, self._in_head = None, False
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._raw, self._in_head = 0, True  # what follows is the next request's head
            super().on_message_complete()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and not self.pipeline:  # waiting for the next request
                self._wait_for_head()

        def _count(self, size: int, lines: int) -> None:
            self._size, self._lines = self._size + size, self._lines + lines
            if self._lines > limits.max_headers:
                raise HeadTooLarge(f"request head of over max_headers={limits.max_headers} lines")
            if self._size > limits.max_header_bytes:
                raise HeadTooLarge(f"request head over max_header_bytes={limits.max_header_bytes}")

        def _wait_for_head(self) -> None:
            self.silent_since = self.loop.time()
            self._disarm()
            self._head_timer = self.loop.call_later(limits.header_timeout_s, self._expire)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _expire(self) -> None:
            if not self.transport.is_closing():
                self.transport.close()

        def _refuse(self, status: int, message: str) -> None:
            """Answer ``status`` (unless an answer is under way) and close the connection."""
            if self.cycle is None or self.cycle.response_complete:
                self.transport.write(refusal(status, message))
            self.transport.close()

        def _bad_request(self) -> None:
            self.logger.warning("Invalid HTTP request received.")
            self.send_400_response("Invalid HTTP request received.")

    return GuardedProtocol
