"""Engines behind the API: the embedded native DFlash engine (CPU/GPU)."""

from service.engine.native import NativeEngine, NativeEngineConfig
from service.engine.types import (
    BlockPolicy,
    Delta,
    EngineError,
    EngineStats,
    EngineStoppedError,
    GenerateRequest,
    InvalidRequestError,
    QueueFullError,
    SpecStats,
)

__all__ = [
    "BlockPolicy",
    "Delta",
    "EngineError",
    "EngineStats",
    "EngineStoppedError",
    "GenerateRequest",
    "InvalidRequestError",
    "NativeEngine",
    "NativeEngineConfig",
    "QueueFullError",
    "SpecStats",
]
