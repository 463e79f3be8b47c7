"""Schemathesis against the live server's OpenAPI schema: no 5xx, no crash, responses as documented.

Runs the `st` command line (examples, coverage, fuzzing and stateful phases) rather than the
pytest plugin, whose lazy fixture loader does not work with pytest 9. Every check is on except
`positive_data_acceptance`: a schema-valid prompt can still be longer than the context window
(a limit in tokens that JSON Schema cannot express), and that is rightly a 400.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import httpx

from serve_testlib import Served, wait_idle


def _st() -> list[str]:
    exe = Path(sys.executable).with_name("st")
    if exe.exists():
        return [str(exe)]
    found = shutil.which("st")
    return [found] if found else [sys.executable, "-m", "schemathesis.cli"]


def test_schemathesis_run(tiny_server: Served, tmp_path: Path) -> None:
    cmd = _st() + [
        "run", tiny_server.url + "/openapi.json",
        "--checks", "all", "--exclude-checks", "positive_data_acceptance",
        "--max-examples", "40", "--seed", "1", "--workers", "1", "--request-timeout", "30",
        "--generation-database", "none", "--no-color",
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "generated" in out and "Server error" not in out, out[-3000:]
    # The server is still healthy and nothing leaked.
    assert httpx.get(tiny_server.url + "/health").status_code == 200
    assert tiny_server.background.alive and tiny_server.background.errors == 0
    wait_idle(tiny_server.engine)
    metrics = httpx.get(tiny_server.url + "/metrics").text
    assert 'code="5' not in metrics, [line for line in metrics.splitlines() if 'code="5' in line]
