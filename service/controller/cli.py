"""``dflash-controller``: one controller for many replicas. It reads the
counters from a Prometheus server (``--prometheus-url``) or scrapes the
replicas' ``/metrics`` itself, and pushes the policy to every replica's
``/admin/policy``. Its own metrics are served on ``--metrics-port``."""

from __future__ import annotations

import argparse
import logging
import time

import httpx2
from prometheus_client import CollectorRegistry, start_http_server

from service.controller.decide import ControllerSettings
from service.controller.loop import ControllerLoop, ControllerMetrics
from service.controller.source import query_prometheus, scrape_replicas
from service.engine.types import BlockPolicy


def push_to_replicas(replicas: list[str], admin_key: str, timeout: float = 5.0):
    """A push function: POST the policy to every replica (raises on any failure,
    so the loop retries next tick)."""

    def push(policy: BlockPolicy) -> None:
        body = {"min_batch": list(policy.min_batch), "block_sizes": list(policy.block_sizes)}
        for url in replicas:
            response = httpx2.post(url.rstrip("/") + "/admin/policy", json=body, timeout=timeout,
                                   headers={"authorization": f"Bearer {admin_key}"})  # fmt: skip
            response.raise_for_status()

    return push


def main(argv: list[str] | None = None) -> None:
    """Command line entry point."""
    parser = argparse.ArgumentParser(prog="dflash-controller", description=__doc__.splitlines()[0])
    parser.add_argument("--replica", action="append", required=True, help="replica base URL (repeatable)")
    parser.add_argument("--admin-key", required=True, help="the replicas' --admin-key")
    parser.add_argument("--prometheus-url", help="read counters through PromQL instead of scraping replicas")
    parser.add_argument("--max-block-size", type=int, default=16, help="the draft's trained block")
    parser.add_argument("--interval-s", type=float, default=10.0)
    parser.add_argument("--half-life-s", type=float, default=60.0)
    parser.add_argument("--metrics-port", type=int, default=9400)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    registry = CollectorRegistry()
    start_http_server(args.metrics_port, registry=registry)
    if args.prometheus_url:
        observe = lambda now: query_prometheus(args.prometheus_url, now)  # noqa: E731
    else:
        observe = lambda now: scrape_replicas(args.replica, now)  # noqa: E731
    loop = ControllerLoop(
        observe,
        push_to_replicas(args.replica, args.admin_key),
        ControllerSettings(max_block_size=args.max_block_size, half_life_s=args.half_life_s),
        args.max_block_size,
        ControllerMetrics(registry),
        interval_s=args.interval_s,
    )
    loop.start()
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        loop.stop()


if __name__ == "__main__":
    main()
