"""The one rule for user ids: what the store holds, and the stricter form an app may send."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.memory.errors import InvalidUserId
from proxy.memory.store.ids import MAX_ID_BYTES, check_user_id, valid_app_id

APP_IDS = st.from_regex(r"[A-Za-z0-9._@:+\-=/|~]{1,128}", fullmatch=True)
NAMESPACES = st.from_regex(r"[A-Za-z0-9_-]{1,64}", fullmatch=True)  # config's [[clients]] namespace pattern


@given(user=APP_IDS, namespace=NAMESPACES)
def test_every_id_an_app_may_send_is_storable_also_inside_a_namespace(user: str, namespace: str) -> None:
    """An id the HTTP edge accepts, alone or scoped to a client's namespace, is one the store holds."""
    assert valid_app_id(user)
    assert check_user_id(user) == user
    assert check_user_id(f"{namespace}:{user}") == f"{namespace}:{user}"


@pytest.mark.parametrize("user", ["alice", "a.b_c@d:e+f-g=h/i|j~k", "x" * 128])
def test_app_ids_of_safe_characters_are_accepted(user: str) -> None:
    """1-128 letters, digits and . _ @ : + - = / | ~ are accepted from apps."""
    assert valid_app_id(user)


@pytest.mark.parametrize("user", ["", "x" * 129, "has space", "quote'd", "semi;colon", "%00", "é", None, 7])
def test_other_app_ids_are_refused(user: object) -> None:
    """Anything else an app sends as an id is refused (the edge answers 400)."""
    assert not valid_app_id(user)


@pytest.mark.parametrize("user", ["has space", "quote'd", "中文用户", "u" * MAX_ID_BYTES])
def test_the_store_holds_ids_apps_cannot_send(user: str) -> None:
    """Imported ids outside the app rule (spaces, quotes, other scripts, up to 512 bytes) are still storable."""
    assert check_user_id(user) == user


@pytest.mark.parametrize("user", ["", "a\x00b", "line\nbreak", "x" * (MAX_ID_BYTES + 1), "é" * 257])
def test_the_store_refuses_empty_control_and_over_long_ids(user: str) -> None:
    """Empty ids, control characters and ids over 512 UTF-8 bytes are refused by the store."""
    with pytest.raises(InvalidUserId):
        check_user_id(user)
