"""``dflash-sweep``: the adaptive block size against fixed ones under load.

For each mode (``fixed:B``: ``--block-size B --controller false``;
``adaptive``: the in-process controller, seeded by the start-up profile) one
``dflash-serve`` process serves the same concurrency sweep of ``dflash-load``
requests, after a warm-up pass over the same levels (the controller learns
while serving, as in production; every mode gets the same warm-up).

All servers run for the whole sweep and the modes take turns level by level
(the first mode rotates with the level and the pass, so over an even number of
passes each mode runs a level first as often as second, and drift within a
level's turns cancels instead of always favouring one mode): on shared
machines throughput drifts by up to 2x within minutes (two identical
back-to-back runs on our 2-core VM: 43.0 and 81.7 tok/s), so a sweep that ran
one mode after the other compared modes measured minutes apart. Idle servers
use no CPU.
Output: a table of output tokens/s per mode and concurrency with
adaptive / best fixed per level and adaptive / fixed-b16 averaged over the
sweep, the adaptive server's engine time per block size at each level (from
its ``dflash_step_seconds`` counters, scraped around every level), one JSON
line, and a PNG plot.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx2
import openai

from bench.load import level_speedup, run_level, scrape_speedup_counters
from service.controller.estimates import Observation
from service.controller.source import scrape_replicas
from speculative.bench.datasets import DATASETS
from speculative.bundled import DEFAULT_DRAFT, DEFAULT_TARGET
from speculative.config import DFlashConfig


@dataclass(frozen=True)
class Mode:
    """One server configuration of the sweep."""

    name: str
    flags: tuple[str, ...]

    @classmethod
    def parse(cls, text: str, controller_interval_s: float) -> Mode:
        if text == "adaptive":
            interval = str(controller_interval_s)
            return cls(text, ("--controller", "true", "--controller-interval-s", interval, "--profile-startup", "true"))
        kind, _, block = text.partition(":")
        if kind != "fixed" or not block.isdigit() or int(block) < 1:
            raise argparse.ArgumentTypeError(f"mode must be 'adaptive' or 'fixed:B', got {text!r}")
        # The profile gives a server that never runs b = 1 its plain-decoding rate (the achieved speedup's reference).
        profile = ("--profile-startup", "true") if int(block) > 1 else ()
        return cls(text, ("--block-size", block, "--controller", "false", *profile))


def default_modes(block_size: int) -> list[str]:
    """Plain decoding, every power-of-two block up to the draft's trained
    ``block_size`` and that block itself, and the adaptive policy."""
    blocks = [b for b in (2, 4, 8, 16, 32) if b < block_size] + ([block_size] if block_size > 1 else [])
    return ["fixed:1", *(f"fixed:{b}" for b in blocks), "adaptive"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def start_server(mode: Mode, args: argparse.Namespace) -> tuple[subprocess.Popen[bytes], str]:
    """``dflash-serve`` for ``mode``, ready to serve."""
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "service.cli",
        "--target",
        str(args.target),
        "--draft",
        str(args.draft),
        "--port",
        str(port),
        "--max-batch-size",
        str(args.max_batch_size),
        *mode.flags,
    ]
    if args.server_logs:
        args.server_logs.mkdir(parents=True, exist_ok=True)
        log = (args.server_logs / f"{mode.name.replace(':', '-')}.log").open("w")
    else:
        log = contextlib.nullcontext(subprocess.DEVNULL)
    with log as stream:  # the child keeps its own handle
        process = subprocess.Popen(command, stdout=stream, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"dflash-serve ({mode.name}) exited with {process.returncode}")
        try:
            if httpx2.get(url + "/ready", timeout=1).status_code == 200:
                return process, url
        except httpx2.TransportError:
            pass
        time.sleep(0.2)
    process.kill()
    raise TimeoutError(f"dflash-serve ({mode.name}) did not become ready")


def turns(modes: list[str], rotation: int) -> list[str]:
    """The order in which the modes run a level: rotated by one per level and
    per pass (``rotation`` = level index + pass index), so no mode always runs
    first (cold) or right after the same neighbour."""
    shift = rotation % len(modes)
    return modes[shift:] + modes[:shift]


async def measure(
    urls: dict[str, str], args: argparse.Namespace
) -> tuple[dict[str, list[dict[str, Any]]], list[list[str | int]]]:
    """A warm-up pass, then ``args.repeats`` measured passes, each level run by
    every mode in turn: one summary per mode and level (tokens/s averaged over
    the passes, each pass's value kept), and the (pass, concurrency, mode)
    order the levels ran in."""
    texts = [p.text for p in DATASETS[args.dataset]()]
    runs: dict[str, list[list[dict[str, Any]]]] = {name: [[] for _ in args.concurrency] for name in urls}
    order: list[list[str | int]] = []
    clients = {
        name: openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
        for name, url in urls.items()
    }
    try:
        models = {name: (await client.models.list()).data[0].id for name, client in clients.items()}
        for p, phase in enumerate(["warm-up"] + [f"measured {r + 1}" for r in range(args.repeats)]):
            per_level = args.warmup_requests_per_level if phase == "warm-up" else args.requests_per_level
            for i, concurrency in enumerate(args.concurrency):
                prompts = [texts[j % len(texts)] for j in range(max(2, per_level * concurrency))]
                for name in turns(list(urls), i + p):
                    before = await asyncio.to_thread(scrape_replicas, [urls[name]], 0.0)
                    counters = await asyncio.to_thread(scrape_speedup_counters, urls[name])
                    level = await run_level(
                        clients[name], models[name], prompts, concurrency, args.max_tokens, 0.0, args.repetition_penalty
                    )
                    after = await asyncio.to_thread(scrape_replicas, [urls[name]], 0.0)
                    level.achieved_speedup = level_speedup(
                        counters, await asyncio.to_thread(scrape_speedup_counters, urls[name])
                    )
                    order.append([phase, concurrency, name])
                    if phase != "warm-up":
                        summary = {**level.summary(), "step_seconds_by_block": step_seconds_by_block(before, after)}
                        runs[name][i].append(summary)
                        print(
                            f"{phase} c={concurrency} {name}: {summary['output_tokens_per_s']:.1f} tok/s, "
                            f"achieved speedup {summary['achieved_speedup'] or float('nan'):.2f}x, "
                            f"step time by block {block_mix(summary['step_seconds_by_block'])}",
                            flush=True,
                        )
    finally:
        for client in clients.values():
            await client.close()
    return {name: [average_passes(passes) for passes in levels] for name, levels in runs.items()}, order


def step_seconds_by_block(before: Observation, after: Observation) -> dict[int, float]:
    """Engine step seconds per block size between two scrapes of one server,
    summed over batch buckets: which blocks a level actually ran (for the
    adaptive server, how much of it went to trials and to each choice)."""
    seconds: dict[int, float] = {}
    for (bucket, b), (total, _) in after.step_seconds.items():
        spent = total - before.step_seconds.get((bucket, b), (0.0, 0.0))[0]
        if spent > 0:
            seconds[b] = seconds.get(b, 0.0) + spent
    return dict(sorted(seconds.items()))


def block_mix(seconds: dict[int, float]) -> str:
    """``{1: 3.0, 4: 1.0}`` -> ``"b1 75%, b4 25%"``."""
    total = sum(seconds.values())
    return ", ".join(f"b{b} {s / total:.0%}" for b, s in seconds.items()) if total else "none"


def average_passes(passes: list[dict[str, Any]]) -> dict[str, Any]:
    """One level's summary over repeated passes: the last pass's latencies,
    tokens/s averaged, every pass's tokens/s, and step seconds per block summed
    over the passes."""
    values = [p["output_tokens_per_s"] for p in passes]
    speedups = [p["achieved_speedup"] for p in passes if p.get("achieved_speedup")]
    blocks: dict[int, float] = {}
    for p in passes:
        for b, s in p.get("step_seconds_by_block", {}).items():
            blocks[b] = blocks.get(b, 0.0) + s
    return {
        **passes[-1],
        "output_tokens_per_s": sum(values) / len(values),
        "output_tokens_per_s_passes": values,
        "achieved_speedup": sum(speedups) / len(speedups) if speedups else None,
        "step_seconds_by_block": dict(sorted(blocks.items())),
    }


def compare(results: dict[str, list[dict[str, Any]]], levels: list[int]) -> dict[str, Any]:
    """Adaptive against the best fixed mode per level and against fixed:16."""
    fixed = [name for name in results if name.startswith("fixed:")]
    tps = {name: [level["output_tokens_per_s"] for level in summaries] for name, summaries in results.items()}
    speedups = {name: [level.get("achieved_speedup") for level in summaries] for name, summaries in results.items()}
    out: dict[str, Any] = {"tokens_per_s": tps, "achieved_speedup": speedups, "concurrency": levels}
    if "adaptive" in tps and fixed:
        best = [max(tps[name][i] for name in fixed) for i in range(len(levels))]
        out["adaptive_vs_best_fixed"] = [a / b for a, b in zip(tps["adaptive"], best, strict=True)]
        if "fixed:16" in tps:
            ratios = [a / b for a, b in zip(tps["adaptive"], tps["fixed:16"], strict=True)]
            out["adaptive_vs_fixed16_mean"] = sum(ratios) / len(ratios)
    return out


def plot(comparison: dict[str, Any], path: Path, title: str) -> None:
    """Output tokens/s against concurrency, one line per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, values in comparison["tokens_per_s"].items():
        ax.plot(comparison["concurrency"], values, marker="o", label=name, linewidth=2.5 if name == "adaptive" else 1)
    ax.set_xscale("log", base=2)
    ax.set_xticks(comparison["concurrency"], [str(c) for c in comparison["concurrency"]])
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tokens/s")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    """Command line entry point."""
    parser = argparse.ArgumentParser(prog="dflash-sweep", description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=Path, default=DEFAULT_TARGET)
    parser.add_argument("--draft", type=Path, default=DEFAULT_DRAFT)
    parser.add_argument(
        "--modes", nargs="+", help="fixed:B or adaptive (default: fixed:1, blocks up to the draft's, adaptive)"
    )
    parser.add_argument("--dataset", default="humaneval", choices=sorted(DATASETS), help="the requests' prompts")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--requests-per-level", type=int, default=2, help="measured requests = this x concurrency")
    parser.add_argument(
        "--warmup-requests-per-level", type=int, default=2, help="warm-up requests = this x concurrency"
    )
    parser.add_argument("--repeats", type=int, default=1, help="measured passes; tokens/s averaged over them")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--controller-interval-s", type=float, default=2.0)
    parser.add_argument("--plot", type=Path, help="write the PNG here")
    parser.add_argument(
        "--server-logs",
        type=Path,
        help="write each server's log here (MODE.log; the adaptive one logs every policy change with its reasons)",
    )
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    names = args.modes or default_modes(DFlashConfig.from_file(args.draft).block_size)
    modes = [Mode.parse(m, args.controller_interval_s) for m in names]
    processes: list[subprocess.Popen[bytes]] = []
    try:
        urls = {}
        for mode in modes:
            process, urls[mode.name] = start_server(mode, args)
            processes.append(process)
        results, order = asyncio.run(measure(urls, args))
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(120)
    comparison = compare(results, args.concurrency)
    print(f"{'concurrency':<12}" + "".join(f"{c:>9}" for c in args.concurrency))
    for name, values in comparison["tokens_per_s"].items():
        print(f"{name:<12}" + "".join(f"{v:>9.1f}" for v in values))
    if "adaptive_vs_best_fixed" in comparison:
        print(f"{'adapt/best':<12}" + "".join(f"{r:>9.2f}" for r in comparison["adaptive_vs_best_fixed"]))
    print("achieved speedup over plain decoding (the servers' own step counters):")
    for name, values in comparison["achieved_speedup"].items():
        print(f"{name:<12}" + "".join(f"{v:>8.2f}x" if v else f"{'-':>9}" for v in values))
    if "adaptive" in results:
        for concurrency, level in zip(args.concurrency, results["adaptive"], strict=True):
            print(f"adaptive c={concurrency}: step time by block {block_mix(level['step_seconds_by_block'])}")
    if "adaptive_vs_fixed16_mean" in comparison:
        print(f"adaptive / fixed:16, mean over the sweep: {comparison['adaptive_vs_fixed16_mean']:.2f}")
    if args.plot:
        plot(comparison, args.plot, f"{args.target.name}: fixed vs adaptive block size")
    print(json.dumps({"comparison": comparison, "levels": results, "order": order}))


if __name__ == "__main__":
    main()
