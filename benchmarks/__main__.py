"""``python -m benchmarks [--quick] [--json] [--only PREFIX] [--write-report]``.

Progress goes to stderr, so ``--json`` leaves stdout to the one JSON object. The exit status is
0 when every requested figure was measured (missed targets included: this is a measurement, not
a test) and 1 when any figure is missing.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Benchmark the host against floors measured in the same run.",
    )
    parser.add_argument("--quick", action="store_true",
                        help="fewer repetitions and a 5 s idle window (under a minute)")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object: key -> {value, unit, floor, ratio}")
    parser.add_argument("--only", action="append", default=[], metavar="KEY_PREFIX",
                        help="run only keys starting with this (repeatable, or comma-separated)")
    parser.add_argument("--write-report", action="store_true",
                        help="rewrite benchmarks/README.md with the figures and the machine")
    parser.add_argument("--list", action="store_true", help="print the keys and exit")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    # gRPC core logs every GOAWAY at info level; a restarted kubelet makes hundreds of them.
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    from benchmarks import report
    from benchmarks.core import Context, stderr_progress
    from benchmarks.suite import all_keys, run_suite

    if args.list:
        for key in all_keys():
            print(key)
        return 0
    prefixes = [p.strip() for value in args.only for p in value.split(",") if p.strip()]
    unknown = [p for p in prefixes if not any(k.startswith(p) for k in all_keys())]
    if unknown:
        print(f"python -m benchmarks: no key starts with {', '.join(unknown)} "
              "(see --list)", file=sys.stderr)
        return 2
    if args.write_report and prefixes:
        print("python -m benchmarks: --write-report rewrites the whole report; "
              "run it without --only", file=sys.stderr)
        return 2
    ctx = Context(quick=args.quick, prefixes=prefixes,
                  progress=(lambda message: None) if args.quiet else stderr_progress)
    result = run_suite(ctx)
    for key, reason in result.skipped.items():
        print(f"skipped {key}: {reason}", file=sys.stderr)
    for key, reason in result.missing.items():
        print(f"missing {key}: {reason}", file=sys.stderr)
    if args.json:
        print(report.as_json(result))
    else:
        print(report.table(result))
    if args.write_report:
        command = "python -m benchmarks" + (" --quick" if args.quick else "")
        report.write_readme(result, quick=args.quick, command=command + " --write-report")
        print(f"wrote {report.README}", file=sys.stderr)
    return 1 if result.missing else 0


if __name__ == "__main__":
    sys.exit(main())
