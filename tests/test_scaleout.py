"""Scale-out on one machine, real parts on loopback: two ``dflash-serve``
processes behind the real SGLang model gateway (``smg``), one controller
driving both through a real Prometheus. Requests spread over the replicas;
killing one replica mid-load loses no client request (the gateway retries)
and the controller keeps deciding and pushing to the replica that is left."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx2
import openai
import pytest
from live import PrometheusServer, answers, free_port, wait_until
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from service.controller.cli import push_to_replicas
from service.controller.loop import ControllerLoop, ControllerMetrics
from service.controller.settings import ControllerSettings
from service.controller.source import discover_replicas, query_prometheus

SMG = Path(sys.executable).with_name("smg")
pytestmark = pytest.mark.skipif(
    not SMG.exists() or shutil.which("prometheus") is None, reason="needs smg (extra `deploy`) and prometheus"
)
REQUESTS, CONCURRENCY, MAX_TOKENS = 24, 4, 40


def start_replica(target: Path, draft: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [
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
        "--admin-key",
        "k",
        "--controller",
        "false",
    ]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return process, f"http://127.0.0.1:{port}"


def served_requests(url: str) -> float:
    text = httpx2.get(url + "/metrics", timeout=5).text
    return sum(
        s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == "dflash_requests_total"
    )


def test_gateway_spreads_load_and_survives_a_killed_replica(served_pair_dirs, tmp_path):
    target, draft = served_pair_dirs
    processes: list[subprocess.Popen] = []
    try:
        replicas = []
        for _ in range(2):
            process, url = start_replica(target, draft)
            processes.append(process)
            replicas.append(url)
        for url in replicas:  # the gateway registers only workers that answer at its start
            wait_until(lambda url=url: answers(url + "/ready"), seconds=120)
        gateway_port, gateway_metrics = free_port(), free_port()
        gateway = subprocess.Popen(
            [
                str(SMG),
                "launch",
                "--host",
                "127.0.0.1",
                "--port",
                str(gateway_port),
                "--worker-urls",
                *replicas,
                "--policy",
                "round_robin",
                "--prometheus-host",
                "127.0.0.1",
                "--prometheus-port",
                str(gateway_metrics),
                "--health-check-interval-secs",
                "1",
                "--health-failure-threshold",
                "1",
                "--retry-max-retries",
                "5",
                "--worker-startup-check-interval",
                "1",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        processes.append(gateway)
        gateway_url = f"http://127.0.0.1:{gateway_port}"
        wait_until(lambda: answers(gateway_url + "/readiness"), seconds=60)

        with PrometheusServer(tmp_path, replicas, scrape_interval="500ms") as prometheus:
            registry = CollectorRegistry()
            loop = ControllerLoop(
                lambda now: query_prometheus(prometheus.url, now),
                push_to_replicas(lambda: discover_replicas(prometheus.url, 'up{job="dflash"}'), "k"),
                ControllerSettings(max_block_size=4, min_steps=5.0),
                4,
                ControllerMetrics(registry),
                interval_s=1.0,
                repush_s=2.0,
            )
            loop.start()
            client = openai.OpenAI(base_url=gateway_url + "/v1", api_key="x", max_retries=0, timeout=120)
            results, errors, done = [], [], threading.Event()

            def worker(first: int) -> None:
                for i in range(first, REQUESTS, CONCURRENCY):
                    try:
                        reply = client.completions.create(
                            model="tiny", prompt=f"def f{i}(x):", max_tokens=MAX_TOKENS, temperature=0
                        )
                        results.append(reply.usage.completion_tokens)
                    except openai.OpenAIError as exc:  # a lost request: asserted below
                        errors.append(exc)
                    if len(results) >= REQUESTS // 3:
                        done.set()

            threads = [threading.Thread(target=worker, args=(i,)) for i in range(CONCURRENCY)]
            for t in threads:
                t.start()
            assert done.wait(120)
            served_before_kill = [served_requests(url) for url in replicas]
            decisions_before_kill = registry.get_sample_value("dflash_controller_decisions_total")
            processes[0].send_signal(signal.SIGKILL)  # replica 0 dies mid-load
            for t in threads:
                t.join()

            assert errors == [] and len(results) == REQUESTS  # no client request lost
            assert all(n > 0 for n in served_before_kill), served_before_kill  # load was spread
            survivor = replicas[1]
            wait_until(lambda: discover_replicas(prometheus.url, 'up{job="dflash"}') == [survivor], seconds=30)
            decisions = lambda: registry.get_sample_value("dflash_controller_decisions_total")  # noqa: E731
            wait_until(lambda: decisions() > decisions_before_kill + 2)
            loop.stop()
            assert loop.pushed is not None

            def survivor_policy() -> dict:
                return httpx2.get(survivor + "/admin/policy", headers={"authorization": "Bearer k"}).json()

            if survivor_policy() != loop.pushed.to_dict():  # the last decision's push may still be on its way
                loop.tick()
            assert survivor_policy() == loop.pushed.to_dict()
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
            process.wait(30)
