"""What a valid user id and record id are: the one rule, checked by the store on every read, write and delete.

An id the store holds is 1-512 UTF-8 bytes without control characters (Unicode categories Cc and Cs): any
text a caller may know a user by, quoted into every filter by ``filters.sql_string``.
"""

from __future__ import annotations

import re

from proxy.memory.errors import InvalidUserId

MAX_ID_BYTES = 512
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")  # Unicode categories Cc and Cs


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
