"""A live dflash-serve app on loopback for API tests: uvicorn in a thread."""

import threading
import time

import uvicorn

from service.api.app import build_app
from service.config import ServeSettings
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


def make_server(model, slow_steps=False, **settings):
    """A LiveServer over a fresh engine for ``model`` = (root, target, draft,
    tokenizer); ``slow_steps`` adds 10 ms to every engine step."""
    root, target, draft, tokenizer = model
    engine_config = {k: settings.pop(k) for k in ("max_batch_size", "max_waiting") if k in settings}
    metrics = Metrics()

    def on_step(stats, seconds):
        metrics.observe_step(stats, seconds)
        if slow_steps:
            time.sleep(0.01)

    engine = NativeEngine(target, draft, tokenizer, NativeEngineConfig(**engine_config), on_step=on_step)
    app = build_app(ServeSettings(target=root / "target", draft=None, **settings), engine, tokenizer, metrics)
    return LiveServer(app), engine
