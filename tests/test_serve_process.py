"""``dflash-serve`` as a real process: it serves, and on SIGTERM it stops
admitting, finishes the in-flight request, and exits cleanly."""

import json
import signal
import subprocess
import sys
import time

import httpx2
from live import free_port


def test_sigterm_drains_in_flight_requests(served_pair_dirs):
    target, draft = served_pair_dirs
    port = free_port()
    cmd = [sys.executable, "-m", "service.cli", "--target", str(target), "--draft", str(draft),
           "--port", str(port), "--served-model-name", "tiny"]  # fmt: skip
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx2.get(url + "/ready", timeout=1).status_code == 200:
                    break
            except httpx2.TransportError:
                time.sleep(0.1)
        body = {"model": "tiny", "prompt": "x", "max_tokens": 600, "temperature": 0, "stream": True}
        chunks, finish = 0, None
        with httpx2.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            for line in lines:
                if line.startswith("data: {"):
                    chunks += 1
                    if chunks == 3:
                        server.send_signal(signal.SIGTERM)  # mid-stream
                    finish = json.loads(line[6:])["choices"][0]["finish_reason"] or finish
        assert finish == "length" and chunks >= 3  # the in-flight request ran to its end
        # uvicorn re-raises the signal after a graceful shutdown, so the exit status says SIGTERM.
        assert server.wait(timeout=60) in (0, -signal.SIGTERM)
    finally:
        if server.poll() is None:
            server.kill()
    log = server.stdout.read()
    assert "Application shutdown complete" in log and "Traceback" not in log
