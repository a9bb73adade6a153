"""storage.uri: the object-storage location and its options, from the config and the standard AWS variables."""

from __future__ import annotations

import pytest

from proxy.config import ConfigError, load_settings
from proxy.memory.store.objectstore import StorageLocation, is_remote


def test_storage_uri_from_config_and_aws_variables() -> None:
    """storage.uri takes s3://bucket/prefix with the AWS variables; secrets never show; bad schemes are named."""
    env = {
        "MEMPROXY_STORAGE__URI": "s3://bucket/pre",
        "AWS_ENDPOINT_URL": "http://127.0.0.1:9",
        "AWS_SECRET_ACCESS_KEY": "very-secret",
        "AWS_ACCESS_KEY_ID": "AKIA1",
        "AWS_REGION": "eu-west-1",
    }
    settings = load_settings(None, environ=env)
    cluster = settings.storage.cluster(env)
    assert cluster is not None
    assert cluster.location.options["aws_endpoint"] == "http://127.0.0.1:9"
    assert cluster.location.options["allow_http"] == "true"
    assert cluster.location.child("lance") == "s3://bucket/pre/lance"
    assert "very-secret" not in repr(cluster) + repr(settings) + str(cluster.location.describe())
    assert load_settings(None, environ={}).storage.cluster({}) is None
    with pytest.raises(ConfigError, match=r"storage\.uri"):
        load_settings(None, environ={"MEMPROXY_STORAGE__URI": "ftp://x/y"})


def test_config_options_win_over_aws_variables_and_local_uri_is_a_directory() -> None:
    """storage.options override the AWS variables; a local storage.uri is the data directory, not a store."""
    location = StorageLocation.from_settings(
        "s3://b/p/", {"AWS_ENDPOINT": "https://minio:9000"}, {"AWS_ENDPOINT_URL": "http://127.0.0.1:9"}
    )
    assert location.options["aws_endpoint"] == "https://minio:9000"
    assert "allow_http" not in location.options
    assert location.key("changes", "x.json") == "p/changes/x.json"
    assert location.bucket == "b"
    settings = load_settings(None, environ={"MEMPROXY_STORAGE__URI": "/srv/memproxy"})
    assert settings.store_settings().path.as_posix() == "/srv/memproxy"
    assert settings.storage.cluster({}) is None
    assert is_remote("s3://b/p")
    assert not is_remote("/srv/memproxy")
