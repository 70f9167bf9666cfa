"""Files the host creates as root never go through a planted symlink, and have the modes we
say whatever the umask; state is kept only in a directory nobody else can write."""

from __future__ import annotations

import json
import logging
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from device_plugin_host_testing.drivers import make_devices
from host.core import fileio
from host.core.cdi import CdiWriter
from host.core.drains import DrainError, read_drains, update_drains
from host.outputs import devinfo, nfd

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def umask_000():
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


@pytest.fixture
def victim(tmp_path):
    """A file outside the written directory that a planted symlink points at."""
    outside = tmp_path / "outside"
    outside.mkdir()
    target = outside / "victim"
    target.write_text("precious\n")
    os.chmod(target, 0o600)
    return target


def _plant(directory: Path, names, target: Path) -> None:
    for name in names:
        os.symlink(target, directory / name)


def _every_pid_temp_name(base: str):
    """The temp names a writer using ``.<name>.<pid>.tmp`` could pick (pids of this run)."""
    return [f".{base}.{os.getpid()}.tmp"]


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_device_info_temp_file_is_not_opened_through_a_planted_symlink(tmp_path, victim,
                                                                        umask_000):
    directory = tmp_path / "devinfo"
    directory.mkdir()
    name = devinfo.file_name("intel.com/sriov", "0000:3b:01.2")
    _plant(directory, _every_pid_temp_name(name), victim)
    path = devinfo.write(str(directory), "intel.com/sriov", "0000:3b:01.2",
                         devinfo.pci_info("0000:3b:01.2"))
    assert victim.read_text() == "precious\n" and _mode(victim) == 0o600
    assert json.loads(Path(path).read_text())["pci"]["pci-address"] == "0000:3b:01.2"
    assert _mode(Path(path)) == 0o444 and not os.path.islink(path)


def test_nfd_temp_file_is_not_opened_through_a_planted_symlink(tmp_path, victim, umask_000):
    directory = tmp_path / "features.d"
    directory.mkdir()
    path = directory / "device-plugin-host"
    _plant(directory, _every_pid_temp_name(path.name), victim)
    missing = tmp_path / "outside" / "created"
    _plant(directory, [f".{path.name}.{os.getpid() + 1}.tmp"], missing)
    feature = nfd.FeatureFile(str(path))
    feature.update("example.com/gpu", make_devices("g", 2))
    assert feature.flush()
    assert victim.read_text() == "precious\n" and not missing.exists()
    assert "example.com/gpu.count=2" in path.read_text()
    assert _mode(path) == 0o644  # under umask 000 the old open() made it 0666


def test_a_symlink_planted_at_the_target_name_is_replaced_not_followed(tmp_path, victim):
    directory = tmp_path / "cdi"
    directory.mkdir()
    _plant(directory, ["device-plugin-host_example.com-gpu.json"], victim)
    writer = CdiWriter(str(directory))
    assert writer.update("example.com/gpu", make_devices("g", 1))
    spec = directory / "device-plugin-host_example.com-gpu.json"
    assert not spec.is_symlink() and json.loads(spec.read_text())["kind"] == "example.com/gpu"
    assert victim.read_text() == "precious\n"


def test_the_drain_lock_is_not_opened_through_a_planted_symlink(tmp_path, victim):
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    created = tmp_path / "outside" / "created-by-the-lock"
    _plant(state, [".drain.lock"], created)
    with pytest.raises(DrainError, match="symlink") as refused:
        update_drains(str(state / "drained"), ("example.com/gpu", "g0"), "bad fan")
    assert "\n" not in str(refused.value)
    assert not created.exists()
    os.unlink(state / ".drain.lock")
    _plant(state, [".drain.lock"], victim)
    with pytest.raises(DrainError, match="symlink"):
        update_drains(str(state / "drained"), ("example.com/gpu", "g0"), "bad fan")
    assert victim.read_text() == "precious\n" and _mode(victim) == 0o600
    assert read_drains(str(state / "drained")) == {}


def test_every_created_file_has_its_mode_whatever_the_umask(tmp_path, umask_000):
    state = tmp_path / "state"
    update_drains(str(state / "drained"), ("example.com/gpu", "g0"), "bad fan")
    assert _mode(state / "drained") == 0o600 and _mode(state / ".drain.lock") == 0o600
    assert _mode(state) == 0o700
    writer = CdiWriter(str(tmp_path / "cdi"))
    writer.update("example.com/gpu", make_devices("g", 1))
    assert _mode(Path(writer.path_for("example.com/gpu"))) == 0o644
    fileio.write_atomic(str(tmp_path / "dra" / "prepared-claims.json"), "{}\n", mode=0o600,
                        durable=True, make_dirs=True)
    assert _mode(tmp_path / "dra" / "prepared-claims.json") == 0o600
    leftovers = [p for p in tmp_path.rglob(".*") if p.name.endswith(".tmp")]
    assert leftovers == []


def test_a_temp_name_that_exists_is_never_opened(tmp_path, victim, monkeypatch):
    """The random name is fresh even when the first pick is taken by a planted symlink."""
    picks = iter([b"\0" * 6, b"\1" * 6])
    monkeypatch.setattr(os, "urandom", lambda n: next(picks))
    _plant(tmp_path, [".dph-" + "00" * 6 + ".tmp"], victim)
    fileio.write_atomic(str(tmp_path / "out"), "new\n", mode=0o644)
    assert (tmp_path / "out").read_text() == "new\n"
    assert victim.read_text() == "precious\n"


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o1777])
def test_a_state_directory_others_can_write_is_refused(tmp_path, mode):
    state = tmp_path / "state"
    state.mkdir()
    os.chmod(state, mode)
    with pytest.raises(DrainError) as refused:
        update_drains(str(state / "drained"), ("example.com/gpu", "g0"), "bad fan")
    line = str(refused.value)
    assert "writable by others" in line and str(state) in line and "\n" not in line
    assert not (state / "drained").exists() and not (state / ".drain.lock").exists()


def test_a_state_directory_owned_by_someone_else_is_refused(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to give a directory away")
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    os.chown(state, 65534, 65534)
    problem = fileio.private_dir_problem(str(state))
    assert problem is not None and "owned by uid 65534" in problem


def test_run_refuses_a_shared_state_directory_in_one_line(tmp_path, short_dir):
    state = tmp_path / "state"
    state.mkdir()
    os.chmod(state, 0o777)
    config = tmp_path / "host.toml"
    config.write_text(f'[host]\ndrain_file = "{state / "drained"}"\n'
                      f'plugin_dir = "{short_dir}"\n'
                      f'dra_state_dir = "{tmp_path / "dra"}"\n')
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-m", "host", "run", "--config", str(config)],
                          capture_output=True, text=True, timeout=60, cwd=REPO, env=env)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "writable by others" in lines[0] and str(state) in lines[0]


def test_a_shared_output_directory_is_written_with_one_warning(tmp_path, caplog):
    directory = tmp_path / "cdi"
    directory.mkdir()
    os.chmod(directory, 0o1777)
    writer = CdiWriter(str(directory))
    with caplog.at_level(logging.WARNING, logger="host.core.fileio"):
        writer.update("example.com/gpu", make_devices("g", 1))
        writer.update("example.com/gpu", make_devices("g", 2))
    warnings = [r for r in caplog.records if "writable by others" in r.getMessage()]
    assert len(warnings) == 1 and str(directory) in warnings[0].getMessage()


def test_a_durable_write_flushes_the_data_then_the_directory(tmp_path, monkeypatch):
    """``durable=True``: the file's data before the rename, its directory after; a plain write
    flushes nothing (the rename alone keeps a reader from seeing half a file)."""
    flushed = []
    real_fsync = os.fsync

    def fsync(fd):
        flushed.append(os.path.realpath(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    target = tmp_path / "sub" / "state.json"
    fileio.write_atomic(str(target), "{}\n", mode=0o600, durable=True, make_dirs=True)
    assert target.read_text() == "{}\n" and _mode(target) == 0o600
    assert len(flushed) == 2
    assert flushed[0].startswith(str(tmp_path / "sub" / ".dph-")) and flushed[1] == str(
        tmp_path / "sub")
    flushed.clear()
    fileio.write_atomic(str(target), "[]\n", mode=0o600)
    assert flushed == [] and target.read_text() == "[]\n"
