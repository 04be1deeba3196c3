"""Render the dashboard's panels as PNG plots from a real Prometheus, with the
same PromQL Grafana runs (for the docs, where Grafana itself cannot run).

    python dashboards/render.py --prometheus http://127.0.0.1:9090 --minutes 10 --out docs/img/dashboard
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


def promql(expr: str, rate_window: str = "1m", range_window: str = "1h") -> str:
    """A dashboard expression as Prometheus runs it: Grafana's variables filled
    with "everything", ``$__rate_interval`` with ``rate_window`` and
    ``$__range`` (the dashboard's time range) with ``range_window``."""
    filled = expr.replace("$__rate_interval", rate_window).replace("$__range", range_window)
    return filled.replace('"$model"', '".*"').replace('"$instance"', '".*"')


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


def render(base_url: str, out_dir: Path, start: float, end: float, rate_window: str = "1m") -> list[Path]:
    """One PNG per panel; returns the files written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    step = max(1.0, (end - start) / 200)
    written = []
    for panel in panels():
        fig, ax = plt.subplots(figsize=(6, 3))
        for target in panel["targets"]:
            for series in query_range(base_url, promql(target["expr"], rate_window), start, end, step):
                points = [(float(t) - start, float(v)) for t, v in series["values"]]
                ax.plot(*zip(*points, strict=True), label=legend(target.get("legendFormat", ""), series["metric"]))
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
    parser.add_argument("--minutes", type=float, default=10.0, help="the last N minutes")
    parser.add_argument("--rate-window", default="1m")
    parser.add_argument("--out", type=Path, default=Path("docs/img/dashboard"))
    args = parser.parse_args()
    end = time.time()
    for path in render(args.prometheus, args.out, end - args.minutes * 60, end, args.rate_window):
        print(path)


if __name__ == "__main__":
    main()
