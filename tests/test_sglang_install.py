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
    AdaptiveDFlashWorker._record_step(worker, torch.tensor([4, 1]), 4, clock, True)  # commit lengths: drafts + 1
    assert not worker._pending and AcceptCounters.from_steps(worker.step_counters, 8).rows == 2
    cell = worker.step_counters.cells[(2, 4)]
    assert cell.steps == cell.graph_steps == 1 and cell.accepted_per_position == [1, 1, 1] and 0 < cell.seconds < 1


# --- f ------------------------------------------------------------------------------------------
@pytest.fixture
def published_dflash_config(plugins_loaded, server_args_kwargs, monkeypatch):
    """SGLang's process config for a DFLASH run with the b16 draft, as a scheduler has it."""
    from sglang.srt.runtime_context import get_context, reset_context

    monkeypatch.setenv(ADAPTIVE_ENV, "1")
    sa = _server_args(server_args_kwargs, "DFLASH", "cuda")
    sa.resolve_once()
    get_context().set_server_args(sa)
    yield
    reset_context()


def test_f_graph_capture_names_exist_upstream():
    from sglang.srt.managers.utils import GenerationBatchResult
    from sglang.srt.mem_cache.kv_index_translator import KVIndexTranslator
    from sglang.srt.model_executor.model_runner import ModelRunner, ModelRunnerOutput
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    assert {"attn_backend", "speculative_num_draft_tokens"} <= set(
        inspect.signature(DecodeCudaGraphRunner.__init__).parameters
    )
    assert "init_new_workspace" in inspect.signature(ModelRunner._get_attention_backend).parameters
    runner_source = Path(inspect.getfile(ModelRunner)).read_text()
    runner_attrs = (
        "init_new_workspace",
        "capture_tail_hooks",
        "decode_cuda_graph_runner",
        "eager_runner",
        "kv_index_translator",
    )
    assert all(re.search(rf"self\.{a}\s*=", runner_source) for a in runner_attrs)
    capture_source = Path(inspect.getfile(DecodeCudaGraphRunner)).read_text()
    assert "self.model_runner.capture_tail_hooks" in capture_source  # read at capture: reassigning the list works
    worker_source = Path(inspect.getfile(DFlashWorkerV2)).read_text()
    worker_attrs = (
        "_maybe_build_draft_sampler",
        "_draft_sampler",
        "draft_model_runner",
        "draft_parallel_layout",
        "selector",
        "lilicorr",
        "_is_domino",
    )
    assert all(re.search(rf"self\.{a}\b", worker_source) for a in worker_attrs)
    # What a plain step stubs: the draft runner's forward, read by the argmax path over slots 1..
    assert "draft_out = self.draft_model_runner.forward(forward_batch)" in worker_source
    assert "draft_hidden = draft_hidden.view(bs, int(self.block_size), -1)" in worker_source
    assert {"logits_output", "can_run_graph"} <= set(ModelRunnerOutput.__dataclass_fields__)
    assert "can_run_cuda_graph" in GenerationBatchResult.__dataclass_fields__
    assert callable(KVIndexTranslator.bind_and_verify_backends)


def _kernel_check(runner, out, forward_batch, num_tokens) -> None:
    """A capture hook a kernel plugin installs at load (kept in every capture)."""


class _Translator:
    def __init__(self) -> None:
        self.bound: list = []

    def bind_and_verify_backends(self, backends) -> None:
        self.bound += backends


class _Runner:
    """A model runner as graph capture reads and writes it."""

    def __init__(self, name: str) -> None:
        self.name, self.made = name, 0
        self.kv_index_translator = _Translator()
        self.attn_backend = f"{name} backend 16"
        self.init_new_workspace = False
        self.capture_tail_hooks = [_kernel_check]
        self.eager_runner = object()
        self.decode_cuda_graph_runner = None

    def _get_attention_backend(self, init_new_workspace: bool = False):
        self.init_new_workspace = init_new_workspace  # as SGLang's backend setup does
        self.made += 1
        return f"{self.name} backend {self.made}"


class _Sampler:
    def __init__(self, block: int) -> None:
        self.block, self.calls = block, 0

    def __call__(self, hidden_states, input_ids=None) -> None:
        self.calls += 1


def _stand_in_worker(monkeypatch, smallest_block: int, graph_blocks: str):
    """An ``AdaptiveDFlashWorker`` on stand-in model runners, graph runners and
    draft model (capture needs a GPU), with upstream's start-up capture replaced
    by the same on the stand-ins. Returns (worker, target runner, draft runner,
    what each capture saw)."""
    import contextlib

    import torch
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput
    from sglang.srt.runtime_context import get_spec
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    import speculative.sglang.worker as worker_module
    from speculative.policy import BlockPolicy, Turns
    from speculative.sglang.logic import BlockStateCache, StepCounters

    worker = object.__new__(worker_module.AdaptiveDFlashWorker)
    target, draft = _Runner("target"), _Runner("draft")
    seen = []

    class Graphs:  # stands for DecodeCudaGraphRunner: records what its capture read, runs the tail hooks
        def __init__(self, model_runner, *, attn_backend=None, speculative_num_draft_tokens=None):
            self.width, self.attn_backend = speculative_num_draft_tokens, attn_backend
            out = LogitsProcessorOutput(next_token_logits=None, hidden_states=torch.zeros(2, 4))
            hooks = model_runner.capture_tail_hooks
            for hook in hooks:
                hook(self, out, SimpleNamespace(input_ids=None), 2)
            seen.append(
                (
                    model_runner.name,
                    self.width,
                    get_spec().speculative_num_draft_tokens,
                    worker.block_size,
                    worker.draft_model.block_size,
                    attn_backend,
                    len(hooks),
                )
            )

    def upstream_capture(self):  # DFlashWorkerV2.init_cuda_graphs at the trained block, on the stand-ins
        self._draft_sampler = _Sampler(16)
        draft.capture_tail_hooks.append(worker_module.make_draft_sampler_capture_hook(self._draft_sampler))
        target.decode_cuda_graph_runner = Graphs(target, speculative_num_draft_tokens=16)
        draft.decode_cuda_graph_runner = Graphs(draft, speculative_num_draft_tokens=16)

    class DraftModel:
        block_size = 16

        def set_block_size(self, block: int) -> None:
            self.block_size = block

    monkeypatch.setattr(DFlashWorkerV2, "init_cuda_graphs", upstream_capture)
    monkeypatch.setattr(worker_module, "draft_pp_context", contextlib.nullcontext)  # needs torch.distributed groups
    monkeypatch.setenv("DFLASH_SERVE_GRAPH_BLOCKS", graph_blocks)
    worker.__dict__.update(
        _target_worker=SimpleNamespace(model_runner=target),
        draft_model_runner=draft,
        draft_model=DraftModel(),
        draft_parallel_layout=SimpleNamespace(tp_group=None),
        device="cpu",
        trained_block_size=16,
        block_size=16,
        block_policy=BlockPolicy.fixed(16),
        block_turns=Turns(),
        step_counters=StepCounters(),
        _pending=[],
        block_runtimes={},
        _draft_sampler=None,
        _logged_modes=set(),
        smallest_block=smallest_block,
    )
    worker._maybe_build_draft_sampler = lambda: _Sampler(worker.block_size)  # reads the block, as upstream's
    worker.__dict__.update(worker._fresh_block_state(16))
    worker.block_states = BlockStateCache(worker, worker._fresh_block_state)
    return worker, target, draft, seen


class _DecodeBatch:
    forward_mode = SimpleNamespace(is_extend=lambda: False, is_idle=lambda: False)
    is_extend_in_batch = False
    seq_lens = (7, 9)


def test_f_worker_captures_a_graph_set_per_block_and_swaps_it_per_step(published_dflash_config, monkeypatch):
    import torch
    from sglang.srt.runtime_context import get_spec
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    from speculative.policy import BlockPolicy

    worker, target, draft, seen = _stand_in_worker(monkeypatch, smallest_block=2, graph_blocks="4,8")
    worker.init_cuda_graphs()

    assert sorted(worker.block_runtimes) == [4, 8, 16]
    # Each extra set: a fresh backend, captured while SGLang's config, the worker and the draft read b.
    assert seen[2:] == [
        ("target", 4, 4, 4, 4, "target backend 1", 1),
        ("draft", 4, 4, 4, 4, "draft backend 1", 2),
        ("target", 8, 8, 8, 8, "target backend 2", 1),
        ("draft", 8, 8, 8, 8, "draft backend 2", 2),
    ]
    samplers = {b: rt.draft_sampler for b, rt in worker.block_runtimes.items()}
    assert {b: (s.block, s.calls) for b, s in samplers.items()} == {4: (4, 1), 8: (8, 1), 16: (16, 1)}
    # Afterwards everything is back at the trained block.
    trained_hooks = draft.capture_tail_hooks
    assert get_spec().speculative_num_draft_tokens == 16 and worker.block_size == 16
    assert worker.draft_model.block_size == 16 and len(trained_hooks) == 2
    assert target.attn_backend == "target backend 16" and target.decode_cuda_graph_runner.width == 16
    assert not target.init_new_workspace and worker._draft_sampler is samplers[16]
    assert target.kv_index_translator.bound == ["target backend 1", "target backend 2"]
    assert draft.kv_index_translator.bound == ["draft backend 1", "draft backend 2"]

    def upstream_step(self, batch, *args, **kwargs):  # what a decode step found active
        ran.append(
            (
                target.decode_cuda_graph_runner.width,
                draft.decode_cuda_graph_runner.width,
                draft.attn_backend,
                self._draft_sampler.block,
            )
        )
        width = self.block_size
        return SimpleNamespace(
            accept_lens=torch.tensor([1, width]),
            speculative_num_draft_tokens=width,
            can_run_cuda_graph=target.decode_cuda_graph_runner.width == width,
        )

    monkeypatch.setattr(DFlashWorkerV2, "forward_batch_generation", upstream_step)
    ran = []
    for block in (8, 6, 4, 16):  # 6 has no set of its own: B's set, eager
        worker.set_block_policy(BlockPolicy.fixed(block))
        worker.forward_batch_generation(_DecodeBatch())
    assert ran == [
        (8, 8, "draft backend 2", 8),
        (16, 16, "draft backend 16", 16),
        (4, 4, "draft backend 1", 4),
        (16, 16, "draft backend 16", 16),
    ]
    graph_steps = {b: cell.graph_steps for (_, b), cell in worker.step_counters.cells.items()}
    assert graph_steps == {8: 1, 6: 0, 4: 1, 16: 1}


def test_f_plain_steps_verify_the_anchor_alone_without_a_draft_forward(published_dflash_config, monkeypatch):
    import torch
    from sglang.srt.model_executor.model_runner import ModelRunnerOutput
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    from speculative.policy import BlockPolicy

    worker, target, draft, seen = _stand_in_worker(monkeypatch, smallest_block=1, graph_blocks="1,4")
    worker.init_cuda_graphs()
    assert sorted(worker.block_runtimes) == [1, 4, 16]
    # b = 1: a target graph set at width 1 only; the draft keeps the trained block's backend and graphs.
    assert [entry[:2] for entry in seen[2:]] == [("target", 1), ("target", 4), ("draft", 4)]
    plain, trained = worker.block_runtimes[1], worker.block_runtimes[16]
    assert plain.draft_graph_runner is trained.draft_graph_runner and plain.draft_sampler is None
    assert plain.draft_attn_backend is trained.draft_attn_backend

    def draft_forward(self, forward_batch):  # the draft model runner's own forward (a drafting step)
        return ModelRunnerOutput(logits_output=None, can_run_graph=True)

    monkeypatch.setattr(_Runner, "forward", draft_forward, raising=False)

    def upstream_step(self, batch, *args, **kwargs):  # upstream runs the draft, then verifies the block
        out = self.draft_model_runner.forward(SimpleNamespace(batch_size=2, input_ids=torch.zeros(2 * self.block_size)))
        hidden = out.logits_output.hidden_states if out.logits_output is not None else None
        # Upstream's argmax path: view [bs, b, -1], slots 1.. -> none at b = 1.
        rows = hidden.view(2, self.block_size, -1)[:, 1:].reshape(-1, hidden.shape[-1]) if hidden is not None else None
        ran.append(
            (
                self.block_size,
                target.decode_cuda_graph_runner.width,
                out.can_run_graph,
                None if rows is None else tuple(rows.shape),
                self._draft_sampler,
            )
        )
        commit_lens = [1, 1] if self.block_size == 1 else [2, 1]  # accepted drafts + 1
        return SimpleNamespace(
            accept_lens=torch.tensor(commit_lens), speculative_num_draft_tokens=self.block_size, can_run_cuda_graph=True
        )

    monkeypatch.setattr(DFlashWorkerV2, "forward_batch_generation", upstream_step)
    ran = []
    for block in (1, 4, 1):
        worker.set_block_policy(BlockPolicy.fixed(block))
        worker.forward_batch_generation(_DecodeBatch())
    assert [r[:4] for r in ran] == [(1, 1, False, (0, 1)), (4, 4, True, None), (1, 1, False, (0, 1))]
    assert ran[0][4] is None and ran[1][4].block == 4  # no draft sampler staged for a plain step
    assert "forward" not in vars(draft)  # the draft runner's own forward is back after each plain step
    cells = {b: (c.steps, c.accepted_per_position) for (_, b), c in worker.step_counters.cells.items()}
    assert cells == {1: (2, []), 4: (1, [1, 0, 0])}
    # On the real upstream: an argmax over no rows returns no tokens without touching the LM head.
    none = DFlashWorkerV2._greedy_sample_from_vocab_parallel_head(None, hidden_states=torch.empty(0, 1), lm_head=None)
    assert none.shape == (0,)
