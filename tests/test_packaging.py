"""The container image is built with the same steps CI proves, and its Dockerfile lints clean."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_dockerfile_lints_clean() -> None:
    """hadolint finds nothing in the Dockerfile."""
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).with_name("hadolint"))
    result = subprocess.run(
        [hadolint, str(ROOT / "Dockerfile")], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_installs_like_the_makefile() -> None:
    """The image installs with the same constraints and editable install as `make serve`."""
    dockerfile = (ROOT / "Dockerfile").read_text()
    makefile = (ROOT / "Makefile").read_text()
    assert "-m pip install --quiet -c constraints.txt -e ." in dockerfile
    assert "$(PIP) install --quiet -c $(CONSTRAINTS) -e ." in makefile
    for needed in (
        "COPY --chown=memproxy:memproxy models ./models",
        "HEALTHCHECK",
        'VOLUME ["/data"]',
        "USER 10001:10001",
    ):
        assert needed in dockerfile


def test_constraints_pin_no_torch() -> None:
    """torch never enters the runtime dependencies (it would pull a multi-GB CUDA build)."""
    pins = (ROOT / "constraints.txt").read_text().lower()
    assert "torch" not in pins
    assert "nvidia" not in pins
