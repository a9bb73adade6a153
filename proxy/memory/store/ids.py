"""What a valid user id is: the one rule, enforced by the store on every read, write and delete.

A user id is 1-512 UTF-8 bytes without control characters (Unicode categories Cc and Cs). Every filter of
the table is built through ``filters.record_filter``, which checks it (``check_user_id``), so no read or
delete runs for an id outside the rule. Record ids follow the same rule (``valid_record_id``).

Apps name users (and conversations) within it more strictly: ``valid_app_id`` accepts 1-128 characters of
letters, digits and ``. _ @ : + - = / | ~`` (``APP_ID_RULE``, the HTTP edge's message), ids that need no
quoting in a URL path, a header or a log line. Every such id, also prefixed by a client's namespace
(``appA:alice``), is within the store's rule.
"""

from __future__ import annotations

import re

from proxy.memory.errors import InvalidUserId

MAX_ID_BYTES = 512
APP_ID_RULE = "1-128 characters of letters, digits and . _ @ : + - = / | ~"
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")  # Unicode categories Cc and Cs
_APP_ID = re.compile(r"[A-Za-z0-9._@:+\-=/|~]{1,128}")


def check_user_id(user_id: str) -> str:
    """``user_id`` if the store accepts it: 1-512 UTF-8 bytes, no control characters."""
    if not isinstance(user_id, str) or not user_id:
        raise InvalidUserId("user id must be a non-empty string")
    if len(user_id.encode("utf-8", "surrogatepass")) > MAX_ID_BYTES:
        raise InvalidUserId(f"user id is longer than {MAX_ID_BYTES} bytes")
    if _CONTROL.search(user_id):
        raise InvalidUserId("user id contains control characters")
    return user_id


def valid_record_id(record_id: str) -> bool:
    """Whether ``record_id`` can name a record (same rules as user ids)."""
    try:
        check_user_id(record_id)
    except InvalidUserId:
        return False
    return True


def valid_app_id(value: object) -> bool:
    """Whether an app may name a user or conversation ``value`` (``APP_ID_RULE``: a subset of the store's rule)."""
    return isinstance(value, str) and _APP_ID.fullmatch(value) is not None
