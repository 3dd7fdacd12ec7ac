"""Ships migrations/ inside the wheel, as services/root/db/migrations (pyproject.toml holds the rest).

migrations/ stays at the repository root, where Alembic's tooling and every migration's history expect it;
package data cannot reach outside a package, so build_py copies it into the built package instead.
services/root/db/migrate.py looks there first and falls back to the repository root (an editable install).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


class BuildPyWithMigrations(build_py):
    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return  # an editable install reads migrations/ where it is
        target = Path(self.build_lib) / "services" / "root" / "db" / "migrations"
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(ROOT / "migrations", target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))


setup(cmdclass={"build_py": BuildPyWithMigrations})
