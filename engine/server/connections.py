"""Connection-level guards, below the ASGI app: a header timeout and a cap on open connections per
client address (uvicorn has neither: a socket that never sends, or sends its headers a byte at a
time, stays open for ever, and one address can open as many as it likes).

GuardedH11 is uvicorn's own h11 protocol plus two checks: a connection whose request line and
headers are not complete `header_timeout_s` after it opened (or after its last response) gets 408
and is closed; a connection beyond `max_per_address` open ones from the same address gets 429 and
is closed at once. Body timeouts are the ASGI side's (limits.BodySizeLimit), as the app reads it.
"""

from __future__ import annotations

import threading
from collections import Counter

from uvicorn.protocols.http.h11_impl import H11Protocol

from engine.server.limits import error_response


def _raw_response(status: int, reason: str, message: str, code: str) -> bytes:
    """A whole HTTP/1.1 response written straight to the socket (h11 cannot answer a request it has
    not parsed)."""
    headers, payload = error_response(status, message, code)
    head = [f"HTTP/1.1 {status} {reason}".encode()] + [k + b": " + v for k, v in headers]
    return b"\r\n".join(head) + b"\r\n\r\n" + payload


class ConnectionGuard:
    """Shared by every connection of one server: how many are open per address."""

    def __init__(self, header_timeout_s: float, max_per_address: int):
        self.header_timeout_s, self.max_per_address = header_timeout_s, max_per_address
        self.open: Counter[str] = Counter()
        self.refused = 0  # connections turned away by the cap
        self.timed_out = 0  # connections closed by the header timeout
        self._lock = threading.Lock()

    def protocol(self) -> type[H11Protocol]:
        guard = self

        class GuardedH11(H11Protocol):
            def connection_made(self, transport) -> None:
                super().connection_made(transport)
                self._address = self.client[0] if self.client else "?"
                self._timer = None
                with guard._lock:
                    guard.open[self._address] += 1
                    over = 0 < guard.max_per_address < guard.open[self._address]
                    guard.refused += over
                if over:
                    transport.write(_raw_response(429, "Too Many Requests",
                                                  f"more than {guard.max_per_address} open connections from "
                                                  f"{self._address}", "too_many_connections"))
                    transport.close()
                    return
                self._arm()

            def connection_lost(self, exc) -> None:
                if self._timer is not None:
                    self._timer.cancel()
                with guard._lock:
                    guard.open[self._address] -= 1
                    if guard.open[self._address] <= 0:
                        del guard.open[self._address]
                super().connection_lost(exc)

            def on_response_complete(self) -> None:
                super().on_response_complete()
                self._arm()  # the next request's headers get the same time

            def _arm(self) -> None:
                if self._timer is not None:
                    self._timer.cancel()
                if guard.header_timeout_s > 0:
                    self._timer = self.loop.call_later(guard.header_timeout_s, self._headers_late, self.cycle)

            def _headers_late(self, cycle_when_armed) -> None:
                self._timer = None
                if self.transport.is_closing():
                    return
                started = self.cycle is not cycle_when_armed or (self.cycle is not None
                                                                 and not self.cycle.response_complete)
                if started:  # a request's headers arrived since (its body has its own timeout)
                    return
                with guard._lock:
                    guard.timed_out += 1
                self.transport.write(_raw_response(408, "Request Timeout", "the request headers did not "
                                                   f"arrive within {guard.header_timeout_s:g} s", "request_timeout"))
                self.transport.close()

        return GuardedH11

    def stats(self) -> dict:
        with self._lock:
            return {"open": sum(self.open.values()), "addresses": len(self.open), "refused": self.refused,
                    "header_timeouts": self.timed_out}
