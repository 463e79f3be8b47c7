"""`python -m kvtier.serve` in a subprocess on a free loopback port, for the load benchmark and tests."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx


class ServerProcess:
    """`python -m kvtier.serve ARGS` on a free loopback port; output goes to a log file."""

    def __init__(self, serve_args: list[str], env: dict[str, str] | None = None) -> None:
        from kvtier.testing.services import free_port

        self.port = free_port()
        self.log = tempfile.NamedTemporaryFile("w+", prefix="kvtier-serve-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "kvtier.serve", "--port", str(self.port), *serve_args]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.url = f"http://127.0.0.1:{self.port}"

    @classmethod
    def for_bench(cls, args: argparse.Namespace) -> "ServerProcess":
        serve_args = ["--model", args.model, "--dtype", args.dtype, "--log-level", "warning",
                      "--kv-cache-gb", str(args.kv_cache_gb), "--max-num-seqs", str(args.max_num_seqs)]
        if args.store:
            serve_args += ["--store", args.store]
        if args.no_prefix_cache:
            serve_args += ["--no-prefix-cache"]
        if args.restore_method:
            serve_args += ["--restore-method", args.restore_method]
        if args.no_store:
            serve_args += ["--no-store"]
        if args.api_key:
            serve_args += ["--api-key", args.api_key]
        return cls(serve_args)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with code {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"the server was not ready after {timeout} s:\n{self.tail()}")

    def tail(self, n: int = 4000) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()[-n:]

    def stop(self) -> None:
        """SIGTERM: uvicorn shuts down gracefully and the engine drains its pending saves. Idempotent."""
        if self.log.closed:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)  # draining saves to a slow disk can take a while
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        os.unlink(self.log.name)
