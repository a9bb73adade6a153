"""The request as the client sent it.

The access checks hand the handlers a copy of a chat request without the client's key (it is never sent
upstream); what another chat process is handed or relayed (``chat_handoff``, ``chat_routing``) is the request as
it came, key included, for that process checks it again.
"""

from __future__ import annotations

from aiohttp import web

AS_SENT: web.RequestKey[web.Request] = web.RequestKey("memproxy_as_sent", web.Request)


def as_sent(request: web.Request) -> web.Request:
    """The request with the headers the client sent (the handlers' copy lacks its key)."""
    sent: web.Request = request.get(AS_SENT, request)
    return sent
