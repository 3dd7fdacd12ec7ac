"""The import boundary between the two halves of the distribution.

The root service (services.root and the CLI's server entry) never imports torch: it would cost every root
replica seconds of start-up and hundreds of MB, and `castor[server]` images need not load it. worker_lib
(the training side, `pip install castor`) never imports `services`. Each check runs in a fresh interpreter,
where sys.modules shows exactly what the imports pulled in.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Records who imports a module first (the stack names the culprit), without changing what gets imported.
_WATCH = """
import sys, traceback

class _Watch:
    def __init__(self, name):
        self.name, self.stack = name, None

    def find_spec(self, fullname, path=None, target=None):
        if self.stack is None and fullname.split(".")[0] == self.name:
            self.stack = "".join(traceback.format_stack(limit=25)[:-1])
        return None

def watch(name):
    w = _Watch(name)
    sys.meta_path.insert(0, w)
    return w
"""


def _run(body: str, tmp_path: Path) -> None:
    script = _WATCH + textwrap.dedent(body)
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "CASTOR_STATE_DIR": str(tmp_path), "HOME": str(tmp_path)},
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_root_service_never_imports_torch(tmp_path: Path) -> None:
    _run(
        """
        w = watch("torch")
        import importlib, pkgutil
        import services.root
        # Every module of the root service, not only those the app imports today.
        for module in pkgutil.walk_packages(services.root.__path__, "services.root."):
            importlib.import_module(module.name)
        # The server entry of the CLI: the parser (without the agent's options, which need torch) and
        # what `castor serve` builds.
        from services.cli import build_parser
        build_parser(agent_arguments=False).parse_args(["serve"])
        import services.cli.ops, services.cli.simulate
        from services.root.app import create_app
        from services.root.settings import Settings
        create_app(Settings(etcd_endpoints=[], cloud="local", s3_bucket=None))
        assert "torch" not in sys.modules, "the root service imported torch:\\n" + (w.stack or "")
        """,
        tmp_path,
    )


def test_worker_lib_never_imports_services_when_loaded(tmp_path: Path) -> None:
    _run(
        """
        w = watch("services")
        import importlib, pkgutil
        import worker_lib
        for module in pkgutil.walk_packages(worker_lib.__path__, "worker_lib."):
            if module.name.startswith("worker_lib.examples."):
                continue  # training scripts, run as programs
            importlib.import_module(module.name)
        import torch  # noqa: F401  (the real training side has it, so its modules are all importable)
        assert "services" not in sys.modules, "worker_lib imported services:\\n" + (w.stack or "")
        """,
        tmp_path,
    )


def test_no_worker_lib_source_imports_services() -> None:
    """Static: also the imports inside functions, which loading the modules does not run."""
    offenders = []
    for path in sorted((REPO / "worker_lib").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = (
                [alias.name for alias in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and node.level == 0
                else []
            )
            offenders += [
                f"{path.relative_to(REPO)}:{node.lineno} imports {name}"
                for name in names
                if name == "services" or name.startswith("services.")
            ]
    assert not offenders, offenders
