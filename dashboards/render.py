"""Render the dashboard's panels as PNG plots from a real Prometheus, with the
same PromQL Grafana runs (for the docs, where Grafana itself cannot run).

    python dashboards/render.py --prometheus http://127.0.0.1:9090 --minutes 10 --out docs/img/dashboard

``--end`` renders a past window (a stored run's TSDB served by a Prometheus of
its own), ``--instance`` one replica's series, as the dashboard's variable does.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path
from typing import Any

import httpx2
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

DASHBOARD = Path(__file__).with_name("dflash.json")


def promql(expr: str, rate_window: str = "1m", range_window: str = "1h", instance: str = ".*") -> str:
    """A dashboard expression as Prometheus runs it: ``$model`` filled with
    "every model", ``$instance`` with the regex ``instance``,
    ``$__rate_interval`` with ``rate_window`` and ``$__range`` (the
    dashboard's time range) with ``range_window``."""
    filled = expr.replace("$__rate_interval", rate_window).replace("$__range", range_window)
    return filled.replace('"$model"', '".*"').replace('"$instance"', f'"{instance}"')


def panels(dashboard: Path = DASHBOARD) -> list[dict[str, Any]]:
    """The dashboard's data panels (rows left out)."""
    return [p for p in json.loads(dashboard.read_text())["panels"] if p["type"] != "row"]


def legend(template: str, labels: dict[str, str]) -> str:
    """Grafana's ``{{label}}`` legend format."""
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), template) or str(labels)


def query_range(base_url: str, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
    response = httpx2.get(
        base_url.rstrip("/") + "/api/v1/query_range",
        params={"query": expr, "start": start, "end": end, "step": step},
        timeout=30,
    )
    response.raise_for_status()
    result: list[dict[str, Any]] = response.json()["data"]["result"]
    return result


def with_gaps(points: list[tuple[float, float]], step: float) -> tuple[list[float], list[float]]:
    """The points' x and y with a NaN wherever a series has no samples for over
    a step, so a plot breaks the line there as Grafana does, not bridge it."""
    xs: list[float] = []
    ys: list[float] = []
    for x, y in points:
        if xs and x - xs[-1] > 1.5 * step:
            xs.append(xs[-1] + step)
            ys.append(float("nan"))
        xs.append(x)
        ys.append(y)
    return xs, ys


def render(
    base_url: str, out_dir: Path, start: float, end: float, rate_window: str = "1m", instance: str = ".*"
) -> list[Path]:
    """One PNG per panel over [start, end] (its ``$__range``); returns the files written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    step = max(1.0, (end - start) / 200)
    written = []
    for panel in panels():
        fig, ax = plt.subplots(figsize=(6, 3))
        for target in panel["targets"]:
            expr = promql(target["expr"], rate_window, f"{round(end - start)}s", instance)
            for series in query_range(base_url, expr, start, end, step):
                xs, ys = with_gaps([(float(t) - start, float(v)) for t, v in series["values"]], step)
                ax.plot(xs, ys, label=legend(target.get("legendFormat", ""), series["metric"]))
        ax.set_title(panel["title"], fontsize=10)
        ax.set_xlabel("seconds")
        ax.set_ylabel(panel["fieldConfig"]["defaults"].get("unit", "").removeprefix("suffix:"))
        if ax.has_data():
            ax.legend(fontsize=6, loc="best")
        fig.tight_layout()
        path = out_dir / (re.sub(r"[^a-z0-9]+", "-", panel["title"].lower()).strip("-") + ".png")
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prometheus", required=True)
    parser.add_argument("--minutes", type=float, default=10.0, help="the N minutes up to --end")
    parser.add_argument("--end", type=float, default=None, help="unix seconds (default: now)")
    parser.add_argument("--instance", default=".*", help="regex of the instances shown (default: all)")
    parser.add_argument("--rate-window", default="1m")
    parser.add_argument("--out", type=Path, default=Path("docs/img/dashboard"))
    args = parser.parse_args()
    end = time.time() if args.end is None else args.end
    start = end - args.minutes * 60
    for path in render(args.prometheus, args.out, start, end, args.rate_window, args.instance):
        print(path)


if __name__ == "__main__":
    main()
