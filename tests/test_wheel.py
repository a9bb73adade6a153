"""The built wheel, installed into a fresh virtual environment, serves with its embedded model from any directory.

How the environment stays fresh and fast: the wheel is built with pip (build isolation, from the configured
package index), a new venv is created without pip, and a ``.pth`` file points it at a directory of symlinks to
the shared venv's installed distributions *minus memproxy itself* (so the dependencies need no download); the
wheel is then installed with ``--no-deps``. The server runs with no PYTHONPATH, from an empty temporary
directory, so the model can only come from the installed package.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.support.processes import ROOT, Process, child_env, fake_upstream_process

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SITE = Path(sysconfig.get_paths()["purelib"])


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's wheel, built from the working tree."""
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(out), str(ROOT)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    [built] = out.glob("memproxy-*.whl")
    return built


def _dependencies_without_memproxy(target: Path) -> Path:
    """A directory of symlinks to the shared venv's packages, memproxy (and its editable hooks) left out."""
    target.mkdir()
    for entry in SITE.iterdir():
        name = entry.name.lower()
        if name.startswith(("memproxy", "__editable__", "proxy", "insights")) or name.endswith(".pth"):
            continue
        (target / entry.name).symlink_to(entry)
    return target


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with the wheel installed; returns its ``bin`` directory."""
    root = tmp_path_factory.mktemp("venv")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = Path(
        subprocess.run(
            [str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    (site / "shared-deps.pth").write_text(str(_dependencies_without_memproxy(root / "deps")) + "\n")
    env = {k: v for k, v in child_env().items() if k != "PYTHONPATH"}
    subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", str(wheel)],
        check=True,
        env=env,
        timeout=600,
    )
    return venv / "bin"


@pytest.fixture(scope="module")
def upstream() -> Iterator[str]:
    """The fake upstream for the module."""
    with fake_upstream_process() as (_, url):
        yield url


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in child_env(**extra).items() if k != "PYTHONPATH"}
    env.pop("MEMPROXY_CONFIG", None)
    return env


def test_wheel_holds_the_model_and_every_package(wheel: Path) -> None:
    """The wheel carries the models, the web page and every Python package of the source tree."""
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "proxy/models/all-MiniLM-L6-v2/model.onnx" in names
    assert "proxy/models/all-MiniLM-L6-v2/tokenizer.json" in names
    assert "proxy/models/all-MiniLM-L6-v2-int8/model.onnx" in names
    assert "proxy/models/minilm-static/vectors.npy" in names  # the default embedder
    assert "proxy/web/index.html" in names
    packages = {
        p.parent.relative_to(ROOT).as_posix()
        for top in ("proxy", "insights")
        for p in (ROOT / top).rglob("__init__.py")
    }
    assert packages
    assert all(f"{package}/__init__.py" in names for package in packages), packages


def test_installed_wheel_serves_with_memory_from_a_temporary_directory(
    installed: Path, upstream: str, tmp_path: Path
) -> None:
    """`memproxy --version` answers, and `memproxy serve` from an empty directory remembers and injects a fact."""
    version = subprocess.run(
        [str(installed / "memproxy"), "--version"],
        capture_output=True,
        text=True,
        env=_env(),
        cwd=tmp_path,
        check=True,
        timeout=60,
    )
    assert version.stdout.startswith("memproxy ")
    workdir = tmp_path / "anywhere"
    workdir.mkdir()
    env = _env(
        MEMPROXY_UPSTREAM__BASE_URL=upstream,
        MEMPROXY_STORAGE__PATH=str(tmp_path / "data"),
        MEMPROXY_MEMORY__RETRIEVAL_TIMEOUT_MS="20000",
        MEMPROXY_RETRIEVAL__ARM_TIMEOUT_MS="20000",
        MEMPROXY_MEMORY__READ_QUEUE_MS="20000",
    )
    proc = Process([str(installed / "memproxy"), "serve", "--port", "0"], env, cwd=workdir)
    try:
        port = json.loads(proc.wait_for(r'"event":\s*"server.started"', timeout=180).string)["port"]
        assert "memory.ready" in proc.output
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="sk-client", max_retries=0)
        headers = {"X-Memory-User": "wheel-user"}
        client.chat.completions.create(
            model="fake-echo",
            extra_headers={**headers, "X-Memory-Conversation": "a"},
            messages=[{"role": "user", "content": "My cat is called Miso."}],
        )
        time.sleep(1.5)  # the write path runs after the reply
        raw = client.chat.completions.with_raw_response.create(
            model="fake-echo",
            extra_headers={**headers, "X-Memory-Conversation": "b"},
            messages=[{"role": "user", "content": "What is my cat called?"}],
        )
        assert int(raw.headers["X-Memory-Injected"]) >= 1
        assert str(installed.parent) in proc.popen.args[0]
    finally:
        assert proc.stop() == 0
        proc.cleanup()
    assert not (workdir / "models").exists()
    assert os.listdir(workdir) == []
