"""`promptlang serve` as a user runs it: a process on a free loopback port, a tiny local
model with the default tokenizer, a PML schema from --schemas; SIGTERM lets the request in
flight finish, then the process ends (by the signal, as uvicorn re-raises it after a graceful
shutdown). Every wait is bounded."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT = 120.0
TIMEOUT = 60.0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_healthy(url: str, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"the server exited with {process.returncode}: "
                                 f"{process.stderr.read()}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as response:
                if json.loads(response.read()) == {"status": "ok"}:
                    return
        except OSError:
            time.sleep(0.2)
    raise AssertionError("the server did not become healthy in time")


def test_serve_answers_pml_and_drains_the_stream_in_flight_on_sigterm(tmp_path,
                                                                     tiny_model_dir):
    port = free_port()
    env = dict(os.environ, PROMPTLANG_HOME=str(tmp_path / "home"))
    process = subprocess.Popen(
        [sys.executable, "-m", "promptlang", "serve", "--model", str(tiny_model_dir),
         "--port", str(port), "--schemas", str(ROOT / "examples" / "pml" / "travel.pml"),
         "--model-name", "tiny"],
        env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, process)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=TIMEOUT,
                               max_retries=0)
        pml = (ROOT / "examples" / "pml" / "travel-prompt.pml").read_text()
        reply = client.chat.completions.create(model="tiny", messages=[], max_tokens=3,
                                               temperature=0,
                                               extra_body={"promptlang": {"pml": pml}})
        assert reply.usage.prompt_tokens_details.cached_tokens > 0
        stream = client.completions.create(model="tiny", prompt="Count on and on:",
                                           max_tokens=300, temperature=0, stream=True)
        chunks = iter(stream)
        next(chunks)
        process.send_signal(signal.SIGTERM)          # mid-stream: the stream still ends
        rest = list(chunks)
        assert rest and rest[-1].choices[0].finish_reason in ("length", "stop")
        # uvicorn re-raises the signal once it has shut down gracefully
        assert process.wait(TIMEOUT) in (0, -signal.SIGTERM)
        assert "Finished server process" in process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(TIMEOUT)


class _Loaded(Exception):
    """engine.load was reached (with these keyword arguments): no model is loaded."""


def test_tail_mib_sizes_the_engines_prompt_tails_and_is_checked(monkeypatch, capsys):
    from promptlang.cli import main
    from promptlang.runtime import engine

    def load(*args, **options):
        raise _Loaded(options)
    monkeypatch.setattr(engine, "load", load)
    with pytest.raises(_Loaded) as loaded:
        main(["serve", "--tail-mib", "3"])
    assert loaded.value.args[0]["tail_budget_bytes"] == 3 << 20
    with pytest.raises(_Loaded) as loaded:
        main(["serve"])
    assert "tail_budget_bytes" not in loaded.value.args[0]        # load's default
    assert main(["serve", "--tail-mib", "-1"]) == 2
    assert "--tail-mib must be >= 0, not -1" in capsys.readouterr().err
    assert main(["serve", "--ray", "--tail-mib", "0"]) == 2
    assert "--tail-mib is not available with --ray" in capsys.readouterr().err


def test_the_command_line_s_limits_reach_the_server_and_are_checked(monkeypatch, capsys):
    from promptlang.cli import main
    from promptlang.runtime import engine
    from promptlang.server import load as load_mod

    monkeypatch.setattr(engine, "load", lambda *args, **options: options)
    monkeypatch.setattr(load_mod, "load_schemas", lambda llm, schemas: {})
    served = []
    monkeypatch.setattr(load_mod, "serve", lambda llm, **options: served.append((llm, options)))
    assert main(["serve", "--max-connections", "0", "--keep-alive", "9", "--body-timeout",
                 "2.5", "--header-timeout", "4", "--memory-budget", "64MiB",
                 "--disk-budget", "0"]) == 0
    options, server = served[-1]
    assert (options["memory_budget_bytes"], options["disk_budget_bytes"]) == (64 << 20, 0)
    assert server["limit_concurrency"] is None and server["timeout_keep_alive"] == 9
    assert server["body_timeout"] == 2.5 and server["header_timeout"] == 4
    assert "module store budgets: memory 64.0 MiB, disk 0 B" in capsys.readouterr().err
    assert main(["serve"]) == 0
    assert "limit_concurrency" not in served[-1][1]                 # serve()'s default
    assert main(["serve", "--keep-alive", "0"]) == 2
    assert "--keep-alive must be positive, not 0" in capsys.readouterr().err
    assert main(["serve", "--header-timeout", "0"]) == 2
    assert "--header-timeout must be positive, not 0" in capsys.readouterr().err


def test_ray_budgets_reach_every_replica_and_are_checked(monkeypatch, capsys, tmp_path):
    pytest.importorskip("ray.serve", reason="Ray Serve is not installed (CI installs it)")
    from promptlang.cli import main
    from promptlang.server import cluster

    started = []
    monkeypatch.setattr(cluster, "serve_cluster",
                        lambda config, **where: started.append(config))
    store = str(tmp_path / "kv")
    assert main(["serve", "--ray", "--replicas", "4", "--store", store, "--memory-budget",
                 "4GiB", "--disk-budget", "10MiB"]) == 0
    config = started[-1]
    assert (config.device_budget_bytes, config.disk_budget_bytes) == (1 << 30, 10 << 20)
    assert ("module store budgets: memory 1.0 GiB per replica, disk 10.0 MiB for the shared "
            "folder") in capsys.readouterr().err
    assert main(["serve", "--ray", "--store", store, "--replica-memory", "1000",
                 "--disk-budget", "none"]) == 0
    assert (started[-1].device_budget_bytes, started[-1].disk_budget_bytes) == (1000, None)
    assert main(["serve", "--ray", "--replicas", "2", "--store", store]) == 0
    assert started[-1].device_budget_bytes is not None         # the machine's default, shared
    assert started[-1].disk_budget_bytes is not None
    assert main(["serve", "--ray", "--store", store, "--replica-memory", "1000",
                 "--memory-budget", "1GiB"]) == 2
    assert "not both" in capsys.readouterr().err
    assert main(["serve", "--ray", "--store", store, "--disk-budget", "lots"]) == 2
    assert "--disk-budget 'lots' is not a size" in capsys.readouterr().err
    assert len(started) == 3
