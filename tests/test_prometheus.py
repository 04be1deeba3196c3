"""The controller against a real Prometheus server scraping two live replicas:
PromQL sums both, the decision is pushed to both, and Prometheus going away
keeps the last policy."""

import shutil
import socket
import subprocess
import time

import httpx2
import openai
import pytest
from live import make_server
from prometheus_client import CollectorRegistry

from service.controller.cli import push_to_replicas
from service.controller.decide import ControllerSettings
from service.controller.loop import ControllerLoop, ControllerMetrics
from service.controller.source import SourceError, query_prometheus, scrape_replicas

pytestmark = pytest.mark.skipif(
    shutil.which("prometheus") is None, reason="needs the prometheus binary (.ci/run installs it)"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise TimeoutError("condition not reached")


def test_controller_reads_prometheus_and_pushes_to_every_replica(model, tmp_path):
    first, _ = make_server(model, admin_key="k")
    second, _ = make_server(model, admin_key="k")
    with first as url_a, second as url_b:
        port = free_port()
        targets = ", ".join(f'"{u.removeprefix("http://")}"' for u in (url_a, url_b))
        (tmp_path / "prometheus.yml").write_text(
            f"global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: dflash\n"
            f"    static_configs:\n      - targets: [{targets}]\n"
        )
        command = ["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}",
                   f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"]  # fmt: skip
        server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        prom = f"http://127.0.0.1:{port}"
        try:
            wait_until(lambda: _ok(prom + "/-/ready"))
            for url in (url_a, url_b):
                client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
                client.completions.create(model="target", prompt="x", max_tokens=30, temperature=0)
            direct = scrape_replicas([url_a, url_b], now=0.0)
            wait_until(lambda: query_prometheus(prom, 0.0).step_seconds == direct.step_seconds)
            via_prometheus = query_prometheus(prom, 0.0)
            assert via_prometheus.verified == direct.verified and via_prometheus.accepted == direct.accepted
            assert sum(count for _, count in direct.step_seconds.values()) > 0

            registry = CollectorRegistry()
            loop = ControllerLoop(
                lambda now: query_prometheus(prom, now), push_to_replicas([url_a, url_b], "k"),
                ControllerSettings(max_block_size=4), 4, ControllerMetrics(registry), clock=time.monotonic,
            )  # fmt: skip
            assert loop.tick() is not None and loop.pushed is not None
            expected = {"min_batch": list(loop.pushed.min_batch), "block_sizes": list(loop.pushed.block_sizes)}
            for url in (url_a, url_b):
                assert httpx2.get(url + "/admin/policy", headers={"authorization": "Bearer k"}).json() == expected

            server.terminate()
            server.wait(30)
            assert loop.tick() is None
            assert registry.get_sample_value("dflash_controller_errors_total", {"stage": "observe"}) == 1
            with pytest.raises(SourceError):
                query_prometheus(prom, 0.0)

            server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            wait_until(lambda: _ok(prom + "/-/ready"))
            wait_until(lambda: query_prometheus(prom, 0.0).step_seconds == direct.step_seconds)
            assert loop.tick() is not None  # recovered
            assert registry.get_sample_value("dflash_controller_decisions_total") == 2
        finally:
            if server.poll() is None:
                server.kill()


def _ok(url: str) -> bool:
    try:
        return httpx2.get(url, timeout=1).status_code == 200
    except httpx2.TransportError:
        return False
