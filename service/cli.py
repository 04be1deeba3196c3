"""``dflash-serve``: load the target and its DFlash draft, start the engine and
the OpenAI-compatible HTTP server (uvicorn). SIGTERM stops admitting, drains
in-flight requests, then exits."""

from __future__ import annotations

import logging
import sys

import uvicorn
from prometheus_client import generate_latest
from transformers import AutoTokenizer

from service.api.app import build_app
from service.config import ServeSettings
from service.controller.decide import ControllerSettings
from service.controller.loop import ControllerLoop, ControllerMetrics
from service.controller.profile import profile_step_times
from service.controller.source import observation_from_text
from service.engine import BlockPolicy, NativeEngine, NativeEngineConfig, engine_class
from service.metrics import Metrics
from speculative.checkpoint import load_draft
from speculative.target import TargetModel


def build_engine(settings: ServeSettings, metrics: Metrics) -> tuple[NativeEngine, object]:
    """The native engine (reporting steps to ``metrics``) and tokenizer for
    ``settings``; local files only."""
    tokenizer = AutoTokenizer.from_pretrained(str(settings.target), local_files_only=True)
    target = TargetModel.from_pretrained(settings.target, device=settings.device)
    draft = load_draft(settings.draft, device=settings.device) if settings.draft else None
    policy = BlockPolicy.fixed(settings.block_size) if settings.block_size else None
    config = NativeEngineConfig(max_batch_size=settings.max_batch_size, max_waiting=settings.max_waiting, policy=policy)
    engine = engine_class(settings.engine)(target, draft, tokenizer, config, on_step=metrics.observe_step)
    return engine, tokenizer


def in_process_controller(engine: NativeEngine, metrics: Metrics, settings: ServeSettings) -> ControllerLoop | None:
    """The controller reading this replica's own counters and setting its engine's
    policy directly (none without a draft: there is nothing to adapt)."""
    if engine.max_block_size == 1:
        return None
    return ControllerLoop(
        observe=lambda now: observation_from_text([generate_latest(metrics.registry).decode()], now),
        push=engine.set_policy,
        settings=ControllerSettings(max_block_size=engine.max_block_size),
        initial_block_size=engine.policy.block_size(1),
        metrics=ControllerMetrics(metrics.registry),
        interval_s=settings.controller_interval_s,
    )


def main(argv: list[str] | None = None) -> None:
    """Command line entry point: every ``ServeSettings`` field is a flag."""
    settings = ServeSettings(_cli_parse_args=sys.argv[1:] if argv is None else argv, _cli_kebab_case=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    metrics = Metrics()
    engine, tokenizer = build_engine(settings, metrics)
    if settings.profile_startup and engine.max_block_size > 1:
        profile_step_times(engine.session, metrics.observe_step_time, batch_sizes=(1, 2, 4, 8, settings.max_batch_size))
    controller = in_process_controller(engine, metrics, settings) if settings.controller else None
    app = build_app(settings, engine, tokenizer, metrics, controller)
    uvicorn.run(app, host=settings.host, port=settings.port, timeout_graceful_shutdown=int(settings.drain_timeout_s))


if __name__ == "__main__":
    main()
