"""``dflash-controller``: one controller for many replicas. It reads the
counters from a Prometheus server (``--prometheus-url``) or scrapes the
replicas' ``/metrics`` itself, and pushes the policy to every replica's
``/admin/policy``. Its own metrics are served on ``--metrics-port``."""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Callable
from pathlib import Path

import httpx2
from prometheus_client import CollectorRegistry, start_http_server

from service.controller.estimates import Observation
from service.controller.loop import ControllerLoop, ControllerMetrics
from service.controller.settings import ControllerSettings
from service.controller.source import discover_replicas, query_prometheus, scrape_replicas
from speculative.cliflags import add_dataclass_flags, dataclass_kwargs
from speculative.policy import BlockPolicy


def push_to_replicas(
    replicas: Callable[[], list[str]], admin_key: str, timeout: float = 5.0
) -> Callable[[BlockPolicy], None]:
    """A push function: POST the policy to every replica ``replicas()`` names at
    push time (raises on any failure, so the loop retries next tick)."""

    def push(policy: BlockPolicy) -> None:
        headers = {"authorization": f"Bearer {admin_key}", "content-type": "application/json"}
        for url in replicas():
            response = httpx2.post(
                url.rstrip("/") + "/admin/policy", content=policy.to_json(), timeout=timeout, headers=headers
            )
            response.raise_for_status()

    return push


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, ControllerSettings]:
    """The command line: how to reach the replicas, and the decision settings
    (one flag per ``ControllerSettings`` field)."""
    parser = argparse.ArgumentParser(prog="dflash-controller", description=__doc__.splitlines()[0])
    parser.add_argument("--replica", action="append", default=[], help="replica base URL (repeatable)")
    parser.add_argument(
        "--discover-replicas",
        metavar="PROMQL",
        help="find replicas through --prometheus-url: the instances this query returns with a "
        "positive value, e.g. 'up{job=\"dflash-serve\"}' (re-read before every push)",
    )
    key = parser.add_mutually_exclusive_group(required=True)
    key.add_argument("--admin-key", help="the replicas' --admin-key")
    key.add_argument("--admin-key-file", type=Path, help="file holding the admin key (e.g. a mounted secret)")
    parser.add_argument("--prometheus-url", help="read counters through PromQL instead of scraping replicas")
    parser.add_argument("--interval-s", type=float, default=10.0, help="seconds between decisions")
    parser.add_argument(
        "--trial-interval-s",
        type=float,
        help="seconds between decisions while a trial runs (default: --interval-s; shorter "
        "helps only if the counters are fresher, e.g. scraping replicas directly)",
    )
    parser.add_argument("--repush-s", type=float, default=30.0, help="re-send an unchanged policy this often")
    parser.add_argument("--metrics-port", type=int, default=9400)
    add_dataclass_flags(parser, ControllerSettings)
    args = parser.parse_args(argv)
    if args.discover_replicas and not args.prometheus_url:
        parser.error("--discover-replicas needs --prometheus-url")
    if not args.discover_replicas and not args.replica:
        parser.error("give --replica URLs or --discover-replicas")
    try:
        return args, ControllerSettings(**dataclass_kwargs(vars(args), ControllerSettings))
    except ValueError as exc:
        parser.error(str(exc))


def main(argv: list[str] | None = None) -> None:
    """Command line entry point."""
    args, settings = parse_args(argv)
    admin_key = args.admin_key or args.admin_key_file.read_text().strip()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    registry = CollectorRegistry()
    start_http_server(args.metrics_port, registry=registry)
    replicas: Callable[[], list[str]]
    if args.discover_replicas:
        replicas = lambda: discover_replicas(args.prometheus_url, args.discover_replicas)  # noqa: E731
    else:
        replicas = lambda: args.replica  # noqa: E731
    observe: Callable[[float], Observation]
    if args.prometheus_url:
        observe = lambda now: query_prometheus(args.prometheus_url, now)  # noqa: E731
    else:
        observe = lambda now: scrape_replicas(args.replica, now)  # noqa: E731
    loop = ControllerLoop(
        observe,
        push_to_replicas(replicas, admin_key),
        settings,
        settings.max_block_size,
        ControllerMetrics(registry),
        interval_s=args.interval_s,
        trial_interval_s=args.trial_interval_s,
        repush_s=args.repush_s,
    )
    loop.start()
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        loop.stop()


if __name__ == "__main__":
    main()
