"""The results files: results.json (everything measured), results.md (the tables, with the
machine, the versions and the command) and one PNG chart per scenario."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from . import scale, steady


def write(results: dict[str, Any], output: Path) -> None:
    output.mkdir(parents=True, exist_ok=True)
    (output / "results.json").write_text(json.dumps(results, indent=2))
    (output / "results.md").write_text(markdown(results))
    if results.get("bursts"):
        burst_chart(results, output / "burst.png")
    if results.get("steady"):
        steady.steady_chart(results, output / "steady.png")
    if results.get("scale"):
        scale.scale_chart(results["scale"], output / "scale.png")


def markdown(results: dict[str, Any]) -> str:
    lines = ["# Benchmark results", "", f"Measured {results['started']} with `{results['command']}`."]
    for rerun in results.get("reruns", []):  # a scenario measured again later, merged in
        lines.append(f"The {rerun['section']} section: measured again {rerun['started']} with `{rerun['command']}`.")
    lines.append("")
    if results.get("bursts"):
        lines += burst_markdown(results)
    if results.get("leasebeat_replicas"):
        lines += replicas_burst_markdown(results)
    if results.get("steady"):
        lines += steady.markdown_steady(results)
    if results.get("failover"):
        lines += steady.markdown_failover(results)
    if results.get("scale"):
        lines += scale.markdown_scale(results["scale"])
    info = results["machine"]
    lines += [
        f"Machine: {info['platform']}, {info['cpus']} CPUs, Python {info['python']}.",
        "Versions: " + ", ".join(f"{name} {v}" for name, v in info["versions"].items()) + ".",
        "",
    ]
    return "\n".join(lines)


def _floor(results: dict[str, Any]) -> dict[int, float]:
    return {int(n): rate for n, rate in results.get("floor", {}).items()}


def _rate_cells(entry: dict[str, Any], floor: dict[int, float], timeout: float) -> str:
    n = entry["schedules"]
    if not entry["complete"]:
        return f"unfinished: {entry['delivered']:,} of {n:,} in {timeout:.0f} s | – | –"
    share = f"{entry['rate'] / floor[n]:.0%}" if n in floor else "–"
    return f"{entry['seconds']:.2f} s | {entry['rate']:,.0f} | {share}"


def burst_markdown(results: dict[str, Any]) -> list[str]:
    floor = _floor(results)
    lines = [
        "## Burst",
        "",
        "N crontab schedules due at the same minute boundary, no worker: seconds from the boundary until",
        "the last message is in Redis, the rate, and the rate as a fraction of the publishing floor",
        "(one process publishing the same messages with `apply_async` over one connection).",
        "",
        "| schedules | scheduler | last message after | rate (msg/s) | of the floor |",
        "|---:|---|---:|---:|---:|",
    ]
    for entry in results["bursts"]:
        lines.append(
            f"| {entry['schedules']:,} | {entry['scheduler']} | {_rate_cells(entry, floor, results['timeout'])} |"
        )
    lines += ["", "| schedules | publishing floor (msg/s) |", "|---:|---:|"]
    lines += [f"| {n:,} | {rate:,.0f} |" for n, rate in sorted(floor.items())]
    return [*lines, ""]


def replicas_burst_markdown(results: dict[str, Any]) -> list[str]:
    floor = _floor(results)
    lines = [
        "## leasebeat replicas on one database",
        "",
        "The largest burst with 1, 2 and 3 leasebeat replicas claiming from the same PostgreSQL table.",
        "",
        "| replicas | schedules | last message after | rate (msg/s) | of the floor |",
        "|---:|---:|---:|---:|---:|",
    ]
    for entry in results["leasebeat_replicas"]:
        lines.append(
            f"| {entry['replicas']} | {entry['schedules']:,} | {_rate_cells(entry, floor, results['timeout'])} |"
        )
    return [*lines, ""]


def burst_chart(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bursts, floor = results["bursts"], _floor(results)
    sizes = sorted({b["schedules"] for b in bursts})
    schedulers = list(dict.fromkeys(b["scheduler"] for b in bursts))
    figure, axes = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / (len(schedulers) + 1)
    for index, scheduler in enumerate(schedulers):
        rates = [
            next((b["rate"] or 0 for b in bursts if b["scheduler"] == scheduler and b["schedules"] == n), 0)
            for n in sizes
        ]
        axes.bar([i + index * width for i in range(len(sizes))], rates, width, label=scheduler)
    axes.bar([i + len(schedulers) * width for i in range(len(sizes))], [floor.get(n, 0) for n in sizes], width,
             label="publishing floor", color="lightgrey")  # fmt: skip
    axes.set_xticks([i + width * len(schedulers) / 2 for i in range(len(sizes))], [f"{n:,}" for n in sizes])
    axes.set_xlabel("schedules due at the same minute")
    axes.set_ylabel("messages per second (higher is better)")
    axes.set_title("Burst: rate from the boundary to the last message")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
