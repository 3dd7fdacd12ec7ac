"""Expected problems end in one clear line and exit code 1 (argparse's own errors: 2), never a traceback:
bad or missing tokens, an unreachable root, a URL that is not a root, unknown jobs. And the token lookup
the embedded demo relies on (its state directory's admin-token file)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.harness import free_port
from tests.integration.cli.conftest import ADMIN_TOKEN, Root, base_env, castor, create_job, unique


def test_wrong_token_says_which_token_and_where_from(root: Root) -> None:
    flag = castor(root, "jobs", "list", "--token", "castor-admin.not-the-right-one")
    assert flag.returncode == 1 and flag.stdout == ""
    assert f"the root service at {root.url} rejected the admin token castor-admin.not-" in flag.stderr
    assert "from --token" in flag.stderr and "not-the-right-one" not in flag.stderr, "the token is masked"

    env = castor(root, "jobs", "show", "anything", env={"CASTOR_ADMIN_TOKEN": "short"})
    assert env.returncode == 1 and "from CASTOR_ADMIN_TOKEN" in env.stderr and "rejected" in env.stderr


def test_worker_token_is_not_an_admin_token(root: Root) -> None:
    job = create_job(root, unique("worker-token"), machines=2)
    result = castor(root, "jobs", "list", "--token", job["worker_token"])
    assert result.returncode == 1
    assert "may not do this" in result.stderr and "not a job's worker token" in result.stderr


def test_token_from_the_state_directory(root: Root, tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    (state / "admin-token").write_text(ADMIN_TOKEN + "\n")
    result = castor(
        root, "jobs", "list", "--json", env={"CASTOR_ADMIN_TOKEN": "", "CASTOR_STATE_DIR": str(state)}
    )
    assert result.returncode == 0, result.stderr
    assert "items" in result.json()

    (state / "admin-token").write_text("castor-admin.stale-token-from-an-old-demo\n")
    stale = castor(root, "jobs", "list", env={"CASTOR_ADMIN_TOKEN": "", "CASTOR_STATE_DIR": str(state)})
    assert stale.returncode == 1 and f"from the file {state / 'admin-token'}" in stale.stderr


def test_token_from_dot_castor_in_the_working_directory(root: Root) -> None:
    dot_castor = root.workdir / ".castor"
    dot_castor.mkdir(exist_ok=True)
    (dot_castor / "admin-token").write_text(ADMIN_TOKEN + "\n")
    try:
        result = castor(root, "jobs", "list", "--json", env={"CASTOR_ADMIN_TOKEN": ""})
        assert result.returncode == 0, result.stderr
    finally:
        (dot_castor / "admin-token").unlink()
        dot_castor.rmdir()


def test_no_token_at_all(root: Root) -> None:
    result = castor(root, "jobs", "list", env={"CASTOR_ADMIN_TOKEN": ""})
    assert result.returncode == 1
    assert "no admin token: pass --token or set CASTOR_ADMIN_TOKEN" in result.stderr


def test_unreachable_root(root: Root) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    for command in (
        ["jobs", "list"],
        ["jobs", "show", "x"],
        ["failures", "list", "x"],
        ["jobs", "wait", "x"],
    ):
        result = castor(root, *command, "--root", url)
        assert result.returncode == 1, command
        assert result.stderr.strip() == (
            f"castor: error: cannot reach the root service at {url}: connection refused; "
            "is `castor serve` running? set --root or CASTOR_ROOT_URL"
        )
    env = castor(root, "jobs", "list", env={"CASTOR_ROOT_URL": url})
    assert env.returncode == 1 and f"cannot reach the root service at {url}" in env.stderr


def test_a_url_that_is_not_a_root(root: Root) -> None:
    result = castor(root, "jobs", "list", "--root", root.url + "/healthz")
    assert result.returncode == 1 and "the base URL of a Castor root service?" in result.stderr


def test_unknown_job_everywhere(root: Root) -> None:
    ghost = "00000000-0000-0000-0000-000000000000"
    for command in (
        ["jobs", "show", "no-such-job"],
        ["jobs", "show", ghost],
        ["jobs", "delete", "no-such-job", "--yes"],
        ["jobs", "wait", "no-such-job"],
        ["failures", "list", "no-such-job"],
        ["failures", "show", ghost, "1"],
    ):
        result = castor(root, *command)
        assert result.returncode == 1, command
        assert "no job with id or name" in result.stderr and "castor jobs list" in result.stderr, command


def test_usage_errors_exit_2(root: Root) -> None:
    assert castor(root, "jobs").returncode == 2
    assert castor(root, "jobs", "list", "--state", "sleeping").returncode == 2
    assert castor(root, "failures", "show", "job-only").returncode == 2


def test_operator_commands_do_not_import_torch_or_the_root_app(root: Root) -> None:
    probe = (
        "import sys\n"
        "from services.cli import main\n"
        f"code = main(['jobs', 'list', '--root', '{root.url}', '--token', '{ADMIN_TOKEN}'])\n"
        "heavy = [m for m in ('torch', 'services.root.app', 'worker_lib.agent.agent') if m in sys.modules]\n"
        "print(code, heavy)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env=base_env(), check=True, timeout=60
    )
    assert result.stdout.splitlines()[-1] == "0 []", result.stdout + result.stderr
