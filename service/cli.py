"""``dflash-serve``: load the target and its DFlash draft, start the engine and
the OpenAI-compatible HTTP server (uvicorn). SIGTERM stops admitting, drains
in-flight requests, then exits."""

from __future__ import annotations

import logging
import sys

import uvicorn
from transformers import AutoTokenizer

from service.api.app import build_app
from service.config import ServeSettings
from service.engine import BlockPolicy, NativeEngine, NativeEngineConfig
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
    return NativeEngine(target, draft, tokenizer, config, on_step=metrics.observe_step), tokenizer


def main(argv: list[str] | None = None) -> None:
    """Command line entry point: every ``ServeSettings`` field is a flag."""
    settings = ServeSettings(_cli_parse_args=sys.argv[1:] if argv is None else argv, _cli_kebab_case=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    metrics = Metrics()
    engine, tokenizer = build_engine(settings, metrics)
    app = build_app(settings, engine, tokenizer, metrics)
    uvicorn.run(app, host=settings.host, port=settings.port, timeout_graceful_shutdown=int(settings.drain_timeout_s))


if __name__ == "__main__":
    main()
