"""The bounds on what one request may cost the server, checked before any work is queued.

- sequences: a request runs `prompts x n` engine sequences; `--max-prompts-per-request` caps its
  prompts (400), and the queue (`--max-queue`) counts sequences, not requests (503 while full,
  400 for a request that could never fit);
- preparation: chat-template rendering, tokenization and grammar compilation run on worker
  threads (`off_loop`), never on the event loop, and answer 400 when they take longer than
  `--prepare-timeout`;
- logs: each ignored request-field name is logged once, up to `MAX_LOGGED_FIELD_NAMES` names;
  after that only a count per request (`FieldWarnings`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable, Iterable
from typing import TypeVar

from llmopt.serve.protocol import RequestError

logger = logging.getLogger("llmopt.serve")
T = TypeVar("T")

# distinct ignored field names logged one by one; a client sending thousands of made-up names
# then costs one log line per request, not one per name
MAX_LOGGED_FIELD_NAMES = 100
# threads preparing requests: enough that one slow preparation does not hold up the others, few
# enough that preparations cannot crowd out the engine thread on a small machine
PREPARE_WORKERS = 4


def check_request_size(num_prompts: int, n: int, max_prompts: int, max_queue: int) -> None:
    """Refuse (400) a request with more prompts than `max_prompts`, or more sequences
    (`num_prompts * n`) than the queue could ever hold."""
    if num_prompts > max_prompts:
        raise RequestError(f"the request has {num_prompts} prompts; this server takes at most {max_prompts} per "
                           "request (--max-prompts-per-request)", param="prompt", code="too_many_prompts")
    sequences = num_prompts * n
    if sequences > max_queue:
        raise RequestError(f"the request asks for {sequences} sequences ({num_prompts} prompt(s) x n {n}); the queue "
                           f"holds at most {max_queue} (--max-queue)", param="n", code="too_many_sequences")


def check_queue_room(sequences: int, waiting: int, max_queue: int) -> None:
    """503 (retry later) when `sequences` more would overfill the queue of waiting sequences."""
    if waiting + sequences > max_queue:
        raise RequestError(f"the server is at capacity ({waiting} sequences waiting, the queue holds {max_queue}; "
                           f"this request needs room for {sequences}); retry shortly", 503, type_="server_busy")


class Preparer:
    """Runs request preparation (tokenization, template rendering, grammar compilation) on its own
    worker threads, each call bounded in time.

    A thread cannot be stopped: a preparation that times out is answered with a 400 at once and
    finishes in the background; the size caps (body, messages, prompts) keep that finite. The
    pool lives as long as the app (an app may be started and stopped several times, as tests
    do); idle workers end with the interpreter."""

    def __init__(self, timeout: float, workers: int = PREPARE_WORKERS):
        self.timeout = timeout
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="llmopt-prepare")

    async def run(self, fn: Callable[[], T], what: str) -> T:
        """`fn()` on a worker thread; RequestError (400) if it takes over `timeout` seconds (waiting
        for a free worker included)."""
        future = asyncio.wrap_future(self._pool.submit(fn))
        try:
            return await asyncio.wait_for(future, self.timeout)
        except asyncio.TimeoutError:
            raise RequestError(f"{what} took longer than {self.timeout:g} s (--prepare-timeout); make the request "
                               "smaller or simpler", code="prepare_timeout") from None


class FieldWarnings:
    """One warning per ignored field name, for the first `limit` distinct names; afterwards one line
    per request with a count. Thread-safe (requests are checked on worker threads)."""

    def __init__(self, limit: int = MAX_LOGGED_FIELD_NAMES):
        self.limit = limit
        self.logged: set[str] = set()
        self._lock = threading.Lock()

    def note(self, names: Iterable[str]) -> None:
        fresh, unlogged = [], 0
        with self._lock:
            for name in names:
                if name in self.logged:
                    continue
                if len(self.logged) < self.limit:
                    self.logged.add(name)
                    fresh.append(name)
                else:
                    unlogged += 1
        for name in fresh:
            logger.warning("ignoring request field %r: llmopt serve does not use it (logged once per name)", name)
        if unlogged:
            logger.warning("ignoring %d more request field(s) llmopt serve does not use (names are no longer logged: "
                           "%d distinct names seen)", unlogged, self.limit)
