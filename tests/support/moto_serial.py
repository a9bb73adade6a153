"""moto's S3 server with every request handled under one lock: ``python -m tests.support.moto_serial --port 0``.

moto 5.2.5's server (werkzeug, threaded) checks ``If-None-Match`` / ``If-Match`` and then stores the object in
two steps without a lock, so two concurrent conditional PUTs of the same key can both succeed. S3 itself
makes these writes atomic (LanceDB's commits and memproxy's lease and journal claims rely on it), so the tests
run moto with its requests serialised: the same server, the same S3 semantics, no race of its own.
"""

from __future__ import annotations

import argparse
import threading
from collections.abc import Callable, Iterable
from typing import Any

from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
from werkzeug.serving import make_server


class Serialised:
    """A WSGI app that runs one request at a time (bodies are materialised inside the lock)."""

    def __init__(self, app: Callable[..., Iterable[bytes]]) -> None:
        self._app = app
        self._lock = threading.Lock()

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        with self._lock:
            return list(self._app(environ, start_response))


def main() -> None:
    """Serve on 127.0.0.1 (port 0: any free port, printed like moto_server does)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    app = Serialised(DomainDispatcherApplication(create_backend_app))
    server = make_server("127.0.0.1", args.port, app, threaded=True, request_handler=MotoRequestHandler)
    print(f" * Running on http://127.0.0.1:{server.server_port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
