"""The real app served on 127.0.0.1 by its own event loop in a thread, for synchronous clients.

Schemathesis (``requests``) and Selenium block the calling thread, so the server cannot share the test's
loop. ``live_app`` builds the app with the real factory, serves it on a free port, yields the base URL and
stops it (running the app's cleanup) on exit.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from aiohttp import web

from proxy.app import build_app
from proxy.config import Settings, load_settings
from proxy.server import AppRunner


def admin_settings(**sections: Any) -> Settings:
    """Settings from nested override dicts only (no environment, no file)."""
    return load_settings(None, environ={}, overrides=sections)


async def _serve(settings: Settings, started: queue.Queue[Any], stop: asyncio.Event) -> None:
    runner = AppRunner(build_app(settings), handler_cancellation=True, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        started.put((asyncio.get_running_loop(), runner.addresses[0][1]))
        await stop.wait()
    finally:
        await runner.cleanup()


@contextmanager
def live_app(settings: Settings, timeout: float = 120.0) -> Iterator[str]:
    """Serve ``settings``' app in a thread; yields ``http://127.0.0.1:<port>``."""
    started: queue.Queue[Any] = queue.Queue()
    stop_box: list[asyncio.Event] = []

    def run() -> None:
        async def main() -> None:
            stop_box.append(asyncio.Event())
            await _serve(settings, started, stop_box[0])

        try:
            asyncio.run(main())
        except BaseException as exc:  # handed to the waiting test instead of dying silently in the thread
            started.put(exc)

    thread = threading.Thread(target=run, name="live-app", daemon=True)
    thread.start()
    item = started.get(timeout=timeout)
    if isinstance(item, BaseException):
        raise item
    loop, port = item
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        loop.call_soon_threadsafe(stop_box[0].set)
        thread.join(timeout)
