"""Targets, the human table, the JSON object and benchmarks/README.md.

Targets are ratios to a same-run floor wherever a floor measures the same thing, because only a
ratio holds from one machine to the next; the rest are absolute budgets a node operator would
state (memory, idle CPU, milliseconds to react).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
from dataclasses import dataclass
from importlib import metadata
from types import ModuleType
from typing import Dict, List, Optional, Sequence

from benchmarks.core import Figure
from benchmarks.suite import FAMILIES, SuiteResult, all_keys, family_name

README = os.path.join(os.path.dirname(os.path.abspath(__file__)), "README.md")


@dataclass(frozen=True)
class Target:
    """``ratio``: value/floor at most ``limit``; ``max``: value below ``limit`` (in its unit)."""

    kind: str
    limit: float
    text: str

    def check(self, figure: Figure) -> Optional[bool]:
        if self.kind == "ratio":
            ratio = figure.ratio
            return None if ratio is None else ratio <= self.limit
        return figure.value < self.limit


TARGETS: Dict[str, Target] = {
    "allocate_median_us": Target("ratio", 1.2, "<= 1.2x bare"),
    "startup_ms_1": Target("ratio", 1.5, "<= 1.5x bare"),
    "startup_ms_16": Target("ratio", 1.5, "<= 1.5x bare"),
    "startup_ms_64": Target("max", 500, "< 500 ms"),
    "reregister_p99_ms_64": Target("max", 100, "< 100 ms"),
    "reregister_p99_ms_64_outage_0.5": Target("max", 100, "< 100 ms"),
    "reregister_p99_ms_64_outage_2": Target("max", 100, "< 100 ms"),
    "reregister_p99_ms_64_outage_10": Target("max", 100, "< 100 ms"),
    "reregister_attempts_64": Target("max", 2.0001, "<= 2 (ideally 1)"),
    "listwatch_p99_ms_10000": Target("max", 10, "< 10 ms"),
    "discovery_ms_2048": Target("ratio", 2, "<= 2x bare"),
    "discovery_ms_sriov_1024": Target("ratio", 2, "<= 2x bare"),
    "discovery_ms_qat_256": Target("ratio", 2, "<= 2x bare"),
    "rss_mb_1r": Target("ratio", 1.2, "<= 1.2x bare"),
    "rss_mb_16r": Target("ratio", 1.2, "<= 1.2x bare"),
    "discovery_ms_cpx_64": Target("ratio", 2, "<= 2x bare"),
    "rss_mb_64r_10k": Target("max", 55, "< 55 MB"),
    "idle_cpu_pct_64r": Target("max", 0.1, "< 0.1 %"),
    "preferred_ms_1024_8numa": Target("max", 5, "< 5 ms"),
    "event_to_kubelet_p99_ms_64": Target("max", 10, "< 10 ms"),
    "idle_cpu_pct_watching": Target("max", 0.1, "< 0.1 %"),
    "dra_slice_event_p99_ms": Target("max", 20, "< 20 ms"),
    "dra_republish_p99_ms": Target("max", 50, "< 50 ms"),
    "upgrade_gap_ms_device_plugin": Target("max", 0.5, "0 (goal)"),
    "upgrade_gap_ms_dra": Target("max", 0.5, "0 (goal)"),
}


def status(figure: Figure) -> str:
    target = TARGETS.get(figure.key)
    if target is None:
        return ""
    verdict = target.check(figure)
    return "n/a" if verdict is None else "PASS" if verdict else "MISS"


def _num(value: Optional[float]) -> str:
    if value is None:
        return "-"
    if value == 0:
        return "0"
    if abs(value) >= 100:
        return f"{value:.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    if abs(value) >= 1:
        return f"{value:.2f}"
    return f"{value:.3g}"


def _ratio(figure: Figure) -> str:
    ratio = figure.ratio
    return "-" if ratio is None else f"{ratio:.2f}x"


def _rows(result: SuiteResult, keys: Sequence[str]) -> List[List[str]]:
    rows = []
    for key in keys:
        figure = result.figures.get(key)
        target = TARGETS.get(key)
        if figure is None:
            if key in result.missing:
                rows.append([key, "MISSING", "", "", "", target.text if target else "", ""])
            continue
        rows.append([key, _num(figure.value), figure.unit, _num(figure.floor), _ratio(figure),
                     target.text if target else "", status(figure)])
    return rows


HEADERS = ["key", "value", "unit", "floor", "ratio", "target", ""]


# -- outputs ---------------------------------------------------------------------------------
def as_json(result: SuiteResult) -> str:
    """ONE object, key -> {value, unit, floor, ratio}; missing keys are absent (stderr says)."""
    return json.dumps({f.key: f.as_json() for f in result.ordered(all_keys())}, indent=2)


def table(result: SuiteResult) -> str:
    keys = all_keys()
    rows = _rows(result, keys)
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(HEADERS)]
    lines = ["  ".join(h.upper().ljust(w) for h, w in zip(HEADERS, widths)).rstrip()]
    for row in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
        figure = result.figures.get(row[0])
        for note in (figure.notes if figure else [result.missing.get(row[0], "")]):
            if note:
                lines.append(f"    {note}")
    misses = [f.key for f in result.figures.values() if status(f) == "MISS"]
    passes = [f.key for f in result.figures.values() if status(f) == "PASS"]
    lines.append("")
    lines.append(f"targets: {len(passes)} PASS, {len(misses)} MISS"
                 + (f" ({', '.join(misses)})" if misses else ""))
    if result.missing:
        lines.append(f"missing: {', '.join(result.missing)}")
    info = machine()
    lines.append(f"machine: {info['cpus']} CPUs, Python {info['python']}, grpcio {info['grpcio']};"
                 f" load average {result.load[0]:.2f} before, {result.load[1]:.2f} after")
    return "\n".join(lines)


def machine() -> Dict[str, str]:
    def version(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "cpus": str(os.cpu_count()),
        "cpu": model,
        "python": sys.version.split()[0],
        "grpcio": version("grpcio"),
        "protobuf": version("protobuf"),
        "platform": platform.platform(),
    }


def _family_doc(family: ModuleType) -> str:
    return (family.__doc__ or "").strip()


def write_readme(result: SuiteResult, *, quick: bool, command: str,
                 path: str = README) -> None:
    info = machine()
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    out = [
        "# Benchmarks",
        "",
        "<!-- Written by `python -m benchmarks --write-report`; do not edit by hand. -->",
        "",
        f"Run `{command}` on {date}{' (quick run: fewer repetitions)' if quick else ''}.",
        "",
        f"Machine: {info['cpus']} CPUs ({info['cpu']}), {info['platform']}; Python "
        f"{info['python']}, grpcio {info['grpcio']}, protobuf {info['protobuf']}. "
        f"1-minute load average {result.load[0]:.2f} before the run, {result.load[1]:.2f} "
        "after (before the run, anything above 0 is other work sharing the CPUs).",
        "",
        "Each figure is next to a floor measured in the same run with the same client and "
        "setup, and the ratio of the two; ratios carry over between machines, absolute "
        "figures do not. `python -m benchmarks --json` prints the same figures as one JSON "
        "object (key -> value, unit, floor, ratio).",
        "",
        "| " + " | ".join(h or "status" for h in HEADERS) + " |",
        "|" + "|".join("---" for _ in HEADERS) + "|",
    ]
    for row in _rows(result, all_keys()):
        out.append("| " + " | ".join(cell or " " for cell in row) + " |")
    out.append("")
    misses = [f.key for f in result.figures.values() if status(f) == "MISS"]
    out.append(f"Targets: {sum(status(f) == 'PASS' for f in result.figures.values())} PASS, "
               f"{len(misses)} MISS" + (f" ({', '.join(misses)})." if misses else "."))
    if result.missing:
        out += ["", "Missing figures:", ""]
        out += [f"* `{key}`: {reason}" for key, reason in result.missing.items()]
    out += ["", "## Details per figure", ""]
    for figure in result.ordered(all_keys()):
        out.append(f"* `{figure.key}`: " + "; ".join(figure.notes))
    out += ["", "## Method", ""]
    for family in FAMILIES:
        keys = ", ".join(f"`{k}`" for k in family.KEYS)
        out += [f"### {family_name(family)} ({keys})", "", _family_doc(family), ""]
    with open(path, "w", encoding="utf-8") as handle:
        handle.write("\n".join(out).rstrip() + "\n")
