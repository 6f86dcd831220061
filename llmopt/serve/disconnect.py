"""A POST request's body read within a deadline, then its handling cancelled if the client goes away.

vLLM wraps each route in `with_cancellation`: the handler runs as a task next to one that waits
for `http.disconnect`, and the first to finish cancels the other. Here the same happens once, in
the ASGI guard, for every POST route: a cancelled handler closes its output streams, which
aborts its engine requests, for whole JSON answers as for server-sent events.
"""

from __future__ import annotations

import asyncio

from starlette.types import ASGIApp, Message, Receive, Scope, Send


class BodyTimeout(Exception):
    """The client did not send its whole body in time."""


class BodyTooLarge(Exception):
    """The body went over the size limit while it was read."""


async def read_body(receive: Receive, limit: int, timeout: float) -> bytes | None:
    """The whole request body, or None if the client went away first. BodyTooLarge past `limit`
    bytes, BodyTimeout if it is not complete within `timeout` seconds (a slow-upload client
    would otherwise hold the connection and its handler for as long as it likes)."""

    async def read() -> bytes | None:
        parts: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return None
            parts.append(message.get("body", b""))
            size += len(parts[-1])
            if size > limit:
                raise BodyTooLarge
            if not message.get("more_body", False):
                return b"".join(parts)

    try:
        return await asyncio.wait_for(read(), timeout)
    except asyncio.TimeoutError:
        raise BodyTimeout from None


async def run_until_disconnect(app: ASGIApp, scope: Scope, body: bytes, receive: Receive, send: Send) -> None:
    """Run `app` on a request whose `body` was read already; cancel it if the client disconnects
    before the response is complete."""
    disconnected = asyncio.Event()
    body_given = False
    complete = False

    async def app_receive() -> Message:
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": body, "more_body": False}
        await disconnected.wait()  # what Starlette's streaming response listens for
        return {"type": "http.disconnect"}

    async def app_send(message: Message) -> None:
        nonlocal complete
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            complete = True  # before sending: the server reports a disconnect once the response is out
        await send(message)

    async def watch() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        disconnected.set()

    handler = asyncio.create_task(app(scope, app_receive, app_send))
    watcher = asyncio.create_task(watch())
    try:
        await asyncio.wait({handler, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not handler.done() and not complete:  # the client went away: stop working for it
            handler.cancel()
        await asyncio.wait({handler})
        if not handler.cancelled():
            handler.result()  # the handler's own exception, for the server's error handling
    finally:
        for task in (handler, watcher):
            task.cancel()
        await asyncio.gather(handler, watcher, return_exceptions=True)
