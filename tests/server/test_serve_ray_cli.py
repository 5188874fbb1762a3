"""`promptlang serve --ray` as a user runs it: a process that starts a local Ray cluster,
serves the OpenAI API on 127.0.0.1, and shuts everything down on SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

pytest.importorskip("ray.serve", reason="Ray Serve is not installed: pip install -e "
                                        "'.[cluster]' (CI installs it)")

START_S, STOP_S = 240.0, 120.0


def test_serve_ray_serves_the_api_and_stops_on_sigterm(tmp_path):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log = open(tmp_path / "serve.log", "w")
    process = subprocess.Popen(
        [sys.executable, "-m", "promptlang", "serve", "--ray", "--replicas", "1",
         "--threads", "1", "--port", str(port), "--store", str(tmp_path / "kv")],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=dict(os.environ))
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_S
        while "promptlang serve --ray: ready on" not in (tmp_path / "serve.log").read_text():
            assert process.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the cluster did not come up"
            time.sleep(1)
        while True:
            try:
                with urllib.request.urlopen(base + "/health", timeout=10) as response:
                    if json.loads(response.read())["status"] == "ok":
                        break
            except (urllib.error.URLError, ConnectionError, ValueError, KeyError):
                pass
            assert time.monotonic() < deadline, "the cluster did not come up"
            time.sleep(2)
        request = urllib.request.Request(
            base + "/v1/chat/completions", method="POST",
            headers={"content-type": "application/json"},
            data=json.dumps({"messages": [{"role": "user", "content": "Hi"}],
                             "max_tokens": 3, "temperature": 0}).encode())
        with urllib.request.urlopen(request, timeout=120) as response:
            answer = json.loads(response.read())
            assert response.headers["x-promptlang-replica"]
        assert answer["object"] == "chat.completion" and answer["usage"]["completion_tokens"]
        assert answer["model"] == "smollm2-135m-instruct"
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            code = process.wait(STOP_S)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            raise
        log.close()
    assert code == 0, (tmp_path / "serve.log").read_text()[-3000:]
