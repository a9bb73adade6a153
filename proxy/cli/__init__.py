"""The ``memproxy`` command line (``main``, the console script's entry point).

- ``commands``: the parser and the dispatch; ``serve`` runs the proxy.
- ``memory``: ``memproxy memories ...`` and ``memproxy insights ...`` (the management API from a terminal).
- ``ops``: the operator commands' parsers; ``store``: those that open the configuration or the data directory.
"""

from proxy.cli.commands import main

__all__ = ["main"]
