"""A live dflash-serve app on loopback for API tests: uvicorn in a thread."""

from __future__ import annotations

import socket
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx2
import uvicorn

from service.api.app import build_app
from service.cli import in_process_controller
from service.config import ServeSettings
from service.controller.settings import ControllerSettings
from service.engine import NativeEngine, NativeEngineConfig
from service.metrics import Metrics


class LiveServer:
    """uvicorn in a thread on a free loopback port."""

    def __init__(self, app) -> None:
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        for _ in range(500):
            if self.server.started:
                port = self.server.servers[0].sockets[0].getsockname()[1]
                return f"http://127.0.0.1:{port}"
            time.sleep(0.01)
        raise RuntimeError("server did not start")

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)


StepCost = Callable[[int, int], float]  # (batch size, block size) -> seconds


def roofline(floor_s: float, knee_tokens: int, draft_s: float) -> StepCost:
    """A step cost model of a memory-bound verify turning compute-bound: a
    step reads all weights once (``floor_s``) until it verifies more than
    ``knee_tokens`` tokens, then grows with them; drafting adds ``draft_s``."""

    def cost(batch: int, block: int) -> float:
        verify = floor_s * max(1.0, batch * block / knee_tokens)
        return verify + (draft_s if block > 1 else 0.0)

    return cost


def make_server(
    model,
    step_cost: StepCost | None = None,
    controller=False,
    profile_batch_sizes=(),
    prefill_cost: float | None = None,
    **settings,
):
    """A LiveServer over a fresh engine for ``model`` = (root, target, draft,
    tokenizer); ``controller`` runs the in-process controller as
    ``dflash-serve`` does; ``profile_batch_sizes``: a start-up profile at those
    batch sizes first, as ``dflash-serve --profile-startup`` runs it.

    ``step_cost``: every engine step lasts at least ``step_cost(batch, block)``
    (the engine thread waits out the rest) and the metrics record exactly that
    cost, so what the controller measures follows the model however busy the
    machine is (the real steps must stay cheaper than the model);
    ``prefill_cost`` does the same for every prefill."""
    root, target, draft, tokenizer = model
    engine_keys = ("max_batch_size", "max_waiting", "plain_reference_every", "max_batch_slots")
    engine_config = {k: settings[k] for k in engine_keys if k in settings}  # the settings keep them too
    metrics = Metrics()

    def on_step(stats, seconds, output_tokens):
        if step_cost is not None:
            modeled = step_cost(stats.batch_size, stats.block_size)
            time.sleep(max(0.0, modeled - seconds))
            seconds = modeled
        metrics.observe_step(stats, seconds, output_tokens)

    def on_prefill(batch_size, seconds):
        if prefill_cost is not None:
            time.sleep(max(0.0, prefill_cost - seconds))
            seconds = prefill_cost
        metrics.observe_prefill(batch_size, seconds)

    engine = NativeEngine(
        target,
        draft,
        tokenizer,
        NativeEngineConfig(**engine_config),
        on_step=on_step,
        on_prefill=on_prefill,
        on_preempt=metrics.observe_preemptions,
    )
    metrics.declare_blocks(ControllerSettings(max_block_size=engine.max_block_size).allowed)
    for stats, seconds in engine.profile_steps(profile_batch_sizes, steps=4) if profile_batch_sizes else ():
        metrics.observe_profile_step(
            stats, seconds if step_cost is None else step_cost(stats.batch_size, stats.block_size)
        )
    serve_settings = ServeSettings(target=root / "target", draft=None, **settings)
    loop = in_process_controller(engine, metrics, serve_settings) if controller else None
    return LiveServer(build_app(serve_settings, engine, tokenizer, metrics, loop)), engine


class PrometheusServer:
    """A real ``prometheus`` process on a free loopback port scraping ``targets``
    every ``scrape_interval``; ``stop``/``start`` to test outages."""

    def __init__(
        self, workdir: Path, targets: list[str], scrape_interval: str = "1s", labels: dict[str, str] | None = None
    ) -> None:
        listed = ", ".join(f'"{u.removeprefix("http://")}"' for u in targets)
        pairs = ", ".join(f"{k}: {v}" for k, v in (labels or {}).items())
        extra = f"\n        labels: {{{pairs}}}" if pairs else ""
        config = workdir / "prometheus.yml"
        config.write_text(
            f"global:\n  scrape_interval: {scrape_interval}\nscrape_configs:\n  - job_name: dflash\n"
            f"    static_configs:\n      - targets: [{listed}]{extra}\n"
        )
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.command = [
            "prometheus",
            f"--config.file={config}",
            f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ]
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(self.command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_until(lambda: answers(self.url + "/-/ready"))

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(30)

    def __enter__(self) -> PrometheusServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(30)


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


def answers(url: str) -> bool:
    try:
        return httpx2.get(url, timeout=1).status_code == 200
    except httpx2.TransportError:
        return False
