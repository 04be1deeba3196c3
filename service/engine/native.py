"""The embedded engine: a scheduler thread with continuous batching over a
``DecodeSession`` (target + DFlash draft, CPU or GPU).

Every iteration of the scheduler loop:
  1. drop aborted rows, admit waiting requests up to ``max_batch_size`` (their
     prefill is one forward; they join the running batch);
  2. pick ONE block size for the step from the policy and the batch size;
  3. run ONE round (one draft forward, one target forward) for every row;
  4. hand each request its new tokens (text with stop strings, token ids, stats),
     finish and free the rows that are done.
Requests talk to the thread through a bounded waiting queue and per-request
asyncio queues fed with ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import math
import threading
import time
from collections.abc import AsyncIterator, Hashable, Sequence
from dataclasses import dataclass, field

import torch

from service.config import ServeSettings
from service.engine.heap import heap_release
from service.engine.native_config import NativeEngineConfig, decode_threads, usable_cpus
from service.engine.profile import profile_step_times
from service.engine.slots import fits, preempted
from service.engine.text import Decoder, TextStream
from service.engine.types import (
    BlockPolicy,
    Delta,
    EngineStats,
    EngineStoppedError,
    GenerateRequest,
    InvalidRequestError,
    QueueFullError,
    SpecStats,
    check_fits,
)
from service.metrics import Metrics
from speculative.batch import prefill_groups
from speculative.checkpoint import load_draft
from speculative.decode import cut_at_stop
from speculative.draft import DFlashDraftModel
from speculative.grammar import Grammar, compiler_for
from speculative.logprobs import TokenLogprob
from speculative.policy import Turns, check_policy
from speculative.precision import choose_dtype
from speculative.session import DecodeSession, PartialPrefill, PreemptedRow, RoundStats
from speculative.target import TargetModel

log = logging.getLogger(__name__)


@dataclass
class _Job:
    """A request inside the engine."""

    request: GenerateRequest
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue[Delta]
    text: TextStream
    generated: int = 0
    spec: SpecStats = field(default_factory=SpecStats)
    aborted: bool = False
    admitted: int = 0  # first admission's order (0: not yet): the latest admitted is preempted first
    preempted: PreemptedRow | None = None  # taken out of the batch to make room, waiting to resume

    @property
    def width(self) -> int:
        """Cache slots its row holds (or will on joining): its prompt and the tokens it generated."""
        return len(self.request.prompt_ids) + self.generated

    def send(self, delta: Delta) -> None:
        self.loop.call_soon_threadsafe(self.out.put_nowait, delta)


class NativeEngine:
    """Continuous-batching DFlash engine on a scheduler thread."""

    def __init__(
        self,
        target: TargetModel,
        draft: DFlashDraftModel | None,
        tokenizer: Decoder,
        config: NativeEngineConfig | None = None,
        on_step: collections.abc.Callable[[RoundStats, float, int], None] | None = None,
        on_prefill: collections.abc.Callable[[int, float], None] | None = None,
        on_preempt: collections.abc.Callable[[int], None] | None = None,
    ) -> None:
        config = config or NativeEngineConfig()
        # Structured output (``SamplingParams.grammar``); None where the tokenizer is not a fast one.
        self.grammars = compiler_for(tokenizer, target.vocab_size)
        self.session = DecodeSession(
            target,
            draft,
            proposal=config.proposal,
            compact_slack=config.compact_slack,
            branches=config.branches,
            lookup=config.lookup,
            lookup_table=config.lookup_table,
            grammars=self.grammars,
        )
        self.target, self.tokenizer, self.config = target, tokenizer, config
        self.on_step, self.on_prefill, self.on_preempt = on_step, on_prefill, on_preempt
        self._policy = config.policy or BlockPolicy.fixed(self.session.max_block_size)
        check_policy(self._policy, self.session.max_block_size)
        self._waiting: collections.deque[_Job] = collections.deque()
        self._running: dict[Hashable, _Job] = {}  # by request id: the session's row key
        self._chunking: collections.deque[tuple[_Job, PartialPrefill]] = collections.deque()  # long prompts
        self._prefilling = 0  # admitted, not yet running: they count against the queue limit
        self._admissions = itertools.count(1)
        self._lock = threading.Condition()
        self._draining = False
        self._stopped = False
        self._last_block = self._policy.block_size(1)
        self._turns = Turns()
        self._drafting_steps = 0
        self._release_heap = heap_release()
        self._worked = False  # since the heap was last given back
        self._thread = threading.Thread(target=self._run, name="dflash-scheduler", daemon=True)

    @classmethod
    def from_settings(cls, settings: ServeSettings, tokenizer: Decoder, metrics: Metrics) -> NativeEngine:
        """Load the target and draft named in ``settings``; steps go to ``metrics``."""
        precision = choose_dtype(settings.dtype, settings.device)
        log.info("dtype %s (%s: %s)", precision.name, settings.dtype, precision.reason)
        target = TargetModel.from_pretrained(
            settings.target, dtype=precision.dtype, device=settings.device, packed=settings.packed_linears
        )
        log.info("linears: %s", target.packing)
        draft = (
            load_draft(settings.draft, dtype=precision.dtype, device=settings.device, packed=settings.packed_linears)
            if settings.draft
            else None
        )
        policy = BlockPolicy.fixed(settings.block_size) if settings.block_size else None
        threads = decode_threads(settings.threads, usable_cpus()) if settings.device == "cpu" else 0
        log.info("decode threads: %s", threads or "torch's default")
        if draft is not None:
            table = draft.ngram_table if settings.lookup_table else None
            log.info(
                "first-slot branches: %d, n-gram lookup tokens: %d, from the draft's n-gram table: %s",
                settings.branches,
                settings.lookup,
                f"{len(table)} contexts" if table is not None and settings.lookup else "no",
            )
        config = NativeEngineConfig(
            settings.max_batch_size,
            settings.max_waiting,
            policy,
            plain_reference_every=settings.plain_reference_every,
            threads=threads,
            branches=settings.branches,
            lookup=settings.lookup,
            lookup_table=settings.lookup_table,
            prefill_chunk=settings.prefill_chunk_tokens,
            max_batch_slots=settings.max_batch_slots,
            release_memory_after_s=settings.release_memory_after_s,
        )
        return cls(
            target,
            draft,
            tokenizer,
            config,
            on_step=metrics.observe_step,
            on_prefill=metrics.observe_prefill,
            on_preempt=metrics.observe_preemptions,
        )

    # ------------------------------------------------------------------ control

    def start(self) -> None:
        """Start the scheduler thread."""
        self._thread.start()

    def stop(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop admitting; with ``drain`` finish in-flight and waiting requests
        first, else abort them. Blocks until the thread ends (or ``timeout``)."""
        with self._lock:
            self._draining = self._stopped = True
            if not drain:
                for job in self._admitted_jobs():
                    job.aborted = True
            self._lock.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def policy(self) -> BlockPolicy:
        """The block-size policy in force."""
        with self._lock:
            return self._policy

    def set_policy(self, policy: BlockPolicy) -> None:
        """Use ``policy`` from the next step on."""
        check_policy(policy, self.session.max_block_size)
        with self._lock:
            self._policy = policy

    def stats(self) -> EngineStats:
        """Running and waiting requests, the last step's block size, draining."""
        with self._lock:
            running = len(self._running) + self._prefilling
            return EngineStats(running, len(self._waiting), self._last_block, self._draining)

    @property
    def max_block_size(self) -> int:
        """Largest block size the draft allows (1 without a draft)."""
        return self.session.max_block_size

    @property
    def context_length(self) -> int:
        """The target's context length."""
        return self.target.context_length

    def profile_steps(self, batch_sizes: Sequence[int], steps: int) -> list[tuple[RoundStats, float]]:
        """Time ``steps`` rounds per batch size and block size on random prompts
        (``service.engine.profile``); only before ``start``, while the session is
        the caller's alone."""
        if self._thread.is_alive():
            raise RuntimeError("profile before start(): the scheduler thread owns the session")
        timed: list[tuple[RoundStats, float]] = []
        profile_step_times(
            self.session, lambda stats, seconds: timed.append((stats, seconds)), batch_sizes=batch_sizes, steps=steps
        )
        return timed

    # ----------------------------------------------------------------- requests

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Delta]:
        """Admit ``request`` and stream its deltas; leaving the iteration early
        (client gone) aborts it and frees its slot."""
        self._validate(request)
        if request.sampling.grammar is not None:
            await self._check_grammar(request.sampling.grammar)
        job = _Job(request, asyncio.get_running_loop(), asyncio.Queue(), TextStream(self.tokenizer, request.stop))
        with self._lock:
            if self._draining:
                raise EngineStoppedError("the server is shutting down")
            capacity = self.config.max_batch_size + self.config.max_waiting
            running = len(self._running) + self._prefilling
            if len(self._waiting) + running >= capacity:
                raise QueueFullError(f"{running} requests running and {len(self._waiting)} waiting")
            self._waiting.append(job)
            self._lock.notify_all()
        finished = False
        try:
            while not finished:
                delta = await job.out.get()
                finished = delta.finish_reason is not None
                yield delta
        finally:
            if not finished:
                self.abort(request.request_id)

    async def _check_grammar(self, grammar: Grammar) -> None:
        """Refuse a grammar that cannot be matched (400); compiling it here, off the
        scheduler thread, also keeps its compiled form for the row's prefill."""
        if self.grammars is None:
            raise InvalidRequestError("structured output needs a fast tokenizer", param="response_format")
        error = await asyncio.to_thread(self.grammars.check, grammar)
        if error is not None:
            raise InvalidRequestError(f"the output format cannot be matched: {error}", param="response_format")

    def abort(self, request_id: str) -> None:
        """Stop a request: a queued one leaves the queue at once (an abandoned
        request must not hold a place another could take until the batch has
        room), a running one's row is freed before the next step."""
        with self._lock:
            for job in [job for job in self._waiting if job.request.request_id == request_id]:
                self._waiting.remove(job)
                job.send(Delta("", (), "abort"))
            for job in self._admitted_jobs():
                if job.request.request_id == request_id:
                    job.aborted = True
            self._lock.notify_all()

    def _admitted_jobs(self) -> list[_Job]:
        """Every request not finished yet: waiting, prefilling in chunks, running (hold the lock)."""
        return [*self._waiting, *(job for job, _ in self._chunking), *self._running.values()]

    def _validate(self, request: GenerateRequest) -> None:
        if not request.prompt_ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        if request.max_tokens < 1:
            raise InvalidRequestError("max_tokens must be at least 1", param="max_tokens")
        check_fits(request, self.context_length, self.max_block_size)
        vocab = self.target.vocab_size
        if min(request.prompt_ids) < 0 or max(request.prompt_ids) >= vocab:
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})", param="prompt")
        if any(token >= vocab for token, _ in request.sampling.logit_bias):
            raise InvalidRequestError(f"logit_bias token ids must be in [0, {vocab})", param="logit_bias")

    # ---------------------------------------------------------------- scheduler

    def _run(self) -> None:
        if self.config.threads:
            torch.set_num_threads(self.config.threads)
        while True:
            with self._lock:
                release_memory = self._wait_for_work()
                if self._stopped and self._idle():
                    return
                admitted = [] if release_memory else self._admit()
                self._prefilling = len(admitted) + len(self._chunking)
                policy = self._policy
            if release_memory:
                self._release_idle_memory()
                continue
            self._worked = True
            try:
                self._drop_aborted()
                if admitted:
                    self._prefill(admitted)
                if self._chunking:
                    self._prefill_chunk()
                if self._running:
                    self._make_room()
                    self._step(policy)
            except Exception:  # a failure outside the isolated prefill and round must not leave requests hanging
                log.exception("scheduler iteration failed; failing its requests")
                self._fail_all(admitted)

    def _idle(self) -> bool:
        return not self._waiting and not self._running and not self._chunking

    def _wait_for_work(self) -> bool:
        """Wait (lock held) for a request or a stop. True instead when the engine
        has sat idle ``release_memory_after_s`` since it last worked: time to give
        the freed heap back (``service.engine.heap``), once per idle spell."""
        delay = self.config.release_memory_after_s
        while self._idle() and not self._stopped:
            if not (self._worked and delay and self._release_heap):
                self._lock.wait()
            elif not self._lock.wait(delay) and self._idle() and not self._stopped:
                return True
        return False

    def _release_idle_memory(self) -> None:
        """Outside the lock: a request arriving meanwhile queues at once and waits
        only for the release itself (tens of milliseconds)."""
        if self._release_heap is None:
            return
        start = time.perf_counter()
        self._release_heap()
        self._worked = False
        log.debug("idle: freed heap given back in %.1f ms", (time.perf_counter() - start) * 1e3)

    def _admit(self) -> list[_Job]:
        """Waiting requests for the batch's free places. Each place goes to the
        waiting request whose group (``GenerateRequest.group``: one API call's
        choices) has the fewest requests in the batch, the earliest on ties: a
        call's many choices share the batch with later calls instead of holding
        it until they finish. With single-request groups: first come, first served.
        The next request waits while admitting it would pad the batch's caches
        beyond ``max_batch_slots`` (``slots.fits``). Preempted requests come first, in
        the order they were first admitted, and keep that place, so a request
        admitted later is preempted before them and no new request passes them;
        each resumes once its text (prompt and generated) fits."""
        free = self.config.max_batch_size - len(self._running) - len(self._chunking)
        batch = [*self._running.values(), *(job for job, _ in self._chunking)]
        in_batch = collections.Counter(job.request.group_key for job in batch)
        widths = [job.width for job in batch]
        admitted = []
        while self._waiting and free > 0:
            job = min(self._waiting, key=lambda w: (w.admitted or math.inf, in_batch[w.request.group_key]))
            if not job.aborted and not fits([*widths, job.width], *self._slot_budget):
                break
            self._waiting.remove(job)
            if job.aborted:
                job.send(Delta("", (), "abort"))
                continue
            widths.append(job.width)
            job.admitted = job.admitted or next(self._admissions)
            admitted.append(job)
            in_batch[job.request.group_key] += 1
            free -= 1
        return admitted

    @property
    def _slot_budget(self) -> tuple[int, int]:
        """``slots.fits``' budget and growth: ``max_batch_slots``, and the largest block a round appends."""
        return self.config.max_batch_slots, self.session.max_block_size

    def _make_room(self) -> None:
        """Preempt the latest admitted requests while the batch (with the long
        prompts still prefilling) would pass ``max_batch_slots`` after the next
        round: rows grow as they decode, which the check at admission cannot
        bound. A running row leaves with all it decoded with
        (``DecodeSession.preempt``) and its caches freed; a prefilling prompt
        drops its chunks. Each goes back to the front of the queue in admission
        order and resumes by prefilling its text once it fits again: its
        stream pauses, its output is what it would have been. The earliest
        admitted request is never preempted, so the batch always progresses."""
        if not self.config.max_batch_slots:
            return
        with self._lock:
            held = sorted([*self._running.values(), *(job for job, _ in self._chunking)], key=lambda j: j.admitted)
            leaving = held[len(held) - preempted([job.width for job in held], *self._slot_budget) :]
        if not leaving:
            return
        rows = {job.request.request_id for job in leaving} & set(self._running)
        for key, row in self.session.preempt(list(rows)).items():
            self._running[key].preempted = row
        with self._lock:
            chunked = [job for job in leaving if job.request.request_id not in rows]
            self._chunking = collections.deque(e for e in self._chunking if all(e[0] is not j for j in chunked))
            self._prefilling -= len(chunked)
            for job in reversed(leaving):  # the earliest admitted ends up at the front
                self._running.pop(job.request.request_id, None)
                self._waiting.appendleft(job)
        log.info(
            "preempted %d request(s) to keep the batch within %d cache slots", len(leaving), self.config.max_batch_slots
        )
        if self.on_preempt is not None:
            self.on_preempt(len(leaving))

    def _prefill(self, jobs: list[_Job]) -> None:
        """Prefill ``jobs``; prompts longer than ``prefill_chunk`` go to
        ``_prefill_chunk`` instead. Prompts scored for their log-probabilities
        (``prompt_logprobs``, an echo's) are prefilled apart from the others: their
        forward computes the LM head at every position, which the others would
        otherwise pay for in their time to first token. The others go first: the
        scored ones then wait about as long as in one forward with them. Within
        each kind, prompts of very different lengths are prefilled in forwards of
        their own, shortest first (``prefill_groups``): a short prompt is not
        padded to a long one's width, and its first token does not wait for it."""
        chunk = self.config.prefill_chunk
        plain: list[_Job] = []
        scoring: list[_Job] = []
        for job in jobs:
            if job.preempted is not None or (chunk and len(job.request.prompt_ids) > chunk):
                self._start_chunked(job)
            else:
                (plain if job.request.sampling.prompt_logprobs is None else scoring).append(job)
        for kind in (plain, scoring):
            for group in prefill_groups([len(job.request.prompt_ids) for job in kind]):
                self._prefill_together([kind[i] for i in group])

    def _prefill_together(self, jobs: list[_Job]) -> None:
        """Prefill ``jobs`` in one forward. One that raises (``add`` changes
        nothing then) is retried on each half, down to single requests: only a
        request that fails on its own gets an error."""
        keys = [j.request.request_id for j in jobs]
        started = time.perf_counter()
        try:
            first = self.session.add(keys, [j.request.prompt_ids for j in jobs], [j.request.sampling for j in jobs])
        except Exception:
            if len(jobs) == 1:
                self._fail_prefill(jobs[0])
                return
            self._prefill_together(jobs[: len(jobs) // 2])
            self._prefill_together(jobs[len(jobs) // 2 :])
            return
        with self._lock:
            self._running.update(zip(keys, jobs, strict=True))
            self._prefilling -= len(jobs)
        joined = len(self.session)
        self._deliver_first(first)
        # Every running row waited for it: the achieved speedup charges it to both sides (service/metrics.py).
        if self.on_prefill is not None:
            self.on_prefill(joined, time.perf_counter() - started)

    def _fail_prefill(self, job: _Job) -> None:
        """End ``job``, whose prefill raised on its own, with an error (called inside ``except``)."""
        log.exception("request %s failed its prefill", job.request.request_id)
        with self._lock:
            self._prefilling -= 1
        job.send(Delta("", (), "error"))

    def _start_chunked(self, job: _Job) -> None:
        """Queue a long prompt for ``_prefill_chunk``, sharing the prefill of an
        identical one already queued (an API call's choices, which ask for the same
        prompt log-probabilities); only it fails if starting fails. A preempted
        request's caches are rebuilt the same way, from its text, never shared."""
        if job.preempted is not None:
            prompt, top, shared = job.preempted.tokens, None, None
        else:
            prompt, top = list(job.request.prompt_ids), job.request.sampling.prompt_logprobs
            shared = next(
                (
                    part
                    for queued, part in self._chunking
                    if queued.preempted is None and part.prompt == prompt and part.prompt_logprobs == top
                ),
                None,
            )
        try:
            part = shared or self.session.start_prefill(prompt, top)
        except Exception:
            self._fail_prefill(job)
            return
        with self._lock:
            self._chunking.append((job, part))

    def _prefill_chunk(self) -> None:
        """Prefill the next chunk of the oldest long prompt; once done, join it
        as a row for every request sharing it. Chunks even when no row decodes:
        a request may arrive meanwhile, and prefilling the rest at once kept it
        waiting up to 2.8 s (docs/LOG.md)."""
        part = self._chunking[0][1]
        sharing = [job for job, shared in self._chunking if shared is part]
        keys = [job.request.request_id for job in sharing]
        resuming = sharing[0].preempted
        started = time.perf_counter()
        first: dict[Hashable, int] = {}  # the joined rows' first tokens (a resumed row drew its next before it left)
        try:
            done = self.session.prefill_chunk(part, self.config.prefill_chunk or len(part.prompt))
            if done and resuming is not None:
                self.session.resume(part, resuming)
                sharing[0].preempted = None
            elif done:
                first = self.session.add_prefilled(keys, part, [job.request.sampling for job in sharing])
        except Exception:
            self._unqueue(part)
            for job in sharing:
                self._fail_prefill(job)
            return
        rows = len(self.session) + (0 if done else len(sharing))  # those that waited, and its own
        if done:
            self._unqueue(part)
            with self._lock:
                self._running.update(zip(keys, sharing, strict=True))
                self._prefilling -= len(sharing)
            if first:
                self._deliver_first(first)
        if self.on_prefill is not None:
            self.on_prefill(rows, time.perf_counter() - started)

    def _unqueue(self, part: PartialPrefill) -> None:
        """Take every request sharing ``part`` off the chunked-prefill queue."""
        with self._lock:
            self._chunking = collections.deque(entry for entry in self._chunking if entry[1] is not part)

    def _step(self, policy: BlockPolicy) -> None:
        b = self._turns.block_size(policy, len(self.session))
        # Only while every row is greedy: a reference step must not change any request's output.
        if b > 1 and self.config.plain_reference_every and self.session.all_greedy:
            self._drafting_steps += 1
            if self._drafting_steps % self.config.plain_reference_every == 0:
                b = 1  # a plain-decoding reference step (NativeEngineConfig.plain_reference_every)
        self._last_block = b
        started = time.perf_counter()
        rounds, failed = _step_isolating(self.session, b)
        stepping = time.perf_counter() - started
        for key in failed:
            self._running[key].send(Delta("", (), "error"))
        self._finish(failed)
        # A round costs the server more than its two forwards: cache compaction, the draft context of
        # deferred plain steps, delivering its tokens and freeing finished rows (wider caches after
        # drafting). Left out, they made drafting look 6-8 % cheaper than it was at 8-16 rows (docs/LOG.md,
        # 2026-12-04). Each round gets the step's wall time in proportion to its forwards (several rounds
        # only after a failure split the batch) and its own delivery.
        forwards = [stats.draft_seconds + stats.verify_seconds for stats, _ in rounds]
        total = sum(forwards)
        for (stats, emitted), own in zip(rounds, forwards, strict=True):
            delivering = time.perf_counter()
            output = self._deliver(emitted, stats, stats.logprobs)
            share = own / total if total else 1 / len(rounds)
            seconds = stepping * share + time.perf_counter() - delivering
            if self.on_step is not None:
                self.on_step(stats, seconds, output)

    def _deliver_first(self, first: dict[Hashable, int]) -> None:
        """Send just-prefilled rows their first tokens, with the log-probabilities of those and
        of their prompts where they asked (the session's from the ``add`` that drew them)."""
        logprobs = {key: [logprob] for key, logprob in self.session.first_logprobs.items()}
        self._deliver({key: [token] for key, token in first.items()}, None, logprobs, self.session.prompt_logprobs)

    def _deliver(
        self,
        emitted: dict[Hashable, list[int]],
        stats: RoundStats | None,
        logprobs: dict[Hashable, list[TokenLogprob]],
        prompt_logprobs: dict[Hashable, list[TokenLogprob]] | None = None,
    ) -> int:
        """Send each row its tokens (``emitted`` in the order of ``stats``' rows)
        with their ``logprobs`` (and on a first delivery ``prompt_logprobs``) where
        it asked for them; finish rows at a stop token, stop string or the length
        limit; free finished rows. Returns how many tokens the rows output (a row's
        last round may commit tokens past its end, which are not output)."""
        prompt_logprobs = prompt_logprobs or {}
        done, output = [], 0
        committed = dict(zip(emitted, stats.committed, strict=True)) if stats else {}
        for key, tokens in emitted.items():
            job = self._running[key]
            if stats is not None and stats.block_size > 1:
                job.spec = SpecStats(
                    job.spec.rounds + 1, job.spec.drafted + stats.block_size - 1, job.spec.accepted + committed[key] - 1
                )
            kept, finish = cut_at_stop(tokens, job.request.max_tokens - job.generated, job.request.stop_token_ids)
            job.generated += len(kept)
            output += len(kept)
            text = job.text.push(kept, final=finish is not None)
            if job.text.stopped:
                finish = "stop"
            scores = tuple(logprobs.get(key, ())[: len(kept)])
            prompt_scores = tuple(prompt_logprobs.get(key, ()))
            job.send(
                Delta(
                    text,
                    tuple(kept),
                    finish,
                    len(job.request.prompt_ids),
                    job.generated,
                    job.spec,
                    scores,
                    prompt_scores,
                )
            )
            if finish is not None:
                done.append(key)
        self._finish(done)
        return output

    def _drop_aborted(self) -> None:
        with self._lock:
            gone = [key for key, job in self._running.items() if job.aborted]
            dropped = [job for job, _ in self._chunking if job.aborted]
            self._chunking = collections.deque((job, part) for job, part in self._chunking if not job.aborted)
            self._prefilling -= len(dropped)
        for job in dropped:
            job.send(Delta("", (), "abort"))
        for key in gone:
            self._running[key].send(Delta("", (), "abort"))
        self._finish(gone)

    def _finish(self, keys: list[Hashable]) -> None:
        if not keys:
            return
        self.session.remove(keys)
        with self._lock:
            for key in keys:
                self._running.pop(key, None)

    def _fail_all(self, admitted: list[_Job]) -> None:
        """End every running request, those in their chunks, and those admitted in this iteration, with an error."""
        with self._lock:
            held = [*self._running.values(), *(job for job, _ in self._chunking)]
            jobs = [*held, *(j for j in admitted if all(j is not h for h in held))]
            self._running.clear()
            self._chunking.clear()
            self._prefilling = 0
        for job in jobs:
            job.send(Delta("", (), "error"))
        self.session.remove([j.request.request_id for j in jobs])  # a chunked prompt holds no row yet


Round = tuple[RoundStats, dict[Hashable, list[int]]]


def _step_isolating(session: DecodeSession, b: int) -> tuple[list[Round], list[Hashable]]:
    """One round for every row of ``session``: the rounds that ran and the rows
    that failed. A round that raises is rolled back (``DecodeSession.step``)
    and run again on each half of the rows, down to single rows, so only a row
    that fails on its own fails; the others decode exactly as they would have."""
    try:
        return [session.step(b)], []
    except Exception:
        if len(session) == 1:
            log.exception("request %s failed a decoding step", session.rows.keys[0])
            return [], list(session.rows.keys)
    part = session.split(session.rows.keys[len(session) // 2 :])
    try:
        first, failed_first = _step_isolating(session, b)
        second, failed_second = _step_isolating(part, b)
    finally:
        session.join(part)
    return first + second, failed_first + failed_second
