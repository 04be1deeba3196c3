"""The DFlash adaptive plugin against a real SGLang 0.5.23 install (CPU only).

Runs in the separate SGLang environment (``make sglang-check``: builds it with
tests/sglang_env/make_env.sh, then runs this file there); in the project's own
environment it is skipped as a whole (no ``sglang``). Checks:
  a. the ``sglang.srt.plugins`` entry point is installed;
  b. ``load_plugins()`` registers and applies the three hooks, and adds the
     scheduler RPCs when the scheduler module is loaded (as in a scheduler process);
  c. ``--speculative-algorithm DFLASH_ADAPTIVE`` becomes upstream DFLASH before
     resolution, so upstream's DFLASH validation runs (it refuses device cpu);
  d. ``SpeculativeAlgorithm.DFLASH.create_worker`` picks ``AdaptiveDFlashWorker``
     in an adaptive run, ``DFlashWorkerV2`` otherwise;
  e. ``speculative.sglang.worker`` imports and the upstream names it relies on exist.
Models: the bundled pair under <repo>/models.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import os
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("sglang", reason="needs the SGLang CPU environment: make sglang-check")

ADAPTIVE_ENV = "DFLASH_SERVE_ADAPTIVE"
CPU_REFUSAL = r"DFLASH speculative decoding is not supported by .* on device 'cpu'"


MODELS = Path(__file__).resolve().parents[1] / "models"


@pytest.fixture(scope="module")
def plugins_loaded():
    # A scheduler process has the scheduler module loaded when it calls load_plugins().
    import sglang.srt.managers.scheduler  # noqa: F401
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.srt.plugins.hook_registry import HookRegistry

    return HookRegistry


@pytest.fixture
def server_args_kwargs():
    models = MODELS
    return {
        "model_path": str(models / "pycoder-12m"),
        "speculative_draft_model_path": str(models / "pycoder-12m-dflash-b16"),
    }


# --- a ------------------------------------------------------------------------------------------
def test_a_entry_point_installed():
    eps = {ep.name: ep for ep in importlib.metadata.entry_points(group="sglang.srt.plugins")}
    assert "dflash_adaptive" in eps, f"entry points in sglang.srt.plugins: {sorted(eps)}"
    assert eps["dflash_adaptive"].value == "speculative.sglang.plugin:register"


# --- b ------------------------------------------------------------------------------------------
def test_b_hooks_registered_and_applied(plugins_loaded):
    import pkgutil

    from speculative.sglang import plugin

    registry = plugins_loaded
    targets = {plugin.SERVER_ARGS_RESOLVE: "BEFORE", plugin.CREATE_WORKER: "AROUND", plugin.INTERNAL_STATE: "AFTER"}
    for target, kind in targets.items():
        ours = [(ht.name, h, src) for ht, h, src in registry._hooks.get(target, []) if h.__module__ == plugin.__name__]
        assert len(ours) == 1, f"{target}: {registry._hooks.get(target)}"
        assert ours[0][0] == kind
        assert ours[0][2] is not None and ours[0][2].plugin_name == "dflash_adaptive"
        assert target in registry._patched, f"{target} registered but not applied (see SGLang's log)"
        owner, attr = target.rsplit(".", 1)
        live = pkgutil.resolve_name(owner).__dict__[attr]
        assert hasattr(getattr(live, "__func__", live), "__wrapped__"), f"{target} is not wrapped"


def test_b_scheduler_rpcs(plugins_loaded):
    from sglang.srt.managers.scheduler import Scheduler

    from speculative.sglang import plugin

    assert Scheduler.dflash_set_policy is plugin._set_policy
    assert Scheduler.dflash_probe is plugin._probe


# --- c ------------------------------------------------------------------------------------------
def _server_args(kwargs, algorithm, device):
    from sglang.srt.server_args import ServerArgs

    return ServerArgs(speculative_algorithm=algorithm, device=device, **kwargs)


def test_c_adaptive_resolution_runs_upstream_dflash_checks(plugins_loaded, server_args_kwargs, monkeypatch):
    """Whatever hook does the rewrite, resolution must see DFLASH (and refuse cpu, upstream's rule)."""
    monkeypatch.delenv(ADAPTIVE_ENV, raising=False)
    sa = _server_args(server_args_kwargs, "DFLASH_ADAPTIVE", "cpu")
    with pytest.raises(ValueError) as err:
        sa.resolve_once()
    assert re.search(CPU_REFUSAL, str(err.value)), f"resolution failed elsewhere: {err.value!r}"
    assert sa.speculative_algorithm == "DFLASH"
    assert os.environ.get(ADAPTIVE_ENV) == "1"


def test_c_env_path_cpu_refused_by_upstream(plugins_loaded, server_args_kwargs, monkeypatch):
    monkeypatch.setenv(ADAPTIVE_ENV, "1")
    sa = _server_args(server_args_kwargs, "DFLASH", "cpu")
    with pytest.raises(ValueError, match=CPU_REFUSAL):
        sa.resolve_once()


def test_c_env_path_cuda_resolves_without_gpu(plugins_loaded, server_args_kwargs, monkeypatch):
    monkeypatch.setenv(ADAPTIVE_ENV, "1")
    sa = _server_args(server_args_kwargs, "DFLASH", "cuda")
    sa.resolve_once()
    from sglang.srt.arg_groups.overrides import resolving_view

    cfg = resolving_view(sa)
    assert cfg.speculative_algorithm == "DFLASH"
    assert int(cfg.speculative_num_draft_tokens) == 16  # from the b16 draft's config


# --- d ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("adaptive, expected", [("1", "AdaptiveDFlashWorker"), ("0", "DFlashWorkerV2")])
def test_d_create_worker(plugins_loaded, server_args_kwargs, monkeypatch, adaptive, expected):
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    monkeypatch.setenv(ADAPTIVE_ENV, adaptive)
    # create_worker only reads resolving_view(server_args) (and nothing from it for DFLASH),
    # so an unresolved record is enough.
    worker = SpeculativeAlgorithm.DFLASH.create_worker(_server_args(server_args_kwargs, "DFLASH", "cpu"))
    assert worker.__name__ == expected


# --- e ------------------------------------------------------------------------------------------
def test_e_worker_imports_and_subclasses_upstream():
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    from speculative.sglang.worker import AdaptiveDFlashWorker

    assert issubclass(AdaptiveDFlashWorker, DFlashWorkerV2)
    params = inspect.signature(DFlashWorkerV2.forward_batch_generation).parameters
    assert list(params)[:2] == ["self", "batch"]


def test_e_block_state_attrs_exist_upstream():
    import sglang.srt.speculative.dflash_worker_v2 as upstream

    from speculative.sglang.logic import BLOCK_STATE_ATTRS

    source = Path(upstream.__file__).read_text()
    missing = [a for a in BLOCK_STATE_ATTRS if not re.search(rf"self\.{re.escape(a)}\b", source)]
    assert not missing, f"not in {upstream.__file__}: {missing}"


def test_e_upstream_helpers_and_fields():
    from sglang.srt.managers.utils import GenerationBatchResult
    from sglang.srt.models.dflash import DFlashDraftModel
    from sglang.srt.speculative import draft_worker_common as common

    assert {"draft_token_num", "device"} <= set(inspect.signature(common.make_draft_block_spec_info).parameters)
    assert {"length", "device"} <= set(inspect.signature(common.build_block_pos_offsets).parameters)
    assert callable(getattr(DFlashDraftModel, "set_block_size", None))
    fields = getattr(GenerationBatchResult, "__dataclass_fields__", {})
    assert {"accept_lens", "speculative_num_draft_tokens"} <= set(fields)


def test_e_worker_counts_steps_and_their_time():
    import torch

    from speculative.sglang.logic import AcceptCounters, StepCounters
    from speculative.sglang.worker import AdaptiveDFlashWorker, _StepClock

    worker = SimpleNamespace(_pending=[], step_counters=StepCounters(), trained_block_size=8)
    clock = _StepClock.start("cpu")
    AdaptiveDFlashWorker._record_step(worker, torch.tensor([4, 1]), 4, clock)  # commit lengths: drafts + 1
    assert not worker._pending and AcceptCounters.from_steps(worker.step_counters, 8).rows == 2
    cell = worker.step_counters.cells[(2, 4)]
    assert cell.steps == 1 and cell.accepted_per_position == [1, 1, 1] and 0 < cell.seconds < 1
