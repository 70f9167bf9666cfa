"""The hostile config corpus: what operators, editors, broken pipelines and attackers put at
the config path. ``check-config`` must answer every case with exit 0 and a reason (valid, or
what the file means) or exit 2 and one ``file: key: reason`` line: never a traceback.

    python tests/resources/hostile_configs.py DIR    # writes every case into DIR

Cases are generated rather than stored: several are megabytes, binary, or not files at all
(a directory, a FIFO, a symlink loop), which a repository cannot hold.
``tests/test_hostile_configs.py`` runs them against a host tree with two NVIDIA GPUs (for
the overlap cases).
"""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path
from typing import Callable, Dict, Union

GPU = '[[resource]]\nname = "{name}"\ndriver = "gpu"\n[resource.selectors]\nvendor = "0x10de"\n'
USB = '[[resource]]\nname = "example.com/dongle"\ndriver = "usb"\n'
VALID_HOST = '[host]\nlog_level = "debug"\n'

Maker = Callable[[Path], None]
Case = Union[bytes, Maker]


def _text(value: str) -> bytes:
    return value.encode("utf-8")


def _directory(path: Path) -> None:
    path.mkdir()


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _symlink_loop(path: Path) -> None:
    os.symlink(path.name, path)


def _dangling(path: Path) -> None:
    os.symlink(path.name + ".gone", path)


def _through_a_file(path: Path) -> None:
    """A path whose parent is a regular file: ENOTDIR."""
    path.parent.joinpath(path.name + ".d").write_text("x")
    os.symlink(path.name + ".d/config.toml", path)


def _devnull(path: Path) -> None:
    os.symlink("/dev/null", path)


def cases() -> Dict[str, Case]:
    rng = random.Random(11)
    many = "".join(f'[[resource]]\nname = "example.com/r{i}"\ndriver = "usb"\n'
                   for i in range(10_000))
    out: Dict[str, Case] = {
        # -- empty-ish: valid, and check-config says it means the built-in defaults
        "empty": b"",
        "only-comments": b"# nothing here\n# at all\n",
        "only-whitespace": b"\n\n   \t\n",
        "host-only": _text(VALID_HOST),
        "crlf-line-endings": _text(USB.replace("\n", "\r\n")),
        "bom-then-valid": b"\xef\xbb\xbf" + _text(USB),
        "valid-two-gpus-shared": _text(GPU.format(name="nvidia.com/gpu") + GPU.format(
            name="example.com/gpu-b").replace(
                "[resource.selectors]", 'shared_with = ["nvidia.com/gpu"]\n[resource.selectors]')),
        # -- bad types
        "type-plugin-dir-int": b"[host]\nplugin_dir = 1\n",
        "type-log-level-bool": b"[host]\nlog_level = true\n",
        "type-timeout-string": b'[host]\nallocate_timeout_s = "5"\n',
        "type-rescan-negative": b"[host]\nrescan_interval_s = -1\n",
        "type-grace-inf": b"[host]\nvanished_grace_s = inf\n",
        "type-timeout-nan": b"[host]\ndiscover_timeout_s = nan\n",
        "type-timeout-huge-int": _text("[host]\nallocate_timeout_s = " + "9" * 400 + "\n"),
        "type-metrics-int": b"[host]\nmetrics_address = 9400\n",
        "type-resource-string": b'resource = "nvidia.com/gpu"\n',
        "type-resource-ints": b"resource = [1, 2]\n",
        "type-name-int": b'[[resource]]\nname = 5\ndriver = "gpu"\n',
        "type-replicas-string": _text(USB + 'replicas = "2"\n'),
        "type-replicas-zero": _text(USB + "replicas = 0\n"),
        "type-replicas-float": _text(USB + "replicas = 2.5\n"),
        "type-cdi-string": _text(USB + 'cdi = "yes"\n'),
        "type-selectors-array": _text(USB + "selectors = [1]\n"),
        "type-host-array": b"host = [1]\n",
        # -- unknown keys
        "unknown-top-level": b'hosts = "x"\n',
        "unknown-host-key": b'[host]\nplugin_dirs = "/var/lib/kubelet/device-plugins"\n',
        "unknown-resource-key": _text(USB + "selector = {}\n"),
        "unknown-selector": _text(USB + "[resource.selectors]\ncolour = \"red\"\n"),
        "unknown-unicode-key": _text('[host]\n"l\u043eg_level" = "info"\n'),  # Cyrillic o
        # -- resource names and drivers
        "name-uppercase-domain": b'[[resource]]\nname = "NVIDIA.com/gpu"\ndriver = "gpu"\n',
        "name-kubernetes-io": b'[[resource]]\nname = "kubernetes.io/gpu"\ndriver = "gpu"\n',
        "name-no-slash": b'[[resource]]\nname = "gpu"\ndriver = "gpu"\n',
        "name-too-long": _text('[[resource]]\nname = "example.com/' + "g" * 300
                               + '"\ndriver = "gpu"\n'),
        "name-empty": b'[[resource]]\nname = ""\ndriver = "gpu"\n',
        "name-missing": b'[[resource]]\ndriver = "gpu"\n',
        "driver-unknown": b'[[resource]]\nname = "example.com/x"\ndriver = "gpuu"\n',
        "driver-missing": b'[[resource]]\nname = "example.com/x"\n',
        "resource-empty-list": b"resource = []\n",
        "cdi-kind-digit": b'[[resource]]\nname = "example.com/1gpu"\ndriver = "usb"\ncdi = true\n',
        "replica-policy-alone": _text(USB + 'replica_policy = "spread"\n'),
        "selector-bad-vendor": _text(USB.replace("usb", "gpu")
                                     + '[resource.selectors]\nvendor = "0xZZZZ"\n'),
        # -- duplicates and overlaps
        "duplicate-host-table": b"[host]\n[host]\n",
        "duplicate-key": b'[host]\nlog_level = "info"\nlog_level = "debug"\n',
        "duplicate-inline-key": _text(USB + "selectors = {vendor = 1, vendor = 2}\n"),
        "duplicate-resource-name": _text(USB + USB),
        "overlap-two-gpu-resources": _text(GPU.format(name="nvidia.com/gpu")
                                           + GPU.format(name="example.com/gpu-b")),
        "shared-with-unknown": _text(USB + 'shared_with = ["example.com/nope"]\n'),
        "shared-with-itself": _text(USB + 'shared_with = ["example.com/dongle"]\n'),
        # -- path tricks
        "path-relative": b'[host]\nplugin_dir = "device-plugins"\n',
        "path-dotdot": b'[host]\ncdi_dir = "/var/run/cdi/../../etc"\n',
        "path-nul": b'[host]\ndrain_file = "/var/lib/x\\u0000y"\n',
        "path-home": b'[host]\nhost_root = "~/root"\n',
        "path-socket-too-long": _text('[host]\npod_resources_socket = "/' + "p" * 200 + '"\n'),
        "path-plugin-dir-too-long": _text('[host]\nplugin_dir = "/' + "d" * 120 + '"\n'),
        # -- nesting
        "nested-arrays-5000": _text("x = " + "[" * 5000 + "]" * 5000 + "\n"),
        "nested-inline-tables-5000": _text("x = " + "{a = " * 5000 + "1" + "}" * 5000 + "\n"),
        "nested-in-selectors": _text(USB + "[resource.selectors]\nvendor = "
                                     + "[" * 3000 + "]" * 3000 + "\n"),
        "dotted-key-2000": _text("a" + ".a" * 2000 + " = 1\n"),
        "table-header-2000": _text("[a" + ".a" * 2000 + "]\n"),
        # -- syntax
        "syntax-unterminated-string": b'[host]\nlog_level = "info\n',
        "syntax-missing-equals": b"[host]\nlog_level\n",
        "syntax-half-header": b"[[resource]\n",
        "syntax-control-char": b'[host]\nlog_level = "in\x01fo"\n',
        "syntax-truncated-mid-key": _text(USB + GPU.format(name="example.com/b")[:27]),
        # -- encodings and junk
        "utf16-le-with-bom": "\ufeff".encode("utf-16-le") + USB.encode("utf-16-le"),
        "bom-twice": b"\xef\xbb\xbf\xef\xbb\xbf" + _text(USB),
        "invalid-utf8-in-comment": b"# caf\xe9\n" + _text(USB),
        "invalid-utf8-overlong": b'[host]\nlog_level = "\xc0\xafinfo"\n',
        "nul-bytes": b"\0" * 64,
        "binary-random": bytes(rng.getrandbits(8) for _ in range(4096)),
        "png-header": b"\x89PNG\r\n\x1a\n" + bytes(range(256)),
        "yaml-instead-of-toml": b"host:\n  plugin_dir: /var/lib/kubelet/device-plugins\n",
        "json-instead-of-toml": b'{"host": {"log_level": "info"}}\n',
        # -- huge
        "huge-10000-resources": _text(many),
        "huge-5mib-comment": b"# " + b"x" * (5 * 2**20) + b"\n",
        "huge-1mib-string": _text('[host]\nlog_level = "' + "x" * 2**20 + '"\n'),
        # -- not a file
        "not-a-file-directory": _directory,
        "not-a-file-fifo": _fifo,
        "not-a-file-devnull": _devnull,
        "symlink-loop": _symlink_loop,
        "symlink-dangling": _dangling,
        "path-through-a-file": _through_a_file,
    }
    return out


def write(directory: Path, name: str, case: Case) -> Path:
    path = directory / f"{name}.toml"
    if callable(case):
        case(path)
    else:
        path.write_bytes(case)
    return path


if __name__ == "__main__":
    target = Path(sys.argv[1])
    target.mkdir(parents=True, exist_ok=True)
    for case_name, case_body in cases().items():
        write(target, case_name, case_body)
