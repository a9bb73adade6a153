"""The one error tree: a write the data directory refuses is a 503 naming the fault, never a 500."""

from __future__ import annotations

import errno
from pathlib import Path

import orjson
import pytest

from proxy.errors import error_response, storage_unavailable
from tests.conftest import ProxyFactory
from tests.support.readonly import read_only

ADMIN = {"Authorization": "Bearer admin-key-for-tests"}
USER = "/v1/memory/users/ro-ann"


def test_storage_fault_is_a_503_with_its_reason() -> None:
    """A disk fault (read-only file system) renders as 503 ``storage_unavailable`` with the errno's name."""
    response = error_response(storage_unavailable(OSError(errno.EROFS, "Read-only file system")))
    error = orjson.loads(response.body)["error"]  # type: ignore[arg-type]
    assert response.status == 503
    assert error["code"] == "storage_unavailable"
    assert "EROFS" in error["message"]


@pytest.mark.slow
async def test_management_writes_on_a_read_only_data_dir_are_503(make_proxy: ProxyFactory, tmp_path: Path) -> None:
    """With the data directory read-only, adding, editing and deleting memories answer 503 with the storage reason;
    reads still answer 200."""
    proxy = await make_proxy(admin={"api_key": "admin-key-for-tests"})
    added = await proxy.post(USER + "/memories", json={"text": "Ann grows tomatoes."}, headers=ADMIN)
    assert added.status == 201
    memory_id = (await added.json())["id"]
    with read_only(tmp_path):
        writes = [
            await proxy.post(USER + "/memories", json={"text": "Ann keeps bees."}, headers=ADMIN),
            await proxy.patch(f"{USER}/memories/{memory_id}", json={"text": "Ann grows peppers."}, headers=ADMIN),
            await proxy.delete(f"{USER}/memories/{memory_id}", headers=ADMIN),
        ]
        listed = await proxy.get(USER + "/memories", headers=ADMIN)
        for response in writes:
            error = (await response.json())["error"]
            assert (response.status, error["code"]) == (503, "storage_unavailable"), error
            assert "storage is failing" in error["message"]
        assert listed.status == 200
