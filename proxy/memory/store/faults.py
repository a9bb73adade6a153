"""Faults of our own disk: how to recognise one, and how to report it once per change of state.

A *storage fault* is an error of the data directory's file system (read-only, full, over quota, no permission,
I/O error), as opposed to a bug, a bad input or a dependency that is down. It is nobody's mistake in the job
that hit it, so jobs hit by one wait and retry without spending an attempt (never dead-lettered for it), and
the chat goes on (without memory if it must, saying so). The libraries report it in their own ways: ``OSError``
with an errno, SQLite's ``OperationalError("attempt to write a readonly database")``, Lance's
``RuntimeError("lance error: LanceError(IO): Operation not permitted (os error 1) ...")``, Tantivy's
``ValueError`` with the OS message; ``is_storage_fault`` knows them all.

``StorageHealth`` is the one place that remembers whether the disk is failing right now: components report
every fault and every success, and it logs one ``storage.fault`` line when the state turns bad and one
``storage.recovered`` line when it turns good again (instead of a traceback per attempt).
"""

from __future__ import annotations

import errno
import re
import sqlite3
import time

import structlog

log = structlog.get_logger("memproxy.storage")

FAULT_ERRNOS = frozenset({errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EIO, errno.EFBIG})
_OS_ERROR = re.compile(r"os error (\d+)")
_PHRASES = re.compile(
    r"read-only file system|readonly database|no space left|database or disk is full|disk quota"
    r"|permission denied|operation not permitted|input/output error|disk i/o error|file too large"
    r"|unable to open database file",
    re.IGNORECASE,
)
_MESSAGE_TYPES = (OSError, sqlite3.Error, RuntimeError, ValueError)  # where libraries put OS messages


def _is_fault(error: BaseException) -> bool:
    if isinstance(error, OSError) and error.errno is not None:
        return error.errno in FAULT_ERRNOS
    if not isinstance(error, _MESSAGE_TYPES):
        return False
    text = str(error)
    code = _OS_ERROR.search(text)
    if code is not None:
        return int(code.group(1)) in FAULT_ERRNOS
    return _PHRASES.search(text) is not None


def is_storage_fault(error: BaseException) -> bool:
    """Whether ``error`` (or an error it was raised from) is a fault of the local file system."""
    seen = 0
    current: BaseException | None = error
    while current is not None and seen < 8:
        if _is_fault(current):
            return True
        current = current.__cause__ or current.__context__
        seen += 1
    return False


def fault_reason(error: BaseException) -> str:
    """A short, key-free description of a storage fault for headers and logs (errno name when known)."""
    current: BaseException | None = error
    while current is not None:
        if isinstance(current, OSError) and current.errno in FAULT_ERRNOS:
            return errno.errorcode[current.errno]
        code = _OS_ERROR.search(str(current)) if isinstance(current, _MESSAGE_TYPES) else None
        if code is not None and int(code.group(1)) in errno.errorcode:
            return errno.errorcode[int(code.group(1))]
        current = current.__cause__ or current.__context__
    match = _PHRASES.search(str(error))
    return re.sub(r"[^a-z0-9]+", "_", match.group(0).lower()) if match else type(error).__name__


class StorageHealth:
    """Whether the data directory is failing now, per component; logs only when that changes."""

    def __init__(self) -> None:
        self._faults: dict[str, tuple[str, float]] = {}  # component -> (reason, since)
        self.faults_total = 0

    @property
    def reason(self) -> str | None:
        """None when every component can write; else the first failing one's ``component:reason``."""
        if not self._faults:
            return None
        component, (reason, _) = next(iter(self._faults.items()))
        return f"{component}:{reason}"

    def failing(self, component: str) -> bool:
        """Whether ``component`` is failing now."""
        return component in self._faults

    def fault(self, component: str, error: BaseException) -> None:
        """``component`` hit a storage fault (logged once until it recovers)."""
        self.faults_total += 1
        if component in self._faults:
            return
        reason = fault_reason(error)
        self._faults[component] = (reason, time.monotonic())
        log.error("storage.fault", component=component, reason=reason, detail=str(error)[:200])

    def ok(self, component: str) -> None:
        """``component`` wrote successfully (logs the recovery if it was failing)."""
        entry = self._faults.pop(component, None)
        if entry is not None:
            log.warning(
                "storage.recovered", component=component, reason=entry[0], after_s=round(time.monotonic() - entry[1], 1)
            )
