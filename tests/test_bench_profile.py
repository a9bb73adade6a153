"""The profile bench's tables: py-spy's raw stacks of ``memproxy serve``'s process tree, per process."""

from __future__ import annotations

from bench.profile import summary

_SUPERVISOR = 'process 10:"python memproxy serve"'
_CHAT = 'process 11:"python -m proxy.roles chat --index 0"'
_WRITER = 'process 12:"python -m proxy.roles writer --index 0"'


def test_samples_of_child_processes_count_for_the_child_not_the_supervisor() -> None:
    """With ``--subprocesses`` py-spy prefixes a child's stacks with its parent's process frame too: the
    innermost process frame is the one that ran them."""
    raw = [
        f"{_SUPERVISOR};{_CHAT};thread (11): MainThread;serve (proxy/routes.py:37);dot (proxy/x.py:3) 300",
        f"{_SUPERVISOR};{_WRITER};thread (12): MainThread;commit (proxy/commit.py:9) 100",
        f"{_SUPERVISOR};thread (10): MainThread;supervise (proxy/supervisor.py:5) 100",
    ]
    table = summary(raw, seconds=1.0, requests=100, roles={10: "supervisor", 11: "chat-0", 12: "writer-0"})
    lines = table.splitlines()
    processes = lines[lines.index("processes (ms of CPU per request):") + 1 : lines.index("threads:") - 1]
    assert [line.split()[-1] for line in processes] == ["chat-0", "writer-0", "supervisor"]
    assert processes[0].split()[:2] == ["60.0%", "15.00"]  # 300 samples at 200 Hz over 100 requests
    assert "thread MainThread" in table
