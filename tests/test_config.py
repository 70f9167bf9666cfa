"""Config validation: every mistake is one line naming file, key and reason, before start-up.

The drivers here are small test subclasses with their own selector/setting types, so these
tests do not depend on the real drivers; only the examples test loads those.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import re
import textwrap
from pathlib import Path
from typing import Dict, List, Mapping, Sequence

import pytest

try:
    import tomllib
except ImportError:  # Python < 3.11
    import tomli as tomllib  # type: ignore[no-redef]

from host.config import (
    DEFAULT_CONFIG_PATH,
    FILE_KEY,
    Config,
    ConfigError,
    HostSettings,
    default_config,
    load_config,
    parse_config,
)
from host.core.driver import Driver, SelectorError
from host.core.model import ResourceConfig
from host.core.resource_name import resource_name_error
from host.sysfs.pci import PCI_SELECTOR_TYPES, check_pci_selectors

REPO = Path(__file__).resolve().parents[1]
SHIPPED = REPO / "config" / "config.toml"
EXAMPLES = sorted((REPO / "config" / "examples").glob("*.toml"))


class FakeGpu(Driver):
    name = "gpu"
    selector_types = PCI_SELECTOR_TYPES

    def check_selectors(self, selectors: Mapping[str, object]) -> None:
        super().check_selectors(selectors)
        check_pci_selectors(selectors)

    def default_resources(self) -> Sequence[ResourceConfig]:
        return [
            ResourceConfig("example.com/gpu", "gpu", {"vendor": "0x10de"}),
            ResourceConfig("example.com/gpu-amd", "gpu", {"vendor": "0x1002"}),
        ]


class FakeNic(Driver):
    name = "nic"
    selector_types = {"vendor": (str, int), "pf_name": (str,)}
    setting_types = {"mode": (str,), "shared_count": (int,)}

    def check_settings(self, settings: Mapping[str, object]) -> None:
        super().check_settings(settings)
        if settings.get("mode", "exclusive") not in ("exclusive", "shared"):
            raise SelectorError("mode", 'must be "exclusive" or "shared"')


class FakeFpga(Driver):
    name = "fpga"
    setting_types = {"pre_start": (list,)}

    def check_settings(self, settings: Mapping[str, object]) -> None:
        super().check_settings(settings)
        for index, arg in enumerate(settings.get("pre_start", [])):  # type: ignore[arg-type]
            if not isinstance(arg, str):
                raise SelectorError(f"pre_start[{index}]", "arguments must be strings")


class CrashingChecks(Driver):
    name = "crashy"

    def check_selectors(self, selectors: Mapping[str, object]) -> None:
        raise ZeroDivisionError("division by zero")


DRIVERS: Dict[str, Driver] = {
    d.name: d for d in (FakeGpu(), FakeNic(), FakeFpga(), CrashingChecks())
}

GPU = '[[resource]]\nname = "example.com/gpu"\ndriver = "gpu"\n'
NIC = '[[resource]]\nname = "example.com/nic"\ndriver = "nic"\n'


def parse(text: str, file: str = "gpu.toml") -> Config:
    return parse_config(textwrap.dedent(text), file, DRIVERS)


def error_of(text: str, file: str = "gpu.toml") -> ConfigError:
    with pytest.raises(ConfigError) as caught:
        parse(text, file)
    error = caught.value
    assert str(error) == f"{error.file}: {error.key}: {error.reason}"
    return error


# -- invalid configs: (toml, key, fragments the reason must contain) --------------------------

INVALID = {
    "syntax": (
        '[host]\nlog_level = "info\n',
        "line 2, column 18",
        ["invalid TOML", "Illegal character"],
    ),
    "syntax-end": ("[host]\nplugin_dir =", "end of file", ["invalid TOML", "Invalid value"]),
    "top-typo": ('[[resources]]\nname = "a.b/c"\n', "resources", ['did you mean "resource"']),
    "top-unknown": ("[kubelet]\n", "kubelet", ["unknown key", "host, resource"]),
    "host-not-table": ("host = 3\n", "host", ["must be a table", "an integer (3)"]),
    "host-typo": ('[host]\nplugin_dri = "/x"\n', "host.plugin_dri", ['did you mean "plugin_dir"']),
    "host-unknown": ("[host]\ncolour = 1\n", "host.colour", ["known keys", "vanished_grace_s"]),
    "host-odd-key": ('[host]\n"plugin dir" = "/x"\n', 'host."plugin dir"', ["unknown key"]),
    "timeout-negative": (
        "[host]\nallocate_timeout_s = -1\n",
        "host.allocate_timeout_s",
        ["must be a number > 0, got -1"],
    ),
    "timeout-zero": ("[host]\ndiscover_timeout_s = 0\n", "host.discover_timeout_s", ["> 0"]),
    "timeout-too-long": (
        "[host]\nallocate_timeout_s = 5000\n",
        "host.allocate_timeout_s",
        ["at most 300", "5000"],
    ),
    "timeout-nan": ("[host]\nregister_timeout_s = nan\n", "host.register_timeout_s", ["nan"]),
    "timeout-inf": ("[host]\nallocate_timeout_s = inf\n", "host.allocate_timeout_s", ["inf"]),
    "timeout-minus-inf": (
        "[host]\ndiscover_timeout_s = -inf\n",
        "host.discover_timeout_s",
        ["> 0"],
    ),
    "timeout-huge-int": (
        "[host]\ndiscover_timeout_s = 1" + "0" * 400 + "\n",
        "host.discover_timeout_s",
        ["at most 3600"],
    ),
    "timeout-bool": (
        "[host]\nallocate_timeout_s = true\n",
        "host.allocate_timeout_s",
        ["a boolean (true)"],
    ),
    "timeout-string": (
        '[host]\nallocate_timeout_s = "5"\n',
        "host.allocate_timeout_s",
        ['a string ("5")'],
    ),
    "rescan-too-often": (
        "[host]\nrescan_interval_s = 0.5\n",
        "host.rescan_interval_s",
        ["0 (disabled) or a number >= 1", "0.5"],
    ),
    "grace-negative": (
        "[host]\nvanished_grace_s = -1\n",
        "host.vanished_grace_s",
        [">= 0, got -1"],
    ),
    "log-level": (
        '[host]\nlog_level = "verbose"\n',
        "host.log_level",
        ['"debug", "info", "warning", "error"', '"verbose"'],
    ),
    "log-level-near": (
        '[host]\nlog_level = "warn"\n',
        "host.log_level",
        ['did you mean "warning"'],
    ),
    "log-format": ('[host]\nlog_format = "yaml"\n', "host.log_format", ['"plain", "json"']),
    "log-format-type": ("[host]\nlog_format = 1\n", "host.log_format", ["an integer (1)"]),
    "dra-unhealthy": ('[host]\ndra_unhealthy = "delete"\n', "host.dra_unhealthy",
                      ['"omit", "taint"']),
    "path-relative": (
        '[host]\nplugin_dir = "var/lib/kubelet"\n',
        "host.plugin_dir",
        ["absolute path", '"var/lib/kubelet"'],
    ),
    "path-dotdot": ('[host]\nhost_root = "/host/../etc"\n', "host.host_root", ["'..'"]),
    "path-empty": ('[host]\nhost_root = ""\n', "host.host_root", ["absolute path"]),
    "path-nul": ('[host]\nplugin_dir = "/x\\u0000y"\n', "host.plugin_dir", ["NUL"]),
    "path-type": ('[host]\nhost_root = ["/"]\n', "host.host_root", ["an array"]),
    "socket-too-long": (
        '[host]\npod_resources_socket = "/' + "s" * 120 + '"\n',
        "host.pod_resources_socket",
        ["121 bytes", "107"],
    ),
    "plugin-dir-too-long": (
        '[host]\nplugin_dir = "/' + "d" * 100 + '"\n',
        "host.plugin_dir",
        ["101 bytes", "kubelet.sock"],
    ),
    "resource-table": (
        '[resource]\nname = "a.b/c"\n',
        "resource",
        ["array of tables ([[resource]])", "a table"],
    ),
    "resource-empty": ("resource = []\n", "resource", ["no resources", "built-in defaults"]),
    "resource-not-table": ('resource = ["gpu"]\n', "resource[0]", ["must be a table"]),
    "name-missing": ('[[resource]]\ndriver = "gpu"\n', "resource[0].name", ["missing"]),
    "name-type": ("[[resource]]\nname = 7\n", "resource[0].name", ["an integer (7)"]),
    "name-native": (
        '[[resource]]\nname = "gpu"\ndriver = "gpu"\n',
        "resource[0].name",
        ['"gpu" is not a valid resource name', str(resource_name_error("gpu"))],
    ),
    "name-uppercase-domain": (
        GPU + '[[resource]]\nname = "Example.com/gpu2"\ndriver = "gpu"\n',
        "resource[1].name",
        [str(resource_name_error("Example.com/gpu2"))],
    ),
    "name-reserved": (
        '[[resource]]\nname = "kubernetes.io/gpu"\n',
        "resource[0].name",
        ["kubernetes.io/"],
    ),
    "driver-missing": (
        '[[resource]]\nname = "example.com/gpu"\n',
        "resource[0] (example.com/gpu).driver",
        ["missing", "known drivers: crashy, fpga, gpu, nic"],
    ),
    "driver-unknown": (
        GPU + '[[resource]]\nname = "example.com/nic"\ndriver = "nics"\n',
        "resource[1] (example.com/nic).driver",
        ['unknown driver "nics"', 'did you mean "nic"', "known drivers: crashy, fpga, gpu, nic"],
    ),
    "driver-type": (
        '[[resource]]\nname = "example.com/gpu"\ndriver = true\n',
        "resource[0] (example.com/gpu).driver",
        ["a boolean (true)"],
    ),
    "duplicate-name": (
        GPU + NIC + GPU,
        "resource[2] (example.com/gpu).name",
        ["duplicate", "resource[0]"],
    ),
    "resource-key-typo": (
        GPU + "[resource.selector]\nvendor = 1\n",
        "resource[0] (example.com/gpu).selector",
        ['did you mean "selectors"'],
    ),
    "selector-misplaced": (
        GPU + 'vendor = "0x10de"\n',
        "resource[0] (example.com/gpu).vendor",
        ["[resource.selectors]", "'gpu'"],
    ),
    "setting-misplaced": (
        NIC + 'mode = "shared"\n',
        "resource[0] (example.com/nic).mode",
        ["[resource.settings]"],
    ),
    "selectors-not-table": (
        GPU + 'selectors = "0x10de"\n',
        "resource[0] (example.com/gpu).selectors",
        ["must be a table", 'a string ("0x10de")'],
    ),
    "selector-unknown": (
        GPU + NIC + '[resource.selectors]\ncolour = "red"\n',
        "resource[1] (example.com/nic).selectors.colour",
        ["unknown selector", "pf_name, vendor"],
    ),
    "selector-bad-value": (
        GPU + '[resource.selectors]\nvendor = "0xzz"\n',
        "resource[0] (example.com/gpu).selectors.vendor",
        ["hex PCI ids"],
    ),
    "selector-bad-type": (
        GPU + "[resource.selectors]\nkernel_driver = 5\n",
        "resource[0] (example.com/gpu).selectors.kernel_driver",
        ["expected string, got int"],
    ),
    "selector-empty-list": (
        GPU + "[resource.selectors]\nvendor = []\n",
        "resource[0] (example.com/gpu).selectors.vendor",
        ["empty list"],
    ),
    "selector-odd-key": (
        NIC + '[resource.selectors]\n"pf name" = "ens1f0"\n',
        'resource[0] (example.com/nic).selectors."pf name"',
        ["unknown selector"],
    ),
    "setting-driver-path": (
        '[[resource]]\nname = "example.com/fpga"\ndriver = "fpga"\n'
        '[resource.settings]\npre_start = ["/bin/fpgaconf", 3]\n',
        "resource[0] (example.com/fpga).settings.pre_start[1]",
        ["arguments must be strings"],
    ),
    "setting-bad-value": (
        NIC + '[resource.settings]\nmode = "both"\n',
        "resource[0] (example.com/nic).settings.mode",
        ['"exclusive" or "shared"'],
    ),
    "setting-bool-for-int": (
        NIC + "[resource.settings]\nshared_count = true\n",
        "resource[0] (example.com/nic).settings.shared_count",
        ["got a boolean"],
    ),
    "setting-unknown": (
        GPU + "[resource.settings]\nshared = true\n",
        "resource[0] (example.com/gpu).settings.shared",
        ["unknown setting", "known: none"],
    ),
    "settings-not-table": (
        NIC + "settings = [1]\n",
        "resource[0] (example.com/nic).settings",
        ["must be a table", "an array"],
    ),
    "driver-check-crashes": (
        '[[resource]]\nname = "example.com/c"\ndriver = "crashy"\n',
        "resource[0] (example.com/c).selectors",
        ["'crashy' failed", "ZeroDivisionError"],
    ),
}


@pytest.mark.parametrize("case", sorted(INVALID))
def test_invalid_config_names_file_key_and_reason(case: str) -> None:
    text, key, fragments = INVALID[case]
    error = error_of(text)
    assert error.file == "gpu.toml"
    assert error.key == key
    for fragment in fragments:
        assert fragment in error.reason, (case, error.reason)


def test_key_format_matches_the_documented_example() -> None:
    error = error_of("[host]\nallocate_timeout_s = -1\n")
    assert str(error) == "gpu.toml: host.allocate_timeout_s: must be a number > 0, got -1"


def test_first_error_in_document_order_wins() -> None:
    # An operator fixes one line at a time; the message must be about the earliest one.
    error = error_of('[host]\nlog_level = "loud"\n' + GPU + GPU)
    assert error.key == "host.log_level"


# -- valid configs ----------------------------------------------------------------------------

FULL = """\
[host]
plugin_dir = "/var/lib/kubelet/device-plugins/"
host_root = "/host"
pod_resources_socket = "/run/pod-resources/kubelet.sock"
log_level = "DEBUG"
log_format = "json"
allocate_timeout_s = 10
discover_timeout_s = 12.5
register_timeout_s = 20
rescan_interval_s = 0
vanished_grace_s = 0

[[resource]]
name = "nvidia.com/gpu"
driver = "gpu"
[resource.selectors]
vendor = "0x10de"
device = ["0x20b2", "0x20b0"]

[[resource]]
name = "nvidia.com/GA100_A100_SXM4_80GB"
driver = "gpu"
[resource.selectors]
kernel_driver = "vfio-pci"

[[resource]]
name = "example.com/nic"
driver = "nic"
selectors = { vendor = 0x15b3 }
[resource.settings]
mode = "shared"
shared_count = 100
"""


def test_full_config_is_parsed_normalised_and_ordered() -> None:
    config = parse(FULL, "/etc/device-plugin-host/config.toml")
    assert config.path == "/etc/device-plugin-host/config.toml"
    assert config.is_default is False
    assert config.host == HostSettings(
        plugin_dir="/var/lib/kubelet/device-plugins",
        host_root="/host",
        pod_resources_socket="/run/pod-resources/kubelet.sock",
        log_level="debug",
        log_format="json",
        allocate_timeout_s=10.0,
        discover_timeout_s=12.5,
        register_timeout_s=20.0,
        rescan_interval_s=0.0,
        vanished_grace_s=0.0,
    )
    assert isinstance(config.host.allocate_timeout_s, float)
    assert [r.name for r in config.resources] == [
        "nvidia.com/gpu",
        "nvidia.com/GA100_A100_SXM4_80GB",
        "example.com/nic",
    ]
    gpu, vfio, nic = config.resources
    assert gpu == ResourceConfig(
        "nvidia.com/gpu", "gpu", {"vendor": "0x10de", "device": ["0x20b2", "0x20b0"]}, {}
    )
    assert vfio.driver == "gpu" and vfio.selectors == {"kernel_driver": "vfio-pci"}
    assert nic.selectors == {"vendor": 0x15B3}
    assert nic.settings == {"mode": "shared", "shared_count": 100}
    # Configured resources register even while empty, so a missing card shows as 0.
    assert all(r.register_when_empty for r in config.resources)


def test_host_only_file_serves_the_builtin_default_resources() -> None:
    config = parse('[host]\nlog_level = "warning"\n', "/etc/x.toml")
    assert config.path == "/etc/x.toml"
    assert config.is_default is True
    assert config.host == HostSettings(log_level="warning")
    assert config.resources == default_config(DRIVERS).resources


@pytest.mark.parametrize("text", ["", "# only comments\n\n", "\ufeff"])
def test_empty_file_is_the_builtin_defaults(text: str) -> None:
    config = parse(text)
    assert config.host == HostSettings()
    assert config.is_default is True
    assert [r.name for r in config.resources] == ["example.com/gpu", "example.com/gpu-amd"]


def test_byte_order_mark_is_accepted() -> None:
    config = parse("\ufeff" + GPU)
    assert [r.name for r in config.resources] == ["example.com/gpu"]


def test_selectors_and_settings_are_optional_and_still_checked_empty() -> None:
    seen: List[Mapping[str, object]] = []

    class Recording(Driver):
        name = "rec"

        def check_selectors(self, selectors: Mapping[str, object]) -> None:
            seen.append(selectors)

    config = parse_config(
        '[[resource]]\nname = "a.example/b"\ndriver = "rec"\n', "f", {"rec": Recording()}
    )
    assert config.resources[0].selectors == {} and config.resources[0].settings == {}
    assert seen == [{}]  # a driver that requires a selector gets to say so


def test_unknown_driver_with_no_drivers_installed() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(GPU, "f.toml", {})
    assert caught.value.key == "resource[0] (example.com/gpu).driver"
    assert "known drivers: none are installed" in caught.value.reason


# -- files ------------------------------------------------------------------------------------


def test_load_reads_the_given_file(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text(GPU, encoding="utf-8")
    config = load_config(str(path), DRIVERS)
    assert config.path == str(path)
    assert [r.name for r in config.resources] == ["example.com/gpu"]


def test_explicit_missing_file_is_an_error(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.toml")
    with pytest.raises(ConfigError) as caught:
        load_config(missing, DRIVERS)
    assert (caught.value.file, caught.value.key) == (missing, FILE_KEY)
    assert caught.value.reason == "does not exist"


def test_directory_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(str(tmp_path), DRIVERS)
    assert caught.value.key == FILE_KEY and "is a directory" in caught.value.reason


def test_path_through_a_file_is_unreadable(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    bad = str(tmp_path / "file" / "config.toml")
    with pytest.raises(ConfigError) as caught:
        load_config(bad, DRIVERS)
    assert caught.value.key == FILE_KEY
    assert caught.value.reason == "cannot read: Not a directory"


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_unreadable_file_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text(GPU)
    path.chmod(0)
    with pytest.raises(ConfigError) as caught:
        load_config(str(path), DRIVERS)
    assert caught.value.reason == "cannot read: Permission denied"


def test_not_utf8_names_the_position_of_the_bad_byte(tmp_path: Path) -> None:
    path = tmp_path / "latin1.toml"
    path.write_bytes('[host]\nlog_level = "d\xe9bug"\n'.encode("latin-1"))
    with pytest.raises(ConfigError) as caught:
        load_config(str(path), DRIVERS)
    assert (caught.value.file, caught.value.key) == (str(path), "line 2, column 15")
    assert "not UTF-8" in caught.value.reason and "0xe9" in caught.value.reason


def test_no_path_and_no_default_file_is_the_builtin_defaults(tmp_path: Path) -> None:
    config = load_config(None, DRIVERS, default_path=str(tmp_path / "absent.toml"))
    assert config == default_config(DRIVERS)
    assert config.path is None


def test_no_path_uses_the_default_file_when_present(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text(NIC)
    config = load_config(None, DRIVERS, default_path=str(path))
    assert config.path == str(path)
    assert [r.name for r in config.resources] == ["example.com/nic"]


def test_dangling_default_link_fails_instead_of_silently_serving_defaults(tmp_path: Path) -> None:
    # A ConfigMap volume whose ..data target went missing: serving defaults would hide it.
    link = tmp_path / "config.toml"
    link.symlink_to(tmp_path / "..data" / "config.toml")
    with pytest.raises(ConfigError) as caught:
        load_config(None, DRIVERS, default_path=str(link))
    assert caught.value.reason == "does not exist"


def test_default_path_constant() -> None:
    assert DEFAULT_CONFIG_PATH == "/etc/device-plugin-host/config.toml"


def test_errors_in_a_loaded_file_name_that_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(GPU + "[resource.selectors]\nvendor = 0x10000\n")
    with pytest.raises(ConfigError) as caught:
        load_config(str(path), DRIVERS)
    assert str(caught.value) == (
        f"{path}: resource[0] (example.com/gpu).selectors.vendor: PCI ids are 16-bit"
        " (0x0000 to 0xffff)"
    )


# -- defaults ---------------------------------------------------------------------------------


def test_default_config_collects_every_drivers_defaults() -> None:
    config = default_config(DRIVERS)
    assert config.path is None and config.is_default is True
    assert config.host == HostSettings()
    assert [(r.name, r.driver) for r in config.resources] == [
        ("example.com/gpu", "gpu"),
        ("example.com/gpu-amd", "gpu"),
    ]
    # Defaults register only once a device exists, whatever the driver set.
    assert not any(r.register_when_empty for r in config.resources)


def test_host_settings_defaults() -> None:
    host = HostSettings()
    assert host.plugin_dir == "/var/lib/kubelet/device-plugins"
    assert host.host_root == "/"
    assert host.pod_resources_socket == "/var/lib/kubelet/pod-resources/kubelet.sock"
    assert (host.log_level, host.log_format) == ("info", "plain")
    assert host.allocate_timeout_s == 5.0 and host.discover_timeout_s == 30.0
    assert host.register_timeout_s == 20.0
    assert host.rescan_interval_s == 300.0 and host.vanished_grace_s == 300.0


def test_broken_driver_defaults_are_dropped_with_a_reason(caplog: pytest.LogCaptureFixture) -> None:
    class Raises(Driver):
        name = "raises"

        def default_resources(self) -> Sequence[ResourceConfig]:
            raise RuntimeError("no sysfs at import")

    class Clashes(Driver):
        name = "zclash"  # sorts after "gpu": the first owner keeps the name
        selector_types = {"vendor": (str,)}

        def default_resources(self) -> Sequence[ResourceConfig]:
            return [
                ResourceConfig("example.com/gpu", "zclash"),
                ResourceConfig("no-domain", "zclash"),
                ResourceConfig("example.com/bad-selector", "zclash", {"colour": "red"}),
                ResourceConfig("example.com/ok", "someone-else"),
            ]

    drivers = {"gpu": FakeGpu(), "raises": Raises(), "zclash": Clashes()}
    with caplog.at_level(logging.WARNING, logger="host.config"):
        config = default_config(drivers)
    assert [(r.name, r.driver) for r in config.resources] == [
        ("example.com/gpu", "gpu"),
        ("example.com/gpu-amd", "gpu"),
        ("example.com/ok", "zclash"),  # a resource belongs to the driver that offered it
    ]
    text = caplog.text
    assert "'raises'" in text and "no sysfs at import" in text
    assert "already served by driver 'gpu'" in text
    assert "'no-domain' is not a valid resource name" in text
    assert "example.com/bad-selector" in text and "colour" in text


# -- overrides --------------------------------------------------------------------------------


def test_overrides_win_and_leave_the_rest_alone() -> None:
    config = parse(FULL)
    changed = config.with_overrides(plugin_dir="/k/plugins/", host_root="/mnt/host")
    assert changed.host.plugin_dir == "/k/plugins"
    assert changed.host.host_root == "/mnt/host"
    assert changed.host.log_format == "json"
    assert changed.resources == config.resources and changed.path == config.path
    assert config.host.host_root == "/host"  # the original is untouched


def test_overrides_none_is_a_no_op() -> None:
    config = parse(FULL)
    assert config.with_overrides() == config
    assert config.with_overrides(plugin_dir=None, host_root="/x").host.plugin_dir == (
        config.host.plugin_dir
    )


@pytest.mark.parametrize(
    ("kwargs", "key", "fragment"),
    [
        ({"plugin_dir": "relative/dir"}, "--plugin-dir", "absolute path"),
        ({"host_root": "/host/../.."}, "--host-root", "'..'"),
    ],
)
def test_bad_override_is_a_config_error(kwargs: Dict[str, str], key: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as caught:
        default_config(DRIVERS).with_overrides(**kwargs)
    assert (caught.value.file, caught.value.key) == ("command line", key)
    assert fragment in caught.value.reason


# -- the shipped file -------------------------------------------------------------------------


def test_shipped_config_is_exactly_the_builtin_defaults() -> None:
    config = parse_config(SHIPPED.read_text(encoding="utf-8"), str(SHIPPED), DRIVERS)
    assert config.host == HostSettings()
    assert config.resources == default_config(DRIVERS).resources
    assert config.is_default is True


def test_shipped_config_documents_every_host_setting_with_its_default() -> None:
    # Uncommenting the documented [host] lines must give the defaults back, and every field
    # must be there: the file is the operator's reference and must not drift from the code.
    lines = SHIPPED.read_text(encoding="utf-8").splitlines()
    start = lines.index("# [host]")
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("# ----"))
    assignment = re.compile(r"# ([a-z_]+ = .*)\Z")
    uncommented = ["[host]"] + [
        match[1] for line in lines[start:end] if (match := assignment.match(line))
    ]
    config = parse_config("\n".join(uncommented), "shipped", DRIVERS)
    assert config.host == HostSettings()
    written = {line.split(" = ")[0] for line in uncommented[1:]}
    assert written == {f.name for f in dataclasses.fields(HostSettings)}


# -- examples ---------------------------------------------------------------------------------


class Documented(Driver):
    """A driver accepting exactly the documented keys, so examples are checked for typos and
    shape even before (and independently of) the real drivers."""

    def __init__(self, name: str, selectors: Sequence[str], settings: Mapping[str, tuple]):
        self.name = name  # type: ignore[misc]
        self.selector_types = {key: (str, int) for key in selectors}  # type: ignore[misc]
        self.setting_types = dict(settings)  # type: ignore[misc]


_PCI = ("vendor", "device", "kernel_driver", "pci_address")
DOCUMENTED: Dict[str, Driver] = {
    d.name: d
    for d in (
        Documented("gpu", (*_PCI, "class", "partition_mode", "mig_profile", "mig_parent",
                           "mig_gi", "mig_ci"),
                   {"mig_strategy": (str,), "nvidia_modeset": (bool,)}),
        Documented(
            "sriov",
            (*_PCI, "pf_name", "pf_pci_address", "vf_index", "link_type", "rdma",
             "pf_kernel_driver", "qat_services", "vgpu_type"),
            {"iommufd": (bool,), "device_info": (bool,), "device_info_dir": (str,)},
        ),
        Documented(
            "usb",
            ("vendor", "product", "serial", "interface_class", "device_class", "port"),
            {"limit": (int,), "shared": (int,), "include_interfaces": (list,)},
        ),
        Documented(
            "fpga",
            (*_PCI, "kind", "afu_id", "interface_id", "shell"),
            {"mode": (str,), "pre_start": (list,), "pre_start_timeout_s": (int, float)},
        ),
        Documented(
            "rdma",
            (*_PCI, "ib_device", "link_layer", "netdev"),
            {"mode": (str,), "shared_count": (int,)},
        ),
        Documented("accel", (*_PCI, "class", "device_type"), {"index_env": (str,)}),
        Documented("neuron", ("index", "device_name", "instance_type"), {"unit": (str,)}),
        Documented("pci", (*_PCI, "class"), {"char_classes": (list,)}),
    )
}


def _drivers_used(path: Path) -> List[str]:
    document = tomllib.loads(path.read_text(encoding="utf-8"))
    return sorted({entry["driver"] for entry in document.get("resource", [])})


def test_there_are_examples_for_each_builtin_driver() -> None:
    used = {name for path in EXAMPLES for name in _drivers_used(path)}
    assert used == {"gpu", "sriov", "usb", "fpga", "rdma", "accel", "neuron", "pci"}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_uses_only_documented_keys(path: Path) -> None:
    config = load_config(str(path), DOCUMENTED)
    assert config.resources and not config.is_default


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_is_valid_for_the_real_drivers(path: Path) -> None:
    drivers: Dict[str, Driver] = {}
    for kind in _drivers_used(path):
        try:
            plugin = importlib.import_module(f"drivers.{kind}.plugin")
        except ImportError as error:
            pytest.skip(f"driver {kind!r} does not import yet: {error}")
        for driver in plugin.device_plugin_host_drivers():
            drivers[driver.name] = driver
    config = load_config(str(path), drivers)
    assert {r.driver for r in config.resources} == set(_drivers_used(path))


# -- hostile files ---------------------------------------------------
def _check_config(*args: str):
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "host", "check-config", *args],
                          capture_output=True, text=True, timeout=60, env=env, cwd=REPO)


@pytest.mark.parametrize("nesting", ["x = " + "[" * 5000 + "]" * 5000,
                                     "x = " + "{a = " * 5000 + "1" + "}" * 5000,
                                     "[host]\nx = " + "[" * 300 + "]" * 300])
def test_deeply_nested_toml_is_a_config_error(nesting: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(nesting + "\n", "deep.toml", DRIVERS)
    assert caught.value.file == "deep.toml"
    if len(nesting) > 5000:  # too deep to parse; 300 levels parse and fail as a wrong type
        assert caught.value.key.startswith("line 1, column ")
        assert "nested too deeply" in caught.value.reason


def test_check_config_of_deeply_nested_toml_exits_2_with_one_line(tmp_path: Path) -> None:
    deep = tmp_path / "deep.toml"
    deep.write_text("[host]\nlog_level = " + "[" * 5000 + "]" * 5000 + "\n")
    result = _check_config(str(deep))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert f"{deep}: line 2, column " in result.stderr and "nested too deeply" in result.stderr


def test_check_config_of_an_empty_file_says_it_means_the_builtin_defaults(tmp_path: Path) -> None:
    empty = tmp_path / "empty.toml"
    empty.write_text("")
    result = _check_config(str(empty))
    assert result.returncode == 0
    assert "empty" in result.stdout and "built-in defaults" in result.stdout
    host_only = tmp_path / "host.toml"
    host_only.write_text('[host]\nlog_level = "debug"\n')
    result = _check_config(str(host_only))
    assert result.returncode == 0
    assert "no [[resource]]" in result.stdout and "built-in defaults" in result.stdout


@pytest.mark.parametrize("text, key", [
    ('[host]\nlog_level = "info"\nlog_level = "debug"\n', "host.log_level"),
    ('[[resource]]\nname = "example.com/a"\ndriver = "gpu"\n'
     '[[resource]]\nname = "example.com/b"\nname = "example.com/c"\n', "resource[1].name"),
    ('[[resource]]\nname = "example.com/a"\ndriver = "gpu"\n[resource.selectors]\n'
     'vendor = "0x10de"\nvendor = "0x1002"\n', "resource[0].selectors.vendor"),
    ('[host]\n"log_level" = "info"\nlog_level = "info"\n', "host.log_level"),
])
def test_a_duplicate_key_names_the_key(text: str, key: str) -> None:
    error = error_of(text)
    assert error.key == key
    assert "set twice (again at line " in error.reason


def test_the_base_config_does_not_say_it_is_read_once() -> None:
    """Live reload exists (README "Live reload"); the DaemonSet's config must not deny it."""
    text = (REPO / "deploy" / "kubernetes" / "base" / "config.toml").read_text()
    comments = " ".join(line.lstrip("# ") for line in text.splitlines() if line.startswith("#"))
    assert "once, at start" not in comments and "only at start" not in comments
    assert "reloads it live" in comments and "rejected" in comments


def test_the_documented_keys_are_each_built_in_driver_s_keys_and_in_the_docs() -> None:
    """The examples are checked against DOCUMENTED; this keeps DOCUMENTED equal to what each
    built-in driver accepts, and every such key named in docs/drivers.md, so a new selector or
    setting cannot land undocumented (each setting is in docs/drivers.md)."""
    from host.config.plugins import DriverRegistry
    from host.core.hookspecs import ENTRY_POINT_GROUP

    registry = DriverRegistry()
    registry.load_entry_points(ENTRY_POINT_GROUP)
    docs = (REPO / "docs" / "drivers.md").read_text()
    for name, documented in DOCUMENTED.items():
        real = registry.drivers[name]
        assert set(real.selector_types) == set(documented.selector_types), name
        assert set(real.setting_types) == set(documented.setting_types), name
        missing = [key for key in (*real.selector_types, *real.setting_types)
                   if f"`{key}" not in docs]
        assert missing == [], name
