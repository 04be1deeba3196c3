"""Engines behind the API. ``ENGINES`` maps a name to its class, imported only
when chosen (the SGLang engine pulls in CUDA-only packages)."""

import importlib

from service.engine.native import NativeEngine
from service.engine.native_config import NativeEngineConfig
from service.engine.types import (
    BlockPolicy,
    Delta,
    Engine,
    EngineError,
    EngineStats,
    EngineStoppedError,
    GenerateRequest,
    InvalidRequestError,
    QueueFullError,
    SpecStats,
)

ENGINES = {
    "native": "service.engine.native:NativeEngine",
    "sglang": "service.engine.sglang:SGLangEngine",
}


def engine_class(name: str) -> type[Engine]:
    """The engine class registered as ``name``."""
    if name not in ENGINES:
        raise ValueError(f"unknown engine {name!r}; known: {sorted(ENGINES)}")
    module, _, attr = ENGINES[name].partition(":")
    cls: type[Engine] = getattr(importlib.import_module(module), attr)
    return cls


__all__ = [
    "ENGINES",
    "BlockPolicy",
    "Delta",
    "Engine",
    "EngineError",
    "EngineStats",
    "EngineStoppedError",
    "GenerateRequest",
    "InvalidRequestError",
    "NativeEngine",
    "NativeEngineConfig",
    "QueueFullError",
    "SpecStats",
    "engine_class",
]
