"""nginx with the shipped deploy/nginx/memproxy.conf, templated only for its listen port and replica addresses."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from tests.support.processes import ROOT, Process, child_env

SHIPPED_CONF = ROOT / "deploy" / "nginx" / "memproxy.conf"
NGINX = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)


def free_port() -> int:
    """A port that was free on 127.0.0.1 a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def render(workdir: Path, listen: int, replicas: Sequence[str]) -> Path:
    """The shipped config with ``listen`` and the replica addresses swapped in, inside a main config."""
    conf = SHIPPED_CONF.read_text()
    conf, listens = re.subn(r"listen 8080;", f"listen 127.0.0.1:{listen};", conf)
    lines = re.findall(r"^( *)server memproxy-\d+:8080( [^;\n]*)?;\n", conf, re.MULTILINE)
    assert listens == 1, "the shipped nginx config changed shape"
    assert lines, "the shipped nginx config changed shape"
    indent, options = lines[0]
    servers = "".join(f"{indent}server {address}{options};\n" for address in replicas)
    conf = re.sub(r"(^ *server memproxy-\d+:8080[^;\n]*;\n)+", lambda _: servers, conf, count=1, flags=re.MULTILINE)
    (workdir / "memproxy.conf").write_text(conf)
    temp = "\n".join(
        f"    {kind}_temp_path {workdir}/{kind};" for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    user = "user root;" if os.geteuid() == 0 else ""
    main = workdir / "nginx.conf"
    main.write_text(
        f"daemon off;\nworker_processes 1;\npid {workdir}/nginx.pid;\nerror_log {workdir}/error.log info;\n{user}\n"
        f"events {{ worker_connections 1024; }}\n"
        f"http {{\n    access_log {workdir}/access.log;\n{temp}\n    include {workdir}/memproxy.conf;\n}}\n"
    )
    return main


def check(main: Path) -> subprocess.CompletedProcess[str]:
    """``nginx -t`` on a rendered config."""
    assert NGINX is not None, "nginx is not installed (make test-cluster installs it)"
    return subprocess.run(
        [NGINX, "-t", "-p", str(main.parent), "-c", str(main), "-e", str(main.parent / "error.log")],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


@contextmanager
def nginx(workdir: Path, replicas: Sequence[str]) -> Iterator[str]:
    """nginx in the foreground on a free port of 127.0.0.1 in front of ``replicas``; yields its base URL."""
    assert NGINX is not None, "nginx is not installed (make test-cluster installs it)"
    port = free_port()
    main = render(workdir, port, replicas)
    proc = Process([NGINX, "-p", str(workdir), "-c", str(main), "-e", str(workdir / "error.log")], child_env())
    try:
        for _ in range(200):
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert proc.popen.poll() is None, proc.output + (workdir / "error.log").read_text(errors="replace")
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.stop()
        proc.cleanup()
