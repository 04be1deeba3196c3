"""``dflash-serve`` as a real process: on SIGTERM it keeps listening while it
drains (new requests get 503, ``/ready`` 503), the in-flight request finishes,
and a drain that runs out of time ends open streams with an error event."""

import json
import signal
import subprocess
import sys
import time
from contextlib import contextmanager

import httpx2
from live import free_port


@contextmanager
def serving(target, draft, *flags: str):
    """A ``dflash-serve`` process on a free port, ready; yields (process, url)."""
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "service.cli",
        "--target",
        str(target),
        "--draft",
        str(draft),
        "--port",
        str(port),
        "--served-model-name",
        "tiny",
        *flags,
    ]
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx2.get(url + "/ready", timeout=1).status_code == 200:
                    break
            except httpx2.TransportError:
                time.sleep(0.1)
        yield server, url
        # uvicorn re-raises the signal after a graceful shutdown, so the exit status says SIGTERM.
        assert server.wait(timeout=60) in (0, -signal.SIGTERM)
    finally:
        if server.poll() is None:
            server.kill()
    log = server.stdout.read()
    assert "Application shutdown complete" in log and "Traceback" not in log, log


def stream_with_sigterm(server, url: str, max_tokens: int, during_drain=lambda: None) -> list[dict]:
    """Stream a greedy completion, SIGTERM the server at its third chunk and
    call ``during_drain`` right after; returns the stream's JSON events."""
    body = {"model": "tiny", "prompt": "x", "max_tokens": max_tokens, "temperature": 0, "stream": True}
    events = []
    with httpx2.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
                if len(events) == 3:
                    server.send_signal(signal.SIGTERM)  # mid-stream
                    during_drain()
            elif line == "data: [DONE]":
                events.append({"done": True})
    return events


def test_sigterm_drains_in_flight_requests_and_refuses_new_ones(served_pair_dirs):
    refused = {}

    def during_drain():  # the tiny model needs seconds for 1500 tokens: the server is draining
        refused["ready"] = httpx2.get(url + "/ready", timeout=10).status_code
        new = httpx2.post(url + "/v1/completions", json={"model": "tiny", "prompt": "y", "max_tokens": 2}, timeout=10)
        refused["new"] = (new.status_code, new.headers.get("retry-after"), new.json()["error"]["code"])

    with serving(*served_pair_dirs) as (server, url):
        events = stream_with_sigterm(server, url, 1500, during_drain)
    finishes = [e["choices"][0]["finish_reason"] for e in events if "choices" in e]
    assert finishes[-1] == "length" and events[-1] == {"done": True}  # the in-flight request ran to its end
    assert refused == {"ready": 503, "new": (503, "5", "draining")}


def test_a_drain_that_runs_out_ends_open_streams_with_an_error(served_pair_dirs):
    with serving(*served_pair_dirs, "--drain-timeout-s", "0.5") as (server, url):
        events = stream_with_sigterm(server, url, 1900)  # seconds of work, far beyond the drain timeout
    assert events[-2]["error"]["code"] == "draining" and events[-1] == {"done": True}
    assert all(e["choices"][0]["finish_reason"] is None for e in events if "choices" in e)
