"""Service settings: command-line flags and ``DFLASH_*`` environment variables,
from one pydantic-settings model (flags are generated from it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from speculative.bundled import DEFAULT_DRAFT, DEFAULT_TARGET


class ServeSettings(BaseSettings):
    """``dflash-serve`` configuration (env: ``DFLASH_<NAME>``)."""

    model_config = SettingsConfigDict(env_prefix="DFLASH_", frozen=True, cli_parse_args=False)

    target: Path = Field(default=DEFAULT_TARGET, description="target model directory (transformers format)")
    draft: Path | None = Field(default=DEFAULT_DRAFT, description="DFlash draft directory; none: plain decoding")
    served_model_name: str = Field(default="", description="model id in the API (default: target directory name)")
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    api_key: str | None = Field(default=None, description="require 'Authorization: Bearer <key>' when set")
    engine: str = Field(default="native", description="engine backend (service.engine.ENGINES)")
    device: str = "cpu"
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        default="auto", description="target and draft weights; auto: bf16 where it measures faster (logged at start)"
    )
    packed_linears: bool = Field(
        default=True, description="CPU: pack the target's and draft's linear weights once (oneDNN), not per call"
    )
    threads: int = Field(
        default=0, ge=0, description="CPU: intra-op threads for decoding; 0: the usable CPUs less one (at least 1)"
    )
    max_batch_size: int = Field(default=16, ge=1, description="requests decoded together")
    max_batch_slots: int = Field(
        default=16384,
        ge=0,
        description="native engine: admit a request only while the batch, padded to its longest row, holds at most "
        "this many cache slots with it (rows x longest row; a lone request always fits), and preempt the latest "
        "admitted while growing rows would pass it (resumed exactly, later); 0: no limit",
    )
    max_waiting: int = Field(default=64, ge=0, description="requests queued before 429")
    max_request_bytes: int = Field(
        default=2 * 2**20,
        ge=0,
        description="request bodies past this many bytes are refused with 413 before they are parsed; 0: no limit",
    )
    block_size: int = Field(default=0, ge=0, description="fixed block size; 0: the draft's trained block")
    branches: int = Field(
        default=4,
        ge=1,
        description="native engine: the draft's most likely tokens for the first drafted slot verified in one block "
        "(greedy and sampled requests without penalties); 1: the draft's chain alone",
    )
    lookup: int = Field(
        default=8,
        ge=0,
        description="native engine: n-gram lookup tokens copied from the request's own text, verified beside the "
        "draft in one block (greedy and sampled requests without penalties); 0: none",
    )
    lookup_table: bool = Field(
        default=True,
        description="native engine: where a greedy request's own text has no n-gram match, lookup continues from the "
        "draft's table of the target's frequent phrasing (ngram_table.safetensors beside the draft, if it ships one)",
    )
    drain_timeout_s: float = Field(default=60.0, ge=0, description="seconds to finish in-flight work on SIGTERM")
    admin_key: str | None = Field(default=None, description="enables /admin/policy with 'Bearer <key>'")
    controller: bool = Field(default=True, description="adapt the block size to load in-process")
    controller_interval_s: float = Field(default=10.0, gt=0, description="seconds between controller decisions")
    controller_trial_interval_s: float = Field(
        default=0.5, gt=0, description="seconds between decisions while a trial block is young or its bucket decodes"
    )
    profile_startup: bool = Field(default=False, description="time a few steps per batch/block size before serving")
    plain_reference_every: int = Field(
        default=64,
        ge=0,
        description="every N-th drafting step runs plain (b = 1): the achieved speedup's reference; 0: never",
    )
    prefill_chunk_tokens: int = Field(
        default=256,
        ge=0,
        description="native engine: while requests decode, prefill a longer prompt this many tokens at a time "
        "between their steps; 0: whole prompts",
    )
    release_memory_after_s: float = Field(
        default=10.0,
        ge=0,
        description="native engine: once idle this many seconds after work, give the memory freed by finished "
        "requests back to the OS (glibc's malloc_trim); 0: keep it for reuse",
    )
    sglang_args: dict[str, Any] = Field(
        default_factory=dict, description="extra sglang.Engine arguments (--engine sglang), JSON: '{\"tp_size\": 2}'"
    )

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.target.name
