"""Making a data directory read-only for real, also as root (for whom permission bits mean nothing).

As root the immutable attribute (``chattr -R +i``) is used: like a file system remounted read-only after
errors, it refuses new files and also writes through files that are already open. Otherwise the write
permission bits are removed (new files are refused; files already open stay writable).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path


def set_read_only(path: Path, read_only: bool) -> None:
    """Make ``path`` and everything under it read-only, or writable again."""
    if os.geteuid() == 0:
        subprocess.run(["chattr", "-R", "+i" if read_only else "-i", str(path)], check=True)
        return
    for root, dirs, files in os.walk(path):
        for name in [*dirs, *files, ""]:
            target = Path(root, name)
            mode = target.stat().st_mode
            target.chmod(mode & ~0o222 if read_only else mode | 0o200)


@contextlib.contextmanager
def read_only(path: Path) -> Iterator[None]:
    """``path`` read-only inside the block, writable again after it (also when the block fails)."""
    set_read_only(path, True)
    try:
        yield
    finally:
        set_read_only(path, False)
