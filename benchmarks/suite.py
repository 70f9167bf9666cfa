"""The families of the suite, in run order, and running them with failures kept apart.

A family that fails (a child process that never got ready, a driver that found the wrong device
count) reports its keys as missing with the reason; it never yields a figure, and the other
families still run. The udev event latencies (``event_to_kubelet_p99_ms_1/_16/_64``,
``idle_cpu_pct_watching``) of a later issue slot in as one more module with ``KEYS`` and
``run(ctx)``, one entry in FAMILIES and their targets in ``benchmarks.report.TARGETS``.
"""

from __future__ import annotations

import os
import traceback
from dataclasses import dataclass, field
from types import ModuleType
from typing import Dict, List, Sequence, Tuple

from benchmarks import (
    discovery,
    dra_prepare,
    draslices,
    events,
    image,
    listwatch,
    migrate,
    node,
    preferred,
    reload,
    reregister,
    resources,
    rpc,
    startup,
    upgrade,
)
from benchmarks.core import Context, Figure, Skipped, bytecode_cache

#: Cheap, in-process families first; the idle-CPU window last.
FAMILIES: Tuple[ModuleType, ...] = (
    preferred, rpc, dra_prepare, listwatch, reregister, discovery, startup, events, draslices,
    reload, migrate, resources, upgrade, image, node,
)


def all_keys() -> List[str]:
    return [key for family in FAMILIES for key in family.KEYS]


def family_name(family: ModuleType) -> str:
    return family.__name__.rsplit(".", 1)[-1]


@dataclass
class SuiteResult:
    figures: Dict[str, Figure] = field(default_factory=dict)
    missing: Dict[str, str] = field(default_factory=dict)  # key -> why there is no figure
    skipped: Dict[str, str] = field(default_factory=dict)  # key -> why it cannot run here
    # 1-minute load average before and after: other work on a shared machine shows up here.
    load: Tuple[float, float] = (0.0, 0.0)

    def ordered(self, keys: Sequence[str]) -> List[Figure]:
        return [self.figures[k] for k in keys if k in self.figures]


def run_suite(ctx: Context, families: Sequence[ModuleType] = FAMILIES) -> SuiteResult:
    result = SuiteResult()
    load_before = _load()
    with bytecode_cache():
        _run_families(ctx, families, result)
    result.load = (load_before, _load())
    return result


def _run_families(ctx: Context, families: Sequence[ModuleType], result: SuiteResult) -> None:
    for family in families:
        wanted = [key for key in family.KEYS if ctx.wants(key)]
        if not wanted:
            continue
        ctx.progress(f"{family_name(family)}: {', '.join(wanted)}")
        try:
            figures = family.run(ctx)
        except Skipped as why:
            ctx.progress(f"{family_name(family)}: skipped: {why}")
            for key in wanted:
                result.skipped[key] = str(why)
            continue
        except Exception as error:  # one broken family must not hide the others' figures
            reason = f"{family_name(family)} failed: {type(error).__name__}: {error}"
            ctx.progress(reason + "\n" + traceback.format_exc())
            for key in wanted:
                result.missing[key] = reason
            continue
        for figure in figures:
            if figure.key in wanted:
                result.figures[figure.key] = figure
        for key in wanted:
            if key not in result.figures:
                result.missing[key] = f"{family_name(family)} produced no figure for it"


def _load() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return 0.0
