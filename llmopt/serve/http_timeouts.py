"""A header-read timeout for uvicorn's HTTP protocols.

uvicorn bounds the idle time between requests (`timeout_keep_alive`) but not the time a client
takes to send a request's headers: every received byte cancels the keep-alive timer, so a client
trickling a byte every few seconds (slowloris) holds its connection for as long as it likes.
`with_header_timeout` subclasses the protocol uvicorn would use (httptools', or h11's) and closes
a connection whose next request's headers are not complete `timeout` seconds after it opened or
after its previous response, as Go's `ReadHeaderTimeout` and nginx's `client_header_timeout` do.
The body's own deadline is the ASGI guard's (`llmopt.serve.disconnect.read_body`).
"""

from __future__ import annotations

import asyncio
from typing import Any


def with_header_timeout(protocol: type[asyncio.Protocol], timeout: float) -> type[asyncio.Protocol]:
    """`protocol` (uvicorn's `H11Protocol` or `HttpToolsProtocol`) with the header-read timeout."""

    class HeaderTimeoutProtocol(protocol):  # type: ignore[misc, valid-type]
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm_header_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_header_timer()  # keep-alive: the next request's headers get the same time

        def connection_lost(self, exc: Exception | None) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            super().connection_lost(exc)

        def _arm_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            self._header_timer = self.loop.call_later(timeout, self._headers_late, self.cycle)

        def _headers_late(self, cycle_then: Any) -> None:
            # still waiting for headers: no request began since the timer was armed, and the one
            # then current (if any) was answered
            waiting = self.cycle is cycle_then and (cycle_then is None or cycle_then.response_complete)
            if waiting and not self.transport.is_closing():
                self.transport.close()

    HeaderTimeoutProtocol.__name__ = f"HeaderTimeout{protocol.__name__}"
    return HeaderTimeoutProtocol


def uvicorn_protocol(timeout: float) -> type[asyncio.Protocol]:
    """The HTTP protocol uvicorn picks by default ("auto": httptools if installed, else h11) with
    the header-read timeout."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    return with_header_timeout(AutoHTTPProtocol, timeout)
