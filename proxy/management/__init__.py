"""The management API under ``/v1/memory`` and the operator routes beside it.

- ``memories``: the memory routes (see, correct, export, erase) and the web page's.
- ``operations``: bulk add and the job queue's dead letters.
- ``shared``: what every handler shares (the admin key, the user id in the path, bodies, answers, the audit line).
"""

from proxy.management.memories import OPENAPI_PATH, add_management_routes
from proxy.management.operations import add_operations_routes

__all__ = ["OPENAPI_PATH", "add_management_routes", "add_operations_routes"]
