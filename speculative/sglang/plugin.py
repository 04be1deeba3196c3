"""SGLang plugin entry point (group ``sglang.srt.plugins``, see pyproject.toml).

SGLang calls ``register()`` once in every process it starts (main, each
scheduler, detokenizer). It installs, without a fork or site-packages edits:

1. ``--speculative-algorithm DFLASH_ADAPTIVE``: rewritten to upstream ``DFLASH``
   when SGLang resolves its arguments (``ServerArgs.resolve_once``, which every
   launcher calls; ``ServerArgs`` is a msgspec Struct whose ``__post_init__`` is
   bound at class creation, so a hook there never runs), so every upstream DFlash
   check and code path applies; the run is marked adaptive via
   ``DFLASH_SERVE_ADAPTIVE=1``, which the spawned schedulers inherit. Setting
   that variable with plain ``DFLASH`` does the same.
2. Worker selection: for DFlash in an adaptive run, ``AdaptiveDFlashWorker``
   instead of ``DFlashWorkerV2``.
3. Scheduler RPCs for ``Engine.collective_rpc``: ``dflash_set_policy(policy_json)``
   and ``dflash_probe()`` (raises unless the adaptive worker is running, so the
   service can tell the plugin is active: SGLang only logs plugin failures).
4. ``get_internal_state`` reports the policy and acceptance counters under
   ``dflash_adaptive``.

Nothing heavy is imported here: hooks name their targets by dotted path and the
worker module is imported when a scheduler creates its worker. SGLang's objects
(server args, algorithms, schedulers, workers) are typed ``Any`` on purpose:
SGLang is not importable where this module is type-checked.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from speculative.policy import BlockPolicy
from speculative.sglang.logic import ADAPTIVE_ENV, AcceptCounters, resolve_algorithm

log = logging.getLogger(__name__)

SERVER_ARGS_RESOLVE = "sglang.srt.server_args.ServerArgs.resolve_once"
CREATE_WORKER = "sglang.srt.speculative.spec_info.SpeculativeAlgorithm.create_worker"
INTERNAL_STATE = (
    "sglang.srt.managers.scheduler_components.internal_state.SchedulerInternalStateController._add_speculative"
)
SCHEDULER_MODULE = "sglang.srt.managers.scheduler"


def adaptive_enabled() -> bool:
    return os.environ.get(ADAPTIVE_ENV) == "1"


def register() -> None:
    """The plugin callable (no arguments, as SGLang's loader calls it)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(SERVER_ARGS_RESOLVE, rewrite_algorithm, HookType.BEFORE)
    HookRegistry.register(CREATE_WORKER, choose_worker, HookType.AROUND)
    HookRegistry.register(INTERNAL_STATE, report_state, HookType.AFTER)
    if SCHEDULER_MODULE in sys.modules:  # only processes that run (or launch) schedulers
        add_scheduler_rpcs(sys.modules[SCHEDULER_MODULE].Scheduler)


def rewrite_algorithm(server_args: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE ``ServerArgs.resolve_once``: DFLASH_ADAPTIVE -> DFLASH + adaptive."""
    name, adaptive = resolve_algorithm(getattr(server_args, "speculative_algorithm", None))
    if adaptive:
        server_args.speculative_algorithm = name
        os.environ[ADAPTIVE_ENV] = "1"
    return None


def choose_worker(original: Callable[..., Any], algorithm: Any, server_args: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``SpeculativeAlgorithm.create_worker``."""
    worker = original(algorithm, server_args, *args, **kwargs)
    if not (adaptive_enabled() and algorithm.is_dflash()):
        return worker
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    if worker is not DFlashWorkerV2:  # a platform plugin chose its own worker: leave it
        log.warning("DFlash worker %s is not DFlashWorkerV2; adaptive block size disabled", worker)
        return worker
    from speculative.sglang.worker import AdaptiveDFlashWorker

    return AdaptiveDFlashWorker


def report_state(result: Any, controller: Any, state: dict[str, Any], *args: Any, **kwargs: Any) -> None:
    """AFTER ``_add_speculative``: the policy and counters of this scheduler."""
    worker: Any = getattr(controller.scheduler, "draft_worker", None)  # an adaptive worker has block_policy
    if hasattr(worker, "block_policy"):
        state["dflash_adaptive"] = {
            "policy": worker.block_policy.to_dict(),
            "active_block_size": worker.block_states.active,
            "accept": asdict(AcceptCounters.from_steps(worker.step_counters, worker.trained_block_size)),
            "steps": worker.step_counters.to_report(),
        }
    return None


def add_scheduler_rpcs(scheduler_class: Any) -> None:
    """Methods ``Engine.collective_rpc`` can call (HookRegistry only wraps
    existing attributes, so these are set directly)."""
    scheduler_class.dflash_set_policy = _set_policy
    scheduler_class.dflash_probe = _probe


def _adaptive_worker(scheduler: Any) -> Any:
    worker = getattr(scheduler, "draft_worker", None)
    if not hasattr(worker, "set_block_policy"):
        raise RuntimeError("the DFlash adaptive worker is not running (DFLASH_ADAPTIVE / DFLASH_SERVE_ADAPTIVE=1?)")
    return worker


def _set_policy(self: Any, policy_json: str) -> None:
    _adaptive_worker(self).set_block_policy(BlockPolicy.from_json(policy_json))


def _probe(self: Any) -> None:
    _adaptive_worker(self)
