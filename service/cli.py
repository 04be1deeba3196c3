"""``dflash-serve``: load the target and its DFlash draft, start the engine and
the OpenAI-compatible HTTP server (uvicorn). SIGTERM drains while still
listening (new requests get 503, in-flight ones finish, up to
``drain_timeout_s``), ends what is left with an error event, then exits."""

from __future__ import annotations

import logging
import math
import signal
import sys
import threading
from types import FrameType

import uvicorn
from transformers import AutoTokenizer

from service.api.app import build_app
from service.config import ServeSettings
from service.controller.loop import ControllerLoop, ControllerMetrics
from service.controller.settings import ControllerSettings
from service.controller.source import observation_from_collectors
from service.engine import Engine, engine_class
from service.metrics import Metrics


def build_engine(settings: ServeSettings, metrics: Metrics) -> tuple[Engine, object]:
    """The engine chosen by ``--engine`` (steps reported to ``metrics``) and the
    target's tokenizer; local files only."""
    tokenizer = AutoTokenizer.from_pretrained(str(settings.target), local_files_only=True)
    return engine_class(settings.engine).from_settings(settings, tokenizer, metrics), tokenizer


def in_process_controller(
    engine: Engine, metrics: Metrics, settings: ServeSettings, decision: ControllerSettings | None = None
) -> ControllerLoop | None:
    """The controller reading this replica's own counters and setting its engine's
    policy directly (none without a draft: there is nothing to adapt)."""
    if engine.max_block_size == 1:
        return None
    return ControllerLoop(
        observe=lambda now: observation_from_collectors(metrics.controller_inputs(), now),
        push=engine.set_policy,
        settings=decision or ControllerSettings(max_block_size=engine.max_block_size),
        initial_block_size=engine.policy.block_size(1),
        metrics=ControllerMetrics(metrics.registry),
        interval_s=settings.controller_interval_s,
        trial_interval_s=settings.controller_trial_interval_s,
        counters_from_zero=True,
    )


class DrainingServer(uvicorn.Server):
    """uvicorn that drains before it stops listening. The first SIGTERM or
    SIGINT stops the engine admitting (new requests: 503 with Retry-After,
    ``/ready``: 503) while in-flight requests finish, for up to
    ``drain_timeout_s``; then the engine aborts what is left (open streams end
    with an error event and ``[DONE]``) and uvicorn shuts down as usual. A
    second SIGINT exits at once."""

    def __init__(self, config: uvicorn.Config, engine: Engine, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.engine, self.drain_timeout_s = engine, drain_timeout_s
        self.draining: threading.Thread | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.draining is not None:
            if sig == signal.SIGINT:
                super().handle_exit(sig, frame)
            return
        self._captured_signals.append(sig)  # uvicorn re-raises it after shutdown
        self.draining = threading.Thread(target=self._drain, name="dflash-drain", daemon=True)
        self.draining.start()

    def _drain(self) -> None:
        self.engine.stop(drain=True, timeout=self.drain_timeout_s)
        self.engine.stop(drain=False, timeout=30.0)
        self.should_exit = True


def main(argv: list[str] | None = None) -> None:
    """Command line entry point: every ``ServeSettings`` field is a flag."""
    # pydantic-settings takes its source options as init keywords that the typed
    # signature (the model's fields) does not list.
    settings = ServeSettings(_cli_parse_args=sys.argv[1:] if argv is None else argv, _cli_kebab_case=True)  # type: ignore[call-arg]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    metrics = Metrics()
    engine, tokenizer = build_engine(settings, metrics)
    decision = ControllerSettings(max_block_size=engine.max_block_size)
    metrics.declare_blocks(decision.allowed)
    if settings.profile_startup and engine.max_block_size > 1:
        # As many steps per cell as the controller needs to trust a step time.
        batch_sizes = sorted({b for b in (1, 2, 4, 8, 16) if b < settings.max_batch_size} | {settings.max_batch_size})
        for stats, seconds in engine.profile_steps(batch_sizes, math.ceil(decision.min_steps)) or ():
            metrics.observe_profile_step(stats, seconds)
    controller = in_process_controller(engine, metrics, settings, decision) if settings.controller else None
    app = build_app(settings, engine, tokenizer, metrics, controller)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, timeout_graceful_shutdown=5)
    DrainingServer(config, engine, settings.drain_timeout_s).run()


if __name__ == "__main__":
    main()
