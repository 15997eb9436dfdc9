"""docs/rewards.md's first request with curl works as written: its commands, taken from between the
doc's markers, run against a real ``flowcredit serve-reward --reward shapes`` in a subprocess, and
the answers are the ones the doc shows. Only the port changes (the server takes a free one)."""

from __future__ import annotations

import json
import os
import re
import select
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- first-request:begin", "<!-- first-request:end -->"
DOC_PORT = "8000"


def documented() -> tuple[str, list[str], list[str]]:
    """``(server command, the other command lines, the answers)`` of the doc's first request."""
    text = (REPO / "docs" / "rewards.md").read_text()
    assert text.count(BEGIN) == 1 and text.count(END) == 1, "the first-request markers are gone"
    section = text[text.index(BEGIN) : text.index(END)]
    blocks = re.findall(r"^```(\w*)\n(.*?)^```$", section, flags=re.M | re.S)
    assert [kind for kind, _ in blocks] == ["bash", "json"], blocks
    commands, answers = blocks[0][1].splitlines(), blocks[1][1].splitlines()
    server = commands[0]
    assert server.startswith("flowcredit serve-reward ") and server.endswith(" &"), server
    return server.removesuffix("&").strip(), commands[1:], answers


def test_the_doc_section_is_what_the_test_expects():
    server, commands, answers = documented()
    assert f"--port {DOC_PORT}" in server and "--reward shapes" in server
    assert sum(line.startswith("curl ") for line in commands) == len(answers) == 2
    assert all(f"127.0.0.1:{DOC_PORT}/" in line for line in commands if line.startswith(("curl", "until")))


def _env() -> dict:
    """This interpreter's bin folder first on PATH (``flowcredit`` and ``python`` of the venv), and no
    token in the environment (the doc's server takes none)."""
    env = {k: v for k, v in os.environ.items() if k != "FLOWCREDIT_REWARD_TOKEN"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["OMP_NUM_THREADS"] = "1"
    return env


def _start(server: str, env: dict) -> tuple[subprocess.Popen, str]:
    """The doc's server on a free port: the process and its port (read from its first line)."""
    argv = shlex.split(server.replace(f"--port {DOC_PORT}", "--port 0"))
    if shutil.which(argv[0], path=env["PATH"]) is None:  # not installed as a script: the module
        argv = [sys.executable, "-m", "flowcredit", *argv[1:]]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ready = select.select([proc.stdout], [], [], 120)[0]  # a hung start fails the test, not hangs it
    line = proc.stdout.readline() if ready else ""
    if " on http://" not in line:
        proc.kill()
        raise AssertionError(f"the server did not start: {line!r} {proc.communicate(timeout=30)[1][-2000:]}")
    return proc, line.split(" on http://")[1].split()[0].rsplit(":", 1)[1]


def test_the_documented_curl_request_gets_the_documented_answers(tmp_path):
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed: the documented commands use it")
    server, commands, answers = documented()
    env = _env()
    proc, port = _start(server, env)
    try:
        script = "\n".join(commands).replace(f"127.0.0.1:{DOC_PORT}", f"127.0.0.1:{port}")
        done = subprocess.run(
            ["bash", "-e", "-u", "-o", "pipefail", "-c", script],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=90,
        )  # fmt: skip
    finally:
        proc.kill()
        proc.wait(30)
    assert done.returncode == 0, done.stderr[-2000:]
    got = [json.loads(line) for line in done.stdout.splitlines()]
    assert got == [json.loads(line) for line in answers], done.stdout
    assert got[0] == {"rewards": [1.0]}  # the rendered "a blue circle" meets its metadata exactly
    error = got[1]["error"]
    assert error.startswith("reward 'shapes' rejected metadata[0]: ") and "'category'" in error
