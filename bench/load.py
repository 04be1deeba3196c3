"""``dflash-load``: a load sweep against a running OpenAI-compatible server.

For each concurrency level, ``requests`` streaming chat completions (HumanEval
or MT-Bench prompts) run with at most ``concurrency`` in flight, through the official async
OpenAI client. Reported per level: output tokens/s, TTFT and inter-chunk
latency p50/p99, end-to-end latency, the mean acceptance length the server
reports (``speculative`` field of the usage chunk; absent on other servers),
and the achieved speedup over plain decoding the server's step counters show
for the level (``service.metrics``; absent on servers without them).
``--long-prompt-words N``: beside each level's requests, one more client sends
requests with an N-word prompt back to back (``--long-max-tokens`` each, 16 by
default), and the level reports the longest gap the other streams saw and those
requests' TTFT: what one long prompt's prefill costs everyone else. With more
tokens the long request also decodes beside the others: what its long context
costs their steps.
A human table, then one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx2
import openai

from service.metrics import SpeedupCounters, counters_between, overall_achieved_speedup, speedup_counters
from speculative.bench.datasets import DATASETS

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from service.engine import Engine


@dataclass
class RequestResult:
    """Timings of one streamed request."""

    ttft: float
    gaps: list[float]
    e2e: float
    tokens: int
    rounds: int = 0  # verify rounds with drafts, as the server reports them (0: none reported)
    accepted: int = 0  # drafts accepted over those rounds
    prompt_tokens: int = 0


@dataclass
class LevelResult:
    """All requests of one concurrency level."""

    concurrency: int
    seconds: float
    results: list[RequestResult] = field(default_factory=list)
    achieved_speedup: float | None = None
    long_results: list[RequestResult] = field(default_factory=list)  # --long-prompt-words requests

    def summary(self) -> dict[str, Any]:
        gaps = sorted(g for r in self.results for g in r.gaps)
        ttfts = sorted(r.ttft for r in self.results)
        # Over all rounds, not a mean of per-request means: a looping request's few long rounds would count as
        # much as another's many short ones (12 HumanEval requests, b16: per-request mean 2.45, over rounds 1.76).
        rounds = sum(r.rounds for r in self.results)
        committed = sum(r.accepted + r.rounds for r in self.results)
        summary = {
            "concurrency": self.concurrency,
            "requests": len(self.results),
            "output_tokens_per_s": sum(r.tokens for r in self.results) / self.seconds,
            "ttft_p50_s": percentile(ttfts, 50),
            "ttft_p99_s": percentile(ttfts, 99),
            "itl_p50_s": percentile(gaps, 50),
            "itl_p99_s": percentile(gaps, 99),
            "itl_max_s": gaps[-1] if gaps else 0.0,
            "e2e_mean_s": statistics.fmean(r.e2e for r in self.results),
            "acceptance_length": committed / rounds if rounds else None,
            "achieved_speedup": self.achieved_speedup,
        }
        if self.long_results:
            summary["long_requests"] = len(self.long_results)
            summary["long_prompt_tokens"] = max(r.prompt_tokens for r in self.long_results)
            summary["long_ttft_p50_s"] = percentile(sorted(r.ttft for r in self.long_results), 50)
            summary["long_output_tokens"] = sum(r.tokens for r in self.long_results)
        return summary


def scrape_speedup_counters(url: str) -> SpeedupCounters:
    """The achieved speedup's counters on the server's ``/metrics``; none from
    a server without that page (another engine under comparison)."""
    response = httpx2.get(url.rstrip("/") + "/metrics", timeout=10)
    return speedup_counters(response.text) if response.status_code == 200 else {}


def level_speedup(before: SpeedupCounters, after: SpeedupCounters) -> float | None:
    """The achieved speedup of what the server ran between two scrapes."""
    return overall_achieved_speedup(counters_between(before, after))


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of already sorted values (0.0 when empty)."""
    if not sorted_values:
        return 0.0
    rank = max(0, min(len(sorted_values) - 1, round(q / 100 * len(sorted_values) + 0.5) - 1))
    return sorted_values[rank]


async def one_request(
    client: openai.AsyncOpenAI, model: str, prompt: str, max_tokens: int, temperature: float, penalty: float = 1.0
) -> RequestResult:
    """Stream one chat completion and time it (``penalty``: repetition_penalty,
    sent only when set, since not every server accepts it)."""
    start = time.perf_counter()
    ttft: float | None = None
    rounds = accepted = 0
    gaps: list[float] = []
    last, tokens, prompt_tokens = start, 0, 0
    stream = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=temperature,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"repetition_penalty": penalty} if penalty != 1.0 else None,
    )
    async for chunk in stream:
        now = time.perf_counter()
        if chunk.choices and chunk.choices[0].delta.content:
            if ttft is None:
                ttft = now - start
            else:
                gaps.append(now - last)
            last = now
        if chunk.usage is not None:
            tokens, prompt_tokens = chunk.usage.completion_tokens, chunk.usage.prompt_tokens
            spec = (chunk.model_extra or {}).get("speculative") or {}
            rounds, accepted = spec.get("verify_rounds", 0), spec.get("accepted_tokens", 0)
    end = time.perf_counter()
    ttft = ttft if ttft is not None else end - start
    return RequestResult(ttft, gaps, end - start, tokens, rounds, accepted, prompt_tokens)


async def run_level(
    client: openai.AsyncOpenAI,
    model: str,
    prompts: list[str],
    concurrency: int,
    max_tokens: int,
    temperature: float,
    penalty: float = 1.0,
    long_prompt: str | None = None,
    long_max_tokens: int = 16,
) -> LevelResult:
    """Send every prompt with at most ``concurrency`` requests in flight; with
    ``long_prompt``, one more client sends it back to back meanwhile, for
    ``long_max_tokens`` each (its requests are reported apart and left out of
    the level's time)."""
    gate = asyncio.Semaphore(concurrency)
    done = asyncio.Event()

    async def gated(prompt: str) -> RequestResult:
        async with gate:
            return await one_request(client, model, prompt, max_tokens, temperature, penalty)

    async def long_requests(prompt: str) -> list[RequestResult]:
        results = []
        while not done.is_set():
            results.append(await one_request(client, model, prompt, long_max_tokens, temperature))
        return results

    side = asyncio.create_task(long_requests(long_prompt)) if long_prompt else None
    start = time.perf_counter()
    results = await asyncio.gather(*(gated(p) for p in prompts))
    level = LevelResult(concurrency, time.perf_counter() - start, list(results))
    done.set()
    level.long_results = await side if side else []
    return level


def long_prompt(texts: list[str], words: int) -> str:
    """A prompt of ``words`` words: the dataset's prompts one after another,
    repeated as needed, with a request to summarise them."""
    pool = " ".join(texts).split()
    body = " ".join(pool[i % len(pool)] for i in range(words))
    return f"Summarise the following text in one sentence.\n\n{body}"


async def direct_level(
    engine: Engine,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    max_tokens: int,
    temperature: float,
    penalty: float = 1.0,
) -> LevelResult:
    """The same requests through ``engine.generate`` in-process, one at a time:
    the baseline that shows what HTTP + SSE add at concurrency 1."""
    from service.engine import GenerateRequest
    from speculative.chat import stop_token_ids, user_prompt_ids
    from speculative.sampling import SamplingParams

    level = LevelResult(concurrency=1, seconds=0.0)
    stop = stop_token_ids(tokenizer)
    for i, prompt in enumerate(prompts):
        ids = tuple(user_prompt_ids(tokenizer, [prompt])[0])
        sampling = SamplingParams(temperature, repetition_penalty=penalty)
        request = GenerateRequest(f"direct-{i}", ids, max_tokens, sampling, stop)
        start = time.perf_counter()
        ttft: float | None = None
        rounds = accepted = 0
        gaps: list[float] = []
        last, tokens = start, 0
        async for delta in engine.generate(request):
            now = time.perf_counter()
            if delta.text:
                if ttft is None:
                    ttft = now - start
                else:
                    gaps.append(now - last)
                last = now
            tokens, rounds, accepted = delta.completion_tokens, delta.spec.rounds, delta.spec.accepted
        end = time.perf_counter()
        result = RequestResult(ttft if ttft is not None else end - start, gaps, end - start, tokens, rounds, accepted)
        level.results.append(result)
        level.seconds += end - start
    return level


async def sweep(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every concurrency level in turn; returns their summaries."""
    client = openai.AsyncOpenAI(base_url=args.url.rstrip("/") + "/v1", api_key=args.api_key, max_retries=0, timeout=600)
    model = args.model or (await client.models.list()).data[0].id
    texts = [p.text for p in DATASETS[args.dataset]()]
    summaries = []
    if args.direct_target:
        from transformers import AutoTokenizer

        from service.engine import NativeEngine
        from speculative.checkpoint import load_draft
        from speculative.target import TargetModel

        tokenizer = AutoTokenizer.from_pretrained(str(args.direct_target), local_files_only=True)
        draft = load_draft(args.direct_draft) if args.direct_draft else None
        engine = NativeEngine(TargetModel.from_pretrained(args.direct_target), draft, tokenizer)
        engine.start()
        try:
            prompts = texts[: args.requests or 4]
            level = await direct_level(
                engine, tokenizer, prompts, args.max_tokens, args.temperature, args.repetition_penalty
            )
        finally:
            engine.stop()
        summaries.append({**level.summary(), "mode": "direct engine"})
        print_row(summaries[-1])
    for concurrency in args.concurrency:
        prompts = [texts[i % len(texts)] for i in range(args.requests or max(4, 2 * concurrency))]
        before = await asyncio.to_thread(scrape_speedup_counters, args.url)
        long = long_prompt(texts, args.long_prompt_words) if args.long_prompt_words else None
        level = await run_level(
            client,
            model,
            prompts,
            concurrency,
            args.max_tokens,
            args.temperature,
            args.repetition_penalty,
            long,
            args.long_max_tokens,
        )
        level.achieved_speedup = level_speedup(before, await asyncio.to_thread(scrape_speedup_counters, args.url))
        summaries.append({**level.summary(), "mode": "http"})
        print_row(summaries[-1])
    return summaries


def print_row(s: dict[str, Any]) -> None:
    """One line of the human table."""
    tau = f"{s['acceptance_length']:.2f}" if s["acceptance_length"] else "-"
    speedup = f"{s['achieved_speedup']:.2f}x" if s.get("achieved_speedup") else "-"
    print(
        f"{s['mode']:<13} {s['concurrency']:>5} {s['requests']:>5} {s['output_tokens_per_s']:>9.1f} "
        f"{s['ttft_p50_s'] * 1000:>8.0f} {s['ttft_p99_s'] * 1000:>8.0f} "
        f"{s['itl_p50_s'] * 1000:>7.1f} {s['itl_p99_s'] * 1000:>7.1f} {s['itl_max_s'] * 1000:>7.0f} "
        f"{s['e2e_mean_s']:>7.2f} {tau:>5} {speedup:>7}",
        flush=True,
    )
    if "long_requests" in s:
        print(
            f"{'':<13} + {s['long_requests']} long-prompt requests ({s['long_prompt_tokens']} prompt tokens, "
            f"{s['long_output_tokens']} output tokens in all): TTFT p50 {s['long_ttft_p50_s'] * 1000:.0f} ms",
            flush=True,
        )


def main(argv: list[str] | None = None) -> None:
    """Command line entry point."""
    parser = argparse.ArgumentParser(prog="dflash-load", description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="", help="model id (default: the server's first)")
    parser.add_argument("--api-key", default="none")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--requests", type=int, default=0, help="requests per level (default: 2 x concurrency)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--dataset", default="humaneval", choices=sorted(DATASETS), help="the requests' prompts")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--repetition-penalty", type=float, default=1.0, help="sent as an extra field when not 1")
    parser.add_argument(
        "--long-prompt-words", type=int, default=0, help="also send N-word prompts back to back during each level"
    )
    parser.add_argument(
        "--long-max-tokens", type=int, default=16, help="tokens each long-prompt request decodes beside the others"
    )
    parser.add_argument("--direct-target", type=Path, help="also run the engine in-process (no HTTP) on this target")
    parser.add_argument("--direct-draft", type=Path, help="draft for --direct-target")
    args = parser.parse_args(argv)
    columns = (
        ("conc", 5),
        ("reqs", 5),
        ("tok/s", 9),
        ("ttft50", 8),
        ("ttft99", 8),
        ("itl50", 7),
        ("itl99", 7),
        ("itlmax", 7),
    )
    header = " ".join(f"{name:>{width}}" for name, width in columns)
    print(f"{'mode':<13} {header} {'e2e':>7} {'tau':>5} {'speedup':>7}   (ms; e2e in s; speedup: achieved)")
    summaries = asyncio.run(sweep(args))
    print(json.dumps({"url": args.url, "dataset": args.dataset, "max_tokens": args.max_tokens, "levels": summaries}))


if __name__ == "__main__":
    main()
