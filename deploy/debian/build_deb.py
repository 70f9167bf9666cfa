#!/usr/bin/env python3
"""Build the device-plugin-host Debian package from this source tree, without debhelper.

    python3 deploy/debian/build_deb.py [-o dist] [--revision 1] [--python-version 3.11 ...]

The package carries a wheelhouse (the project's wheel, every dependency as a binary wheel,
and pip) and its postinst builds the virtual environment at /opt/device-plugin-host/venv
from it, offline. A venv cannot be built here and shipped: its scripts' shebangs and
pyvenv.cfg hold absolute paths and it is tied to one exact interpreter, the target's.

The wheels are chosen for the TARGET, not for the Python running this script: pip is asked
for each target Python version (default: the version of this machine's /usr/bin/python3)
and for manylinux platforms up to a glibc version (default: this machine's). The package's
Depends is derived from what was actually bundled: the Python range, and libc6 at least as
new as the newest manylinux tag a bundled wheel needs.

The only tools needed are pip (in the Python running this script) and dpkg-deb. The last
line printed is the path of the .deb.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

try:
    import tomllib
except ImportError:  # Python < 3.11
    import tomli as tomllib  # type: ignore[no-redef]

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
UNIT_FILE = REPO / "deploy" / "systemd" / "device-plugin-host.service"

PACKAGE = "device-plugin-host"
PREFIX = "/opt/device-plugin-host"
WHEEL_DIR = f"{PREFIX}/wheels"
CONFIG_PATH = "/etc/device-plugin-host/config.toml"
# /lib rather than /usr/lib: every deb-systemd-helper in use looks there, and on merged-/usr
# systems (Debian 12 and later) it is the same directory.
UNIT_DIR = "/lib/systemd/system"
DOC_DIR = f"/usr/share/doc/{PACKAGE}"
MANIFEST = "wheelhouse.json"

# Left out of the copy the wheel is built from: the build must not write build/ or
# *.egg-info into a checkout that others are working in.
_SOURCE_IGNORE = shutil.ignore_patterns(
    ".git", ".venv", "venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache",
    ".ruff_cache", ".hypothesis", ".mypy_cache", "shared",
)
_DEB_ARCH_TO_MACHINE = {"amd64": "x86_64", "arm64": "aarch64", "ppc64el": "ppc64le",
                        "s390x": "s390x", "i386": "i686", "armhf": "armv7l"}
_PLACEHOLDER = re.compile(r"@[A-Z_]+@")


class BuildError(RuntimeError):
    """A build step failed; the message says which and why."""


@dataclass(frozen=True)
class Project:
    name: str
    version: str
    summary: str
    dependencies: Tuple[str, ...]

    @property
    def dist_prefix(self) -> str:
        """The wheel file name prefix (PEP 427 escapes '-' in the name)."""
        return re.sub(r"[-_.]+", "_", self.name).lower() + "-"


@dataclass(frozen=True)
class Target:
    python_versions: Tuple[str, ...]
    arch: str
    glibc: str

    @property
    def platforms(self) -> List[str]:
        """Every manylinux tag a machine with this glibc and architecture can load."""
        machine = _DEB_ARCH_TO_MACHINE.get(self.arch, self.arch)
        major, minor = (int(x) for x in self.glibc.split(".")[:2])
        tags = [f"manylinux_{major}_{m}_{machine}" for m in range(5, minor + 1)]
        legacy = {"manylinux1": 5, "manylinux2010": 12, "manylinux2014": 17}
        tags += [f"{name}_{machine}" for name, floor in legacy.items() if minor >= floor]
        return tags


# -- metadata ----------------------------------------------------------------------------
def read_project(repo: Path = REPO) -> Project:
    with open(repo / "pyproject.toml", "rb") as stream:
        data = tomllib.load(stream)["project"]
    return Project(data["name"], data["version"], data.get("description", ""),
                   tuple(data.get("dependencies", ())))


def debian_version(pep440: str, revision: str) -> str:
    """0.2.0rc1 sorts before 0.2.0 in PEP 440; in Debian only with '~' (0.2.0~rc1)."""
    version = re.sub(r"\.?(a|b|rc|dev)(\d*)$", r"~\1\2", pep440)
    version = re.sub(r"\.?post(\d+)", r"+post\1", version)
    return f"{version}-{revision}"


def default_python_version() -> str:
    """The Debian python3 of this machine: the package is most often installed on its kind."""
    system = Path("/usr/bin/python3")
    if system.exists():
        code = "import sys; print('{}.{}'.format(*sys.version_info[:2]))"
        out = subprocess.run([str(system), "-c", code], capture_output=True, text=True,
                             check=False)
        if out.returncode == 0 and re.fullmatch(r"\d+\.\d+", out.stdout.strip()):
            return out.stdout.strip()
    return "{}.{}".format(*sys.version_info[:2])


def default_arch() -> str:
    if shutil.which("dpkg"):
        out = subprocess.run(["dpkg", "--print-architecture"], capture_output=True, text=True,
                             check=False)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    machine = platform.machine()
    return next((deb for deb, m in _DEB_ARCH_TO_MACHINE.items() if m == machine), machine)


def default_glibc() -> str:
    try:
        name = os.confstr("CS_GNU_LIBC_VERSION") or ""
    except (ValueError, OSError):
        name = ""
    match = re.search(r"(\d+\.\d+)", name)
    return match.group(1) if match else "2.17"


# -- wheelhouse --------------------------------------------------------------------------
def _pip(args: Sequence[str]) -> None:
    command = [sys.executable, "-m", "pip", "--disable-pip-version-check", *args]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise BuildError(f"{' '.join(command)} failed:\n{result.stdout}{result.stderr}")


def build_project_wheel(repo: Path, dest: Path, project: Project) -> Path:
    """Build the project's own wheel from a copy of the tree (never in the checkout)."""
    for old in dest.glob(project.dist_prefix + "*.whl"):
        old.unlink()
    with tempfile.TemporaryDirectory(prefix="dph-src-") as tmp:
        source = Path(tmp) / "src"
        shutil.copytree(repo, source, ignore=_SOURCE_IGNORE, symlinks=True)
        _pip(["wheel", "--no-deps", "--quiet", "--wheel-dir", str(dest), str(source)])
    wheels = sorted(dest.glob(project.dist_prefix + "*.whl"))
    if len(wheels) != 1:
        raise BuildError(f"expected one {project.name} wheel in {dest}, found {wheels}")
    return wheels[0]


def fill_wheelhouse(wheelhouse: Path, project: Project, target: Target, repo: Path = REPO) -> None:
    """Our wheel (always rebuilt: the source may have changed), then the dependency wheels
    for every target Python, reused when the wheelhouse was filled for the same target and
    dependencies (a test session builds several packages from one)."""
    wheelhouse.mkdir(parents=True, exist_ok=True)
    own = build_project_wheel(repo, wheelhouse, project)
    wanted = {
        "python_versions": list(target.python_versions), "arch": target.arch,
        "glibc": target.glibc, "dependencies": list(project.dependencies),
    }
    manifest = wheelhouse / MANIFEST
    try:
        if json.loads(manifest.read_text()) == wanted:
            return
    except (OSError, ValueError):
        pass
    for stale in wheelhouse.glob("*.whl"):
        if stale != own:
            stale.unlink()
    manifest.unlink(missing_ok=True)
    platforms = [arg for tag in target.platforms for arg in ("--platform", tag)]
    for version in target.python_versions:
        _pip(["download", "--quiet", "--only-binary=:all:", "--implementation", "cp",
              "--python-version", version, *platforms, "--dest", str(wheelhouse), str(own)])
    _pip(["download", "--quiet", "--only-binary=:all:", "--no-deps", "--dest", str(wheelhouse),
          "pip"])
    manifest.write_text(json.dumps(wanted, indent=1) + "\n")


def wheel_tags(path: Path) -> List[Tuple[str, str, str]]:
    """The (python, abi, platform) tags of a wheel file name, compressed sets expanded."""
    parts = path.name[: -len(".whl")].split("-")
    if len(parts) not in (5, 6):
        raise BuildError(f"not a wheel file name: {path.name}")
    pythons, abis, plats = parts[-3:]
    return [(p, a, s) for p in pythons.split(".") for a in abis.split(".")
            for s in plats.split(".")]


def glibc_needed(wheels: Iterable[Path]) -> Optional[Tuple[int, int]]:
    """The newest glibc any wheel needs: for each wheel its most lenient manylinux tag."""
    legacy = {"manylinux1": (2, 5), "manylinux2010": (2, 12), "manylinux2014": (2, 17)}
    needed: Optional[Tuple[int, int]] = None
    for wheel in wheels:
        floors = []
        for _, _, plat in wheel_tags(wheel):
            match = re.match(r"manylinux_(\d+)_(\d+)_", plat)
            if match:
                floors.append((int(match.group(1)), int(match.group(2))))
            elif plat.split("_")[0] in legacy:
                floors.append(legacy[plat.split("_")[0]])
        if floors:
            floor = min(floors)
            needed = floor if needed is None else max(needed, floor)
    return needed


def depends(target: Target, wheels: Sequence[Path]) -> str:
    versions = sorted(tuple(int(x) for x in v.split(".")) for v in target.python_versions)
    for (major, minor), nxt in zip(versions, versions[1:]):
        if nxt != (major, minor + 1):
            raise BuildError(f"Python versions must be consecutive, got {target.python_versions}")
    low, high = versions[0], versions[-1]
    fields = [f"python3 (>= {low[0]}.{low[1]})", f"python3 (<< {high[0]}.{high[1] + 1})"]
    glibc = glibc_needed(wheels)
    if glibc is not None:
        fields.append(f"libc6 (>= {glibc[0]}.{glibc[1]})")
    return ", ".join(fields)


def is_arch_specific(wheels: Iterable[Path]) -> bool:
    return any(plat != "any" for wheel in wheels for _, _, plat in wheel_tags(wheel))


# -- the package tree --------------------------------------------------------------------
def _fill(template: Path, values: Dict[str, str]) -> str:
    text = template.read_text()
    for key, value in values.items():
        text = text.replace(f"@{key}@", value)
    left = _PLACEHOLDER.findall(text)
    if left:
        raise BuildError(f"{template}: no value for {', '.join(sorted(set(left)))}")
    return text


def _put(root: Path, path: str, data: bytes, mode: int = 0o644) -> Path:
    dest = root / path.lstrip("/")
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_bytes(data)
    dest.chmod(mode)
    return dest


def _installed_kib(root: Path, wheels: Sequence[Path]) -> int:
    """The staged files plus what the venv will hold (the wheels unpacked; pip stays out)."""
    total = sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and not p.is_symlink())
    for wheel in wheels:
        if not wheel.name.startswith("pip-"):
            with zipfile.ZipFile(wheel) as archive:
                total += sum(info.file_size for info in archive.infolist())
    return (total + 1023) // 1024


def stage(root: Path, *, project: Project, target: Target, wheelhouse: Path, config: Path,
          version: str, maintainer: str) -> None:
    wheels = sorted(wheelhouse.glob("*.whl"))
    dist_wheels = [w for w in wheels if w.name.startswith(project.dist_prefix)]
    if len(dist_wheels) != 1 or not any(w.name.startswith("pip-") for w in wheels):
        raise BuildError(f"{wheelhouse} must hold one {project.name} wheel and pip")
    for wheel in wheels:
        _put(root, f"{WHEEL_DIR}/{wheel.name}", wheel.read_bytes())
    _put(root, CONFIG_PATH, config.read_bytes())
    _put(root, f"{UNIT_DIR}/{UNIT_FILE.name}", UNIT_FILE.read_bytes())
    _put(root, f"{DOC_DIR}/copyright", (HERE / "copyright").read_bytes())
    _put(root, f"{DOC_DIR}/README.md", (REPO / "README.md").read_bytes())
    for example in sorted((REPO / "config" / "examples").glob("*.toml")):
        _put(root, f"{DOC_DIR}/examples/{example.name}", example.read_bytes())
    link = root / "usr" / "bin" / PACKAGE
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(f"{PREFIX}/venv/bin/{PACKAGE}")
    for directory in [root, *(p for p in root.rglob("*") if p.is_dir())]:
        directory.chmod(0o755)

    dist_version = dist_wheels[0].name[len(project.dist_prefix):].split("-")[0]
    md5sums = "".join(
        f"{hashlib.md5(p.read_bytes()).hexdigest()}  {p.relative_to(root)}\n"
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.is_symlink() and f"/{p.relative_to(root)}" != CONFIG_PATH
    )
    values = {
        "VERSION": version,
        "ARCH": target.arch if is_arch_specific(wheels) else "all",
        "MAINTAINER": maintainer,
        "INSTALLED_SIZE": str(_installed_kib(root, wheels)),
        "DEPENDS": depends(target, wheels),
        "WHEELS": ", ".join(w.name.split("-")[0] + " " + w.name.split("-")[1] for w in wheels),
        "DIST_NAME": project.name,
        "DIST_VERSION": dist_version,
        "PYTHON_VERSIONS": ", ".join(target.python_versions),
    }
    _put(root, "DEBIAN/control", _fill(HERE / "control.in", values).encode())
    _put(root, "DEBIAN/conffiles", (HERE / "conffiles").read_bytes())
    _put(root, "DEBIAN/md5sums", md5sums.encode())
    for script in ("postinst", "prerm", "postrm"):
        _put(root, f"DEBIAN/{script}", _fill(HERE / script, values).encode(), 0o755)


def build(*, output: Path, revision: str = "1", config: Path = REPO / "config" / "config.toml",
          target: Optional[Target] = None, wheelhouse: Optional[Path] = None,
          maintainer: Optional[str] = None, repo: Path = REPO) -> Path:
    """Build the .deb into ``output`` and return its path."""
    if shutil.which("dpkg-deb") is None:
        raise BuildError("dpkg-deb not found (Debian package: dpkg)")
    project = read_project(repo)
    target = target or Target((default_python_version(),), default_arch(), default_glibc())
    maintainer = maintainer or _default_maintainer()
    version = debian_version(project.version, revision)
    output.mkdir(parents=True, exist_ok=True)
    deb = output / f"{PACKAGE}_{version}_{target.arch}.deb"
    with tempfile.TemporaryDirectory(prefix="dph-deb-") as tmp:
        house = wheelhouse or Path(tmp) / "wheels"
        fill_wheelhouse(house, project, target, repo)
        root = Path(tmp) / "root"
        root.mkdir()
        stage(root, project=project, target=target, wheelhouse=house, config=config,
              version=version, maintainer=maintainer)
        # Wheels are zip files already: xz would spend seconds to save almost nothing.
        result = subprocess.run(
            ["dpkg-deb", "--root-owner-group", "-Zgzip", "-z6", "--build", str(root), str(deb)],
            capture_output=True, text=True, check=False,
        )
        if result.returncode != 0:
            raise BuildError(f"dpkg-deb failed:\n{result.stdout}{result.stderr}")
    return deb


def _default_maintainer() -> str:
    name = os.environ.get("DEBFULLNAME", "device-plugin-host developers")
    email = os.environ.get("DEBEMAIL", "device-plugin-host@localhost")
    return f"{name} <{email}>"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-o", "--output", default=str(REPO / "dist"),
                        help="where the .deb goes (default: dist/)")
    parser.add_argument("--revision", default="1",
                        help="Debian revision: VERSION-REVISION (default 1)")
    parser.add_argument("--config", default=str(REPO / "config" / "config.toml"),
                        help="the file installed as /etc/device-plugin-host/config.toml")
    parser.add_argument("--python-version", action="append", metavar="X.Y",
                        help="a target Python (repeat for a consecutive range; "
                             "default: this machine's /usr/bin/python3)")
    parser.add_argument("--arch", help="Debian architecture (default: dpkg --print-architecture)")
    parser.add_argument("--glibc", help="oldest target glibc, e.g. 2.31 (default: this machine's)")
    parser.add_argument("--wheelhouse", help="keep the wheels here and reuse them next time")
    parser.add_argument("--maintainer", help="'Name <email>' (default: $DEBFULLNAME <$DEBEMAIL>)")
    args = parser.parse_args(argv)
    target = Target(
        tuple(args.python_version or [default_python_version()]),
        args.arch or default_arch(),
        args.glibc or default_glibc(),
    )
    try:
        deb = build(output=Path(args.output), revision=args.revision, config=Path(args.config),
                    target=target, maintainer=args.maintainer,
                    wheelhouse=Path(args.wheelhouse) if args.wheelhouse else None)
    except BuildError as error:
        print(f"build_deb: {error}", file=sys.stderr)
        return 1
    print(deb)
    return 0


if __name__ == "__main__":
    sys.exit(main())
