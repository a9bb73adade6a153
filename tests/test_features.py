"""The feature report: what the configuration allows, and how memory-side calls turn features off and on."""

from __future__ import annotations

from structlog.testing import capture_logs

from proxy.config import load_settings
from proxy.feature_report import configured_features
from proxy.memory.features import FEATURES, FeatureBoard


def test_the_quick_start_configuration_has_every_feature_live() -> None:
    """Only an upstream URL: all five features live, memory-side calls on the user's own model and key."""
    states = configured_features(load_settings(None, environ={"MEMPROXY_UPSTREAM__BASE_URL": "http://127.0.0.1:9/v1"}))
    assert [name for name in FEATURES if states[name].live] == list(FEATURES)
    assert "each user's own chat key" in states["facts"].reason
    assert "latest chat model" in states["insights"].reason


def test_reasons_name_what_is_off() -> None:
    """Memory off, a rejected configured key, or a separate memory server without a key: each says so."""
    off = configured_features(load_settings(None, environ={}, overrides={"memory": {"enabled": False}}))
    assert not any(state.live for state in off.values())
    assert "enabled = false" in off["turns"].reason
    rejected = configured_features(load_settings(None, environ={}), rejected="HTTP 401 on GET /models")
    assert [name for name in FEATURES if not rejected[name].live] == ["facts", "summaries", "insights"]
    assert "HTTP 401" in rejected["summaries"].reason
    separate = configured_features(
        load_settings(None, environ={}, overrides={"memory_llm": {"base_url": "http://127.0.0.1:9/v1"}})
    )
    assert "client keys only go to the chat's own upstream" in separate["facts"].reason


def test_the_board_logs_each_change_once_and_recovers() -> None:
    """A feature goes off with its reason (one log line however many jobs wait), and back on after a success."""
    board = FeatureBoard()
    board.configure(configured_features(load_settings(None, environ={})))
    with capture_logs() as logs:
        board.waiting("facts", "key_rejected", "upstream status 401")
        board.waiting("facts", "key_rejected", "upstream status 401")
        assert board.report()["facts"]["live"] is False
        assert "rejects the key" in board.report()["facts"]["reason"]
        assert board.gauges()["facts"] == 0.0
        board.succeeded("facts")
    assert [(e["feature"], e["live"]) for e in logs if e["event"] == "memory.feature"] == [
        ("facts", False),
        ("facts", True),
    ]
    assert board.report()["facts"]["live"] is True


def test_a_success_turns_on_a_feature_the_probe_thought_off() -> None:
    """If memory-side calls answer after all, the feature is live even though start-up said otherwise."""
    board = FeatureBoard()
    board.configure(configured_features(load_settings(None, environ={}), rejected="HTTP 403 on GET /models"))
    board.succeeded("insights")
    assert board.report()["insights"] == {"live": True, "reason": "memory-side calls answer"}
