"""The web page at ``/ui/``: three static files (``proxy/web/``) served with a strict same-origin content policy.

The page itself calls the management API with the admin key the user types in; serving it needs no key.
"""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

from proxy.errors import NotFound
from proxy.management.shared import Handler

WEB_DIR = Path(__file__).resolve().parent / "web"
WEB_FILES = {"app.js": "application/javascript", "style.css": "text/css"}
WEB_HEADERS = {
    "Cache-Control": "no-cache",
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


async def ui_redirect(request: web.Request) -> web.StreamResponse:
    """``GET /ui``: to ``/ui/``."""
    raise web.HTTPPermanentRedirect("/ui/")


def _ui_handler(web_dir: Path) -> Handler:
    files = {name: (web_dir / name).read_bytes() for name in ("index.html", *WEB_FILES)}

    async def ui_file(request: web.Request) -> web.Response:
        """``GET /ui/`` and its two assets; nothing else under ``/ui/`` exists."""
        name = request.match_info.get("name") or "index.html"
        if name not in files:
            raise NotFound("no such file")
        return web.Response(
            body=files[name], content_type=WEB_FILES.get(name, "text/html"), charset="utf-8", headers=WEB_HEADERS
        )

    return ui_file


def add_ui_routes(app: web.Application) -> None:
    """Register the web page: ``/ui`` (a redirect), ``/ui/`` and its assets."""
    ui_file = _ui_handler(WEB_DIR)
    app.router.add_get("/ui", ui_redirect)
    app.router.add_get("/ui/", ui_file)
    app.router.add_get("/ui/{name}", ui_file)
