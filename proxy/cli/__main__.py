"""``python -m proxy.cli``: the ``memproxy`` command."""

from proxy.cli.commands import main

main()
