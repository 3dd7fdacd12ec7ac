"""The wheel installs into a training environment without touching its torch.

Builds castor's wheel (not editable) from a copy of the sources, then installs it into a fresh venv that
already holds torch 2.5.0, with pip resolving every dependency from a local wheelhouse only (no index, no
pip configuration): the wheelhouse also offers torch 2.13.0, the version constraints.txt pins, so a
castor that still pinned torch would make pip replace the environment's torch.

Both torches are fake distributions built here (a `torch` package with a __version__ and nothing else):
installing a real second torch takes minutes and a GB, and what is under test is pip's resolution, which
only reads the metadata. Everything else (numpy, xxhash, httpx, aetcd, pyyaml and what they need) is the
real code, repacked from this .venv into wheels, so `import worker_lib.persistent` runs real imports.
"""

from __future__ import annotations

import base64
import email.parser
import hashlib
import importlib.metadata as md
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]
SOURCES = ["pyproject.toml", "setup.py", "README.md", "services", "worker_lib", "migrations"]
DIST_INFO_SKIP = {"INSTALLER", "REQUESTED", "RECORD", "direct_url.json"}


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def _write_wheel(path: Path, dist_info: str, files: dict[str, bytes | Path]) -> None:
    """A wheel with `files` (archive name -> bytes, or a file to store) and a RECORD of them."""
    record = []
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as wheel:
        for name, content in files.items():
            data = content.read_bytes() if isinstance(content, Path) else content
            wheel.writestr(name, data)
            record.append(_record_line(name, data))
        record.append(f"{dist_info}/RECORD,,")
        wheel.writestr(f"{dist_info}/RECORD", "\n".join(record) + "\n")


def fake_torch(directory: Path, version: str) -> Path:
    dist_info = f"torch-{version}.dist-info"
    path = directory / f"torch-{version}-py3-none-any.whl"
    _write_wheel(
        path,
        dist_info,
        {
            "torch/__init__.py": f'__version__ = "{version}"\nFAKE = True\n'.encode(),
            f"{dist_info}/METADATA": f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n".encode(),
            f"{dist_info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: castor-test\nRoot-Is-Purelib: true\n"
            b"Tag: py3-none-any\n",
        },
    )
    return path


def repack(dist: md.Distribution, directory: Path) -> None:
    """The installed distribution `dist` as a wheel again: its files (per its RECORD) under their
    site-packages names, its dist-info less what the installer wrote, named with its own wheel tag."""
    site = Path(str(dist.locate_file("")))
    files: dict[str, bytes | Path] = {}
    tag = "py3-none-any"
    for entry in dist.files or []:
        name = entry.as_posix()
        if name.startswith("..") or "__pycache__" in name or Path(name).name in DIST_INFO_SKIP:
            continue  # console scripts (outside site-packages), bytecode, the installer's own files
        if (site / name).is_file():
            files[name] = site / name
    wheel_meta = next(p for n, p in files.items() if n.endswith(".dist-info/WHEEL"))
    assert isinstance(wheel_meta, Path)
    lines = wheel_meta.read_text().splitlines()
    tags = [line.split(":", 1)[1].strip() for line in lines if line.startswith("Tag:")]
    # A universal wheel lists py2-none-any before py3-none-any: take one this Python accepts.
    tag = next((t for t in tags if not t.startswith("py2")), tag)
    dist_info = next(n.split("/")[0] for n in files if n.split("/")[0].endswith(".dist-info"))
    name = canonicalize_name(dist.metadata["Name"]).replace("-", "_")
    _write_wheel(directory / f"{name}-{dist.version}-{tag}.whl", dist_info, files)


def base_closure(wheel: Path) -> list[md.Distribution]:
    """The installed distributions the base requirements of `wheel` (castor's) need, torch excepted,
    transitively."""
    with zipfile.ZipFile(wheel) as archive:
        metadata = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        fields = email.parser.BytesParser().parsebytes(archive.read(metadata))
        pending = [Requirement(r) for r in fields.get_all("Requires-Dist") or []]
    environment = {k: str(v) for k, v in default_environment().items()}
    seen: dict[tuple[str, str], md.Distribution] = {}
    while pending:
        requirement = pending.pop()
        name = canonicalize_name(requirement.name)
        for extra in ["", *requirement.extras]:  # sqlalchemy[asyncio] needs greenlet, ...
            if (name, extra) in seen or name == "torch":
                continue
            if requirement.marker is not None and not requirement.marker.evaluate(
                environment | {"extra": ""}
            ):
                continue
            seen[name, extra] = dist = md.distribution(name)
            for spec in dist.requires or []:
                dependency = Requirement(spec)
                if dependency.marker is None or dependency.marker.evaluate(environment | {"extra": extra}):
                    pending.append(Requirement(str(dependency).split(";")[0]))
    return list({name: dist for (name, _), dist in seen.items()}.values())


def _pip_env(tmp: Path) -> dict[str, str]:
    # No pip configuration (this machine's adds indexes, wheel folders and a constraints file): the local
    # wheelhouse is all pip sees.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    return env | {
        "PIP_CONFIG_FILE": os.devnull,
        "PIP_NO_INPUT": "1",
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
        "HOME": str(tmp),
    }


def _run(command: list[str], env: dict[str, str]) -> str:
    # Run outside the checkout: `python -c` puts the working directory first on sys.path.
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300, cwd=env["HOME"])
    assert result.returncode == 0, f"{command}\n{result.stdout}\n{result.stderr}"
    return result.stdout


def test_wheel_installs_beside_an_existing_torch_and_carries_the_migrations(tmp_path: Path) -> None:
    env = _pip_env(tmp_path)
    sources, wheelhouse, venv = tmp_path / "src", tmp_path / "wheelhouse", tmp_path / "venv"
    wheelhouse.mkdir()
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, sources / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            sources.mkdir(exist_ok=True)
            shutil.copy(REPO / name, sources / name)
    # The wheel, built with this .venv's setuptools (no build isolation: nothing to download).
    pip = [sys.executable, "-m", "pip"]
    _run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheelhouse), str(sources)], env)
    (castor_wheel,) = wheelhouse.glob("castor-*.whl")

    existing = fake_torch(tmp_path, "2.5.0")
    fake_torch(wheelhouse, "2.13.0")  # what a pinned castor would pull in
    for dist in base_closure(castor_wheel):
        repack(dist, wheelhouse)

    _run([sys._base_executable, "-m", "venv", "--without-pip", str(venv)], env)  # type: ignore[attr-defined]
    python = str(venv / "bin" / "python")
    target = [*pip, "--python", python, "install", "--no-index", "--find-links", str(wheelhouse)]
    _run([*target, str(existing)], env)
    _run([*target, str(castor_wheel)], env)
    _run([*pip, "--python", python, "check"], env)

    report = json.loads(
        _run(
            [
                python,
                "-c",
                """
import importlib.metadata as md, importlib.util, json, torch
import worker_lib, worker_lib.persistent, worker_lib.persistent_keys
files = [f.as_posix() for f in md.files("castor")]
print(json.dumps({
    "torch": torch.__version__, "fake": getattr(torch, "FAKE", False), "worker_lib": worker_lib.__version__,
    "migrations": sorted(f for f in files if f.startswith("services/root/db/migrations/")),
    "fastapi": importlib.util.find_spec("fastapi") is not None,
    "worker_lib_file": worker_lib.__file__,
}))
""",
            ],
            env,
        )
    )
    assert report["torch"] == "2.5.0" and report["fake"], report  # pip left the environment's torch alone
    assert report["worker_lib"] == "0.1.0"
    assert not report["fastapi"], "the base install brought the root service's dependencies"
    assert report["worker_lib_file"].startswith(str(venv)), "worker_lib imported from outside the fresh venv"
    migrations = set(report["migrations"])
    assert "services/root/db/migrations/env.py" in migrations
    assert "services/root/db/migrations/script.py.mako" in migrations
    shipped = {Path(m).name for m in migrations if m.startswith("services/root/db/migrations/versions/")}
    in_repo = {p.name for p in (sources / "migrations" / "versions").glob("*.py")}
    assert in_repo <= shipped, in_repo - shipped
    # The CLI's worker and operator commands run on the base install.
    assert "agent" in _run([str(venv / "bin" / "castor"), "--help"], env)
