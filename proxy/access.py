"""Who may use the proxy: client keys and their namespaces, browser origins, served Host names, open relays.

- **Client keys** (``[[clients]]``): each entry holds the SHA-256 of a key (never the key) and a namespace.
  With at least one entry, every API path (chat completions, Responses, Messages, ``/v1/models`` and every
  relayed ``/v1`` path) needs ``Authorization: Bearer <client key>`` (on Anthropic's paths ``x-api-key`` too)
  (no key or a wrong one: 401 in OpenAI's error shape), the key is never passed upstream, and every user id
  of the request is scoped to the key's namespace (``appA:alice``), so apps sharing a proxy cannot read each
  other's users.
- **Browsers** (``server.allowed_origins``): the memory paths accept only ``Content-Type: application/json``
  (a no-preflight ``text/plain`` or form POST is a 415), and a request carrying an ``Origin`` that is not
  allowed is a 403. Allowed origins get CORS answers (preflight included).
- **Host pinning** (``server.allowed_hosts``): when set, a request whose ``Host`` is not listed is a 421
  (DNS rebinding), except the liveness and readiness probes.
- **Open relay** (``server.open``): bound to a non-loopback address while holding an upstream key and with no
  client keys, ``memproxy serve`` refuses to start (exit 2) unless ``server.open = true``
  (``open_relay_problem``).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from collections.abc import Awaitable, Callable, Sequence

from aiohttp import web

from proxy.as_sent import AS_SENT
from proxy.config import ClientSettings, Settings
from proxy.errors import Forbidden, MisdirectedRequest, Unauthorized, UnsupportedMediaType
from proxy.identity import Identity
from proxy.paths import ANTHROPIC_PREFIXES, MEMORY_PATHS, is_api
from proxy.state import STATE

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
NAMESPACE: web.RequestKey[str] = web.RequestKey("memproxy_namespace", str)
PROBE_PATHS = frozenset({"/healthz", "/readyz"})
EXPOSED_HEADERS = ("X-Memory-Mode, X-Memory-Injected, X-Memory-Ids, X-Memory-Arms, X-Memory-Retrieval-Ms, "
                   "X-Request-Id, X-Upstream-Request-Id")  # fmt: skip


def key_hash(key: str) -> str:
    """The SHA-256 hex digest of a client key, as ``[[clients]] key_sha256`` holds it."""
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()


def client_for(
    clients: Sequence[ClientSettings], authorization: str | None, api_key: str | None = None
) -> ClientSettings | None:
    """The client whose key ``authorization`` (``Bearer <key>``) or, failing that, ``api_key`` (Anthropic's
    ``x-api-key``) carries, compared in constant time against every entry."""
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        given = api_key or ""
        if not given.strip():
            return None
    digest = key_hash(given.strip()).encode()
    found = None
    for client in clients:
        if hmac.compare_digest(digest, client.key_sha256.encode()):
            found = client
    return found


def scoped(identity: Identity, namespace: str | None) -> Identity:
    """``identity`` with its user id inside ``namespace`` (unchanged without one)."""
    if namespace is None or identity.user_id is None:
        return identity
    return Identity(f"{namespace}:{identity.user_id}", identity.conversation_id, identity.mode)


def is_loopback(host: str) -> bool:
    """Whether a listen address only accepts connections from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def holds_upstream_key(settings: Settings) -> bool:
    """Whether memproxy holds a key of its own for some upstream (which anyone reaching it would spend)."""
    keys = [settings.upstream.api_key, settings.upstream.anthropic_api_key, settings.memory_llm.api_key,
            settings.embedder.api_key,
            settings.rerank.api_key, *(r.api_key for r in settings.routes)]  # fmt: skip
    return any(key is not None and key.get_secret_value() for key in keys)


def open_relay_problem(settings: Settings) -> str | None:
    """Why ``settings`` would serve an open relay, naming the fix; None when they do not."""
    server = settings.server
    if server.open or settings.clients or is_loopback(server.host) or not holds_upstream_key(settings):
        return None
    return (
        f"config error: server.host: {server.host} is reachable from other machines and memproxy holds an "
        "upstream key, but no [[clients]] keys are configured: anyone reaching the port could spend the key "
        "and read any user's memories. Add a [[clients]] entry (namespace, key_sha256), bind to 127.0.0.1, "
        "or set server.open = true (MEMPROXY_SERVER__OPEN=true) if something in front already authenticates"
    )


def host_allowed(host: str, allowed: Sequence[str]) -> bool:
    """Whether a ``Host`` header value (name, optional port) is one of ``allowed`` (names or name:port)."""
    host = host.strip().lower()
    name = host.rsplit(":", 1)[0] if ":" in host.rsplit("]", 1)[-1] else host  # [::1]:8080 -> [::1]
    return host in allowed or name in allowed


def _check_origin(request: web.Request, origins: Sequence[str]) -> None:
    origin = request.headers.get("Origin")
    if origin is not None and origin not in origins:
        raise Forbidden(f"cross-origin request from {origin[:100]} refused: allow it in server.allowed_origins")


def _check_browser(request: web.Request, origins: Sequence[str]) -> None:
    _check_origin(request, origins)
    media = request.content_type if "Content-Type" in request.headers else ""
    if media != "application/json":
        raise UnsupportedMediaType(
            f"{request.path} accepts only Content-Type: application/json, not {media[:60] or 'none'!r}"
        )


def _cors(response: web.StreamResponse, origin: str) -> None:
    response.headers["Access-Control-Allow-Origin"] = origin
    response.headers["Access-Control-Expose-Headers"] = EXPOSED_HEADERS
    response.headers["Vary"] = "Origin"


async def _cors_on_prepare(request: web.Request, response: web.StreamResponse) -> None:
    """CORS headers on every answer of the keyed paths to an allowed origin (streams included)."""
    origin = request.headers.get("Origin")
    allowed = request.app[STATE].settings.server.allowed_origins
    if origin is not None and is_api(request.path) and origin in allowed:
        _cors(response, origin)


def _preflight(request: web.Request) -> web.Response:
    response = web.Response(status=204)
    _cors(response, request.headers["Origin"])
    response.headers["Access-Control-Allow-Methods"] = "POST, GET, OPTIONS"
    response.headers["Access-Control-Allow-Headers"] = request.headers.get(
        "Access-Control-Request-Headers", "authorization, content-type"
    )
    response.headers["Access-Control-Max-Age"] = "600"
    return response


def _authenticated(request: web.Request, settings: Settings) -> web.Request:
    """The request as the handlers see it: with the client's namespace, without its key (never sent on)."""
    anthropic = request.path.startswith(ANTHROPIC_PREFIXES)
    api_key = request.headers.get("x-api-key") if anthropic else None
    client = client_for(settings.clients, request.headers.get("Authorization"), api_key)
    if client is None:
        raise Unauthorized(
            "missing or wrong client key: send the header Authorization: Bearer <client key>"
            + (" (or x-api-key: <client key>)" if anthropic else "")
        )
    headers = request.headers.copy()
    headers.popall("Authorization", None)
    if anthropic:
        headers.popall("x-api-key", None)
    clone = request.clone(headers=headers)
    clone[NAMESPACE] = client.namespace
    clone[AS_SENT] = request
    return clone


@web.middleware
async def access_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Host pinning on every path; origin, media type and client key on the chat path (see the module doc)."""
    settings = request.app[STATE].settings
    server = settings.server
    host = request.headers.get("Host") or ""
    if server.allowed_hosts and request.path not in PROBE_PATHS and not host_allowed(host, server.allowed_hosts):
        raise MisdirectedRequest("this Host is not served here: list it in server.allowed_hosts")
    if not is_api(request.path):
        return await handler(request)
    origin = request.headers.get("Origin")
    if request.method == "OPTIONS" and origin is not None and origin in server.allowed_origins:
        return _preflight(request)
    if request.path in MEMORY_PATHS and request.method == "POST":
        _check_browser(request, server.allowed_origins)
    else:
        _check_origin(request, server.allowed_origins)
    if settings.clients:
        request = _authenticated(request, settings)
    return await handler(request)


def install_access(app: web.Application) -> None:
    """Add the access checks to ``app``: right after the error middleware (refusals are OpenAI error JSON) and
    before anything that reads the body (a refused request is never read; a read request cannot be cloned)."""
    app.middlewares.insert(1, access_middleware)
    app.on_response_prepare.append(_cors_on_prepare)
