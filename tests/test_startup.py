"""A start fails fast: a bad config file, a port in use, a Redis that is down, a disk directory that
cannot be written or an impossible tier size is one line and exit 2, before any weight is loaded."""

from __future__ import annotations

import socket
import threading

import pytest
import uvicorn
from fastapi import FastAPI

from kvtier.cli.main import main
from kvtier.serve.server import ReadyServer, listen_socket


@pytest.fixture
def no_model_load(monkeypatch):
    """Every check must come before the model load: loading fails the test."""
    def load(*a, **kw):
        raise AssertionError("the model was loaded before the startup checks failed")

    monkeypatch.setattr("kvtier.engine.factory.load_model", load)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _fails_in_one_line(argv: list[str], capsys, *needles: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def test_a_port_in_use(capsys, no_model_load):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        _fails_in_one_line(["serve", "--model", "tiny-gqa", "--no-store", "--port", str(port)], capsys,
                           f"127.0.0.1:{port}", "in use", "--port")


def test_redis_down(capsys, no_model_load):
    url = f"redis://127.0.0.1:{_free_port()}"
    _fails_in_one_line(["serve", "--model", "tiny-gqa", "--port", "0", "--store", f"memory:64MB,{url}"], capsys,
                       "cannot reach Redis", "Start the server or fix the URL")
    _fails_in_one_line(["generate", "--model", "tiny-gqa", "--prompt", "x", "--store", url], capsys,
                       "cannot reach Redis")


def test_a_disk_directory_that_cannot_be_written(tmp_path, capsys, no_model_load):
    (tmp_path / "a-file").write_text("")  # a directory cannot be made under a file, even by root
    spec = f"disk:{tmp_path}/a-file/store:1GB"
    _fails_in_one_line(["serve", "--model", "tiny-gqa", "--port", "0", "--store", spec], capsys,
                       "is not writable", "--store")


def test_tier_sizes_beyond_the_machine(tmp_path, capsys, no_model_load):
    _fails_in_one_line(["generate", "--model", "tiny-gqa", "--prompt", "x", "--store", "memory:900000TB"], capsys,
                       "larger than this machine's RAM")
    _fails_in_one_line(["generate", "--model", "tiny-gqa", "--prompt", "x", "--store", f"disk:{tmp_path}:900000TB"],
                       capsys, "its filesystem holds")


def test_a_bad_config_file_or_environment(tmp_path, capsys, no_model_load, monkeypatch):
    bad = tmp_path / "bad.yaml"
    bad.write_text("max_num_seqs: none-at-all\n")
    _fails_in_one_line(["serve", "--config", str(bad)], capsys, str(bad), "max_num_seqs")
    _fails_in_one_line(["serve", "--config", str(tmp_path / "missing.yaml")], capsys, "missing.yaml")
    monkeypatch.setenv("KVTIER_PORT", "80000")
    _fails_in_one_line(["serve"], capsys, "$KVTIER_PORT", "[0, 65535]")


def test_an_unknown_model_or_device(capsys, no_model_load):
    _fails_in_one_line(["serve", "--model", "no/such-model-here", "--port", "0", "--no-store"], capsys,
                       "no/such-model-here")
    _fails_in_one_line(["generate", "--model", "tiny-gqa", "--prompt", "x", "--device", "tpu"], capsys, "tpu")


def test_serving_is_announced_only_once_the_port_listens():
    sock = listen_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    connected: list[bool] = []

    def on_ready() -> None:  # a client that connects now must get through
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            connected.append(True)
        server.should_exit = True

    server = ReadyServer(uvicorn.Config(FastAPI(), log_level="warning"), on_ready=on_ready)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]})
    thread.start()
    thread.join(timeout=30)
    sock.close()
    assert connected == [True]


def test_the_planner_profile_is_saved_measured_given_or_an_estimate(tiny_gqa, tmp_path, monkeypatch):
    """`make_engine(measure_profile=False)` (the server's start) never measures: a saved profile is
    used, else the estimate; the factory's default still measures once and saves."""
    from kvtier.engine.calibrate import hardware
    from kvtier.engine.factory import make_engine

    monkeypatch.setenv("KVTIER_HOME", str(tmp_path))

    def no_measuring(*a, **k):
        raise AssertionError("measured at start")

    monkeypatch.setattr(hardware, "measure", no_measuring)
    engine = make_engine(tiny_gqa, store="memory:16MB", measure_profile=False)
    assert engine.profile_source == "estimate"
    engine.close()
    hardware.save_profile(hardware.estimate(tiny_gqa), hardware.profile_path(tmp_path, tiny_gqa))
    engine = make_engine(tiny_gqa, store="memory:16MB", measure_profile=False)
    assert engine.profile_source == "saved"
    engine.close()
    engine = make_engine(tiny_gqa, store="memory:16MB")  # the saved one, through the factory
    assert engine.profile_source == "given"
    engine.close()
    assert make_engine(tiny_gqa).profile_source is None  # no store, no planner


def test_a_long_step_prints_a_line_every_few_seconds_without_a_terminal():
    """Reading a GGUF's metadata and converting it take tens of seconds on a first start; where no
    progress bar shows (a log file), a line comes at once and then every `every` seconds."""
    import io
    import time

    from kvtier.progress import heartbeat

    out = io.StringIO()
    with heartbeat("converting x", every=0.05, out=out):
        time.sleep(0.5)
    lines = out.getvalue().splitlines()
    assert lines[0] == "converting x ..." and len(lines) >= 3  # a line, then one every 0.05 s (ten due)
    assert all(line.startswith("converting x: still at it (") for line in lines[1:])


def test_serve_loads_the_model_on_a_thread_that_has_exited_before_it_serves(monkeypatch):
    """The main thread runs no torch op: the loading thread's OpenMP team goes with it, so the
    engine's loop thread holds the process's only one (kvtier/engine/transient.py says why)."""
    from kvtier.engine import factory
    from kvtier.serve import app as app_module

    loaded_on: list[threading.Thread] = []
    engines: list = []
    load, create = factory.load_model, app_module.create_app
    monkeypatch.setattr(factory, "load_model", lambda *a, **k: (loaded_on.append(threading.current_thread()),
                                                                 load(*a, **k))[1])
    monkeypatch.setattr(app_module, "create_app", lambda engine, **k: (engines.append(engine), create(engine, **k))[1])
    served: list[bool] = []

    def run(self, sockets=None) -> None:  # instead of serving: is the loading thread gone?
        loaded_on[0].join(10)
        served.append(loaded_on[0].is_alive())

    monkeypatch.setattr(ReadyServer, "run", run)
    try:
        assert main(["serve", "--model", "tiny-gqa", "--port", "0", "--no-store"]) == 0
    finally:
        for engine in engines:
            engine.close()
    assert loaded_on and loaded_on[0] is not threading.main_thread()
    assert served == [False]
