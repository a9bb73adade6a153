"""The ``memproxy memories`` and ``memproxy insights`` commands against a running ``memproxy serve``.

The server is the real CLI process (memory on, the embedded model, the fake upstream as memory LLM). Most
commands run through ``proxy.cli.main`` in the test process (the console script's entry point, without
paying a Python start-up per command); one runs as the real ``memproxy`` executable.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from proxy.cli import main
from tests.support.processes import MEMPROXY, child_env, fake_upstream_process, memproxy_process

pytestmark = pytest.mark.e2e

KEY = "cli-admin-key-5150"
Run = Callable[..., tuple[int, str, str]]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``memproxy serve`` with memory and the management API on; yields its root URL."""
    data = tmp_path_factory.mktemp("cli-data")
    with fake_upstream_process() as (_, upstream_url):
        env = {
            "MEMPROXY_UPSTREAM__BASE_URL": upstream_url,
            "MEMPROXY_STORAGE__PATH": str(data),
            "MEMPROXY_ADMIN__API_KEY": KEY,
            "MEMPROXY_RETRIEVAL__ARM_TIMEOUT_MS": "10000",
        }
        with memproxy_process(env) as (_, url):
            yield url.removesuffix("/v1")


@pytest.fixture
def cli(server: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> Run:
    """Run ``memproxy <args> --url <server>`` in-process; returns (exit code, stdout, stderr)."""
    monkeypatch.setenv("MEMPROXY_ADMIN__API_KEY", KEY)

    def run(*args: str) -> tuple[int, str, str]:
        try:
            main([*args, "--url", server])
            code = 0
        except SystemExit as exc:
            code = int(exc.code or 0)
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    return run


def added_id(output: str) -> str:
    """The id printed by ``memories add``."""
    assert output.startswith("added "), output
    return output.split()[1]


def test_add_list_edit_delete(cli: Run) -> None:
    """Facts added from the terminal are listed in a table, edited with history kept, and deleted."""
    code, out, _ = cli(
        "memories", "add", "--user", "ada", "Ada is a vegetarian", "--importance", "8", "--category", "preference"
    )
    assert code == 0
    first = added_id(out)
    second = added_id(cli("memories", "add", "--user", "ada", "Ada lives in Lyon")[1])
    code, out, _ = cli("memories", "list", "--user", "ada")
    lines = out.splitlines()
    assert lines[0].split() == ["ID", "KIND", "CREATED", "CATEGORY", "IMP", "TEXT"]
    assert second in lines[2]
    assert "Ada lives in Lyon" in lines[2]
    assert first in lines[3]
    assert "preference" in lines[3]
    assert " 8 " in lines[3]
    code, out, _ = cli("memories", "edit", "--user", "ada", second, "--text", "Ada lives in Grenoble")
    assert code == 0
    assert "old version kept in history" in out
    new = out.split("-> ")[1].split()[0]
    history = json.loads(cli("memories", "list", "--user", "ada", "--history", "--json")[1])["data"]
    assert {(r["text"], r["valid"]) for r in history} == {
        ("Ada is a vegetarian", True),
        ("Ada lives in Lyon", False),
        ("Ada lives in Grenoble", True),
    }
    assert cli("memories", "delete", "--user", "ada", new)[:2] == (0, f"deleted {new}\n")
    current = json.loads(cli("memories", "list", "--user", "ada", "--json")[1])["data"]
    assert [r["id"] for r in current] == [first]


def test_search_shows_what_would_be_injected(cli: Run) -> None:
    """``memories search`` prints the arms, the ranked memories and the exact injected block."""
    fact = added_id(cli("memories", "add", "--user", "bea", "Bea is allergic to shellfish")[1])
    code, out, _ = cli("memories", "search", "--user", "bea", "can Bea eat shrimp and shellfish?")
    assert code == 0
    assert out.startswith("arms: ")
    assert "dense" in out.splitlines()[0]
    assert fact in out
    block = out.split("injected block:\n")[1]
    assert block.startswith("<memory>")
    assert "Bea is allergic to shellfish" in block


def test_export_writes_jsonl(cli: Run, tmp_path: Path) -> None:
    """``memories export -o FILE`` writes one JSON record a line and says how many."""
    cli("memories", "add", "--user", "cal", "Cal plays chess")
    cli("memories", "add", "--user", "cal", "Cal has two cats")
    target = tmp_path / "cal.jsonl"
    code, out, _ = cli("memories", "export", "--user", "cal", "-o", str(target))
    assert (code, out) == (0, f"exported 2 records to {target}\n")
    rows = [json.loads(line) for line in target.read_text().splitlines()]
    assert [r["text"] for r in rows] == ["Cal plays chess", "Cal has two cats"]


def test_forget_needs_confirmation(cli: Run) -> None:
    """Without a terminal, ``forget`` refuses unless --yes is given; with it, everything is erased."""
    cli("memories", "add", "--user", "dan", "Dan runs marathons")
    code, _, err = cli("memories", "forget", "--user", "dan")
    assert code == 2
    assert "--yes" in err
    assert "Dan runs marathons" in cli("memories", "list", "--user", "dan")[1]
    code, out, _ = cli("memories", "forget", "--user", "dan", "--yes")
    assert (code, out) == (0, "forgot dan: 1 records erased (1 fact)\n")
    assert cli("memories", "list", "--user", "dan")[1] == "no memories for dan\n"


def test_insights_regenerate_is_queued(cli: Run) -> None:
    """``insights regenerate`` reports the queued run."""
    code, out, _ = cli("insights", "regenerate", "--user", "eli")
    assert code == 0
    assert out.startswith("insight run queued for eli (job ")


def test_user_ids_with_slashes(cli: Run) -> None:
    """A user id containing '/' reaches the right user."""
    cli("memories", "add", "--user", "org/fay", "Fay manages the org account")
    [record] = json.loads(cli("memories", "list", "--user", "org/fay", "--json")[1])["data"]
    assert record["user_id"] == "org/fay"


def test_wrong_key_fails_with_the_servers_message(cli: Run, monkeypatch: pytest.MonkeyPatch) -> None:
    """A wrong key exits 1 with the server's 401 message; --key-env picks another variable."""
    monkeypatch.setenv("OTHER_KEY", "not-the-key")
    code, _, err = cli("memories", "list", "--user", "gil", "--key-env", "OTHER_KEY")
    assert code == 1
    assert "HTTP 401" in err
    assert "admin key" in err
    monkeypatch.setenv("OTHER_KEY", KEY)
    assert cli("memories", "list", "--user", "gil", "--key-env", "OTHER_KEY")[:2] == (0, "no memories for gil\n")


def test_missing_key_is_a_usage_error(cli: Run, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the admin key in the environment the command exits 2 and names the variable to set."""
    monkeypatch.delenv("MEMPROXY_ADMIN__API_KEY")
    code, _, err = cli("memories", "list", "--user", "hana")
    assert code == 2
    assert "MEMPROXY_ADMIN__API_KEY" in err


def test_console_script(server: str) -> None:
    """The installed ``memproxy`` executable lists memories as JSON."""
    args = [str(MEMPROXY), "memories", "list", "--user", "hana", "--json", "--url", server]
    done = subprocess.run(
        args, env=child_env(MEMPROXY_ADMIN__API_KEY=KEY), capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"data": [], "next_cursor": None}
