"""The name of every Prometheus metric the service and its controller export,
and the batch-size bucket labels of the step-time histogram: the one place
these strings are spelled. ``service.metrics`` and ``service.controller``
create and read metrics by these names; ``tests/test_metric_names.py`` checks
the dashboards and docs against them.

These are the base names ``prometheus_client`` takes: a counter is exported
as ``<name>_total``, a histogram as ``<name>_bucket``, ``_sum`` and ``_count``.
"""

from __future__ import annotations

# Engine steps and acceptance (service.metrics).
VERIFY_STEPS = "dflash_verify_steps"
VERIFY_ROWS = "dflash_verify_rows"
DRAFT_TOKENS = "dflash_draft_tokens"
ACCEPTED_TOKENS = "dflash_accepted_tokens"
ACCEPTED_PER_POSITION = "dflash_accepted_tokens_per_position"
VERIFIED_PER_POSITION = "dflash_verified_tokens_per_position"
BRANCH_ACCEPTED_TOKENS = "dflash_branch_accepted_tokens"
LOOKUP_ACCEPTED_TOKENS = "dflash_lookup_accepted_tokens"
STEP_SECONDS = "dflash_step_seconds"
BLOCK_SIZE = "dflash_block_size"
# What serving steps delivered, and plain decoding's rate to compare with (the achieved speedup).
SERVED_STEP_SECONDS = "dflash_served_step_seconds"
SERVED_STEP_ROWS = "dflash_served_step_rows"
STEP_OUTPUT_TOKENS = "dflash_step_output_tokens"
PROFILE_STEP_SECONDS = "dflash_profile_step_seconds"
PROFILE_STEP_ROWS = "dflash_profile_step_rows"
PREFILL_SECONDS = "dflash_prefill_seconds"
# Requests (service.metrics).
RUNNING_REQUESTS = "dflash_running_requests"
WAITING_REQUESTS = "dflash_waiting_requests"
PROMPT_TOKENS = "dflash_prompt_tokens"
GENERATION_TOKENS = "dflash_generation_tokens"
REQUESTS = "dflash_requests"
REFUSED_REQUESTS = "dflash_refused_requests"
PREEMPTIONS = "dflash_preemptions"
TIME_TO_FIRST_TOKEN = "dflash_time_to_first_token_seconds"
INTER_TOKEN_LATENCY = "dflash_inter_token_latency_seconds"
E2E_REQUEST_LATENCY = "dflash_e2e_request_latency_seconds"
# The controller's decisions (service.controller.loop).
CONTROLLER_BLOCK_SIZE = "dflash_controller_block_size"
CONTROLLER_GOODPUT = "dflash_controller_goodput"
CONTROLLER_DECISIONS = "dflash_controller_decisions"
CONTROLLER_ERRORS = "dflash_controller_errors"

METRIC_NAMES = frozenset(
    {
        VERIFY_STEPS,
        VERIFY_ROWS,
        DRAFT_TOKENS,
        ACCEPTED_TOKENS,
        ACCEPTED_PER_POSITION,
        VERIFIED_PER_POSITION,
        BRANCH_ACCEPTED_TOKENS,
        LOOKUP_ACCEPTED_TOKENS,
        STEP_SECONDS,
        BLOCK_SIZE,
        SERVED_STEP_SECONDS,
        SERVED_STEP_ROWS,
        STEP_OUTPUT_TOKENS,
        PROFILE_STEP_SECONDS,
        PROFILE_STEP_ROWS,
        PREFILL_SECONDS,
        RUNNING_REQUESTS,
        WAITING_REQUESTS,
        PROMPT_TOKENS,
        GENERATION_TOKENS,
        REQUESTS,
        REFUSED_REQUESTS,
        PREEMPTIONS,
        TIME_TO_FIRST_TOKEN,
        INTER_TOKEN_LATENCY,
        E2E_REQUEST_LATENCY,
        CONTROLLER_BLOCK_SIZE,
        CONTROLLER_GOODPUT,
        CONTROLLER_DECISIONS,
        CONTROLLER_ERRORS,
    }
)

# Batch-size buckets of the step-time histogram: powers of two, the last one
# open-ended (it must be a power of two too).
OPEN_BUCKET_MIN = 64


def batch_bucket(batch_size: int) -> str:
    """Power-of-two batch-size bucket label: "1", "2-3", "4-7", ..., "64+"."""
    if batch_size >= OPEN_BUCKET_MIN:
        return f"{OPEN_BUCKET_MIN}+"
    low = 1 << (batch_size.bit_length() - 1)
    return "1" if low == 1 else f"{low}-{2 * low - 1}"


BUCKETS = tuple(batch_bucket(1 << i) for i in range(OPEN_BUCKET_MIN.bit_length()))
"""Every bucket label, smallest batch first: "1", "2-3", ..., "64+"."""


def bucket_min_batch(bucket: str) -> int:
    """Smallest batch size of a bucket label ("4-7" -> 4, "64+" -> 64)."""
    return int(bucket.split("-")[0].rstrip("+"))
