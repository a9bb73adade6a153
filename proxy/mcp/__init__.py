"""``/mcp``: memproxy as an MCP server, for agents and desktop assistants.

``server`` checks each HTTP request (origin, client key, user) and serves the SDK's transport; ``tools`` are
the tools it offers over the management seam; ``asgi_bridge`` serves an ASGI app from aiohttp. The app factory
needs only ``add_mcp_routes``.
"""

from __future__ import annotations

from proxy.mcp.server import add_mcp_routes

__all__ = ["add_mcp_routes"]
