"""The CLI's pure pieces, in process: durations, relative times, tables, phases, token masking and the
connection settings' precedence."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from services.cli import _split_launch_command, build_parser, client, failures, render
from tests.integration.cli.conftest import Root, castor, castor_on_tty, create_job, unique


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (None, "-"),
        (0, "0 s"),
        (0.35, "350 ms"),
        (1.24, "1.2 s"),
        (42.4, "42 s"),
        (180, "3 min"),
        (192, "3 min 12 s"),
        (725, "12 min"),
        (7500, "2 h 5 min"),
        (3 * 86400 + 4 * 3600 + 5, "3 d 4 h"),
    ],
)
def test_format_duration(seconds: float | None, text: str) -> None:
    assert render.format_duration(seconds) == text


def test_relative_and_absolute_times() -> None:
    now = datetime(2026, 1, 2, 12, 0, 0, tzinfo=UTC)
    assert render.format_ago((now - timedelta(seconds=12)).isoformat(), now) == "12 s ago"
    assert render.format_ago("2026-01-02T11:57:00Z", now) == "3 min ago"
    assert render.format_ago(now - timedelta(hours=5, minutes=3), now) == "5 h ago"
    assert render.format_ago(now, now) == "just now"
    assert render.format_ago(now + timedelta(seconds=30), now) == "in 30 s"
    assert render.format_ago(None, now) == "-"
    shown = render.format_time("2026-01-02T11:59:50Z", now)
    assert shown.endswith("(10 s ago)") and shown[:4] == "2026"


def test_render_table_aligns_and_right_aligns_numbers() -> None:
    table = render.render_table(
        ("NAME", "ITER", "STATE"), [("a", 5, "running"), ("longer-name", 12345, None), ("b", None, "x")]
    )
    assert table.splitlines() == [
        "NAME          ITER  STATE",
        "a                5  running",
        "longer-name  12345  -",
        "b                -  x",
    ]


def test_phase_rows_are_the_apis_phases() -> None:
    """The CLI shows the phases the API computed (the pages' phases), the last one under way."""
    failure = {
        "detected_at": "2026-01-02T12:00:00Z",
        "recovery_s": None,
        "phases": [
            {
                "name": "detect",
                "start": "2026-01-02T11:59:58Z",
                "end": "2026-01-02T12:00:00Z",
                "seconds": 2.0,
            },
            {"name": "classify", "start": "2026-01-02T12:00:00Z", "end": None, "seconds": 12.5},
        ],
    }
    rows = {name: took for name, _, took in failures.phase_rows(failure)}
    assert rows == {"detect": "2.0 s", "classify": "under way, 12 s so far", "recovery time": "-"}


def test_phase_rows_without_the_apis_phases_are_computed_as_the_pages_do() -> None:
    failure = {
        "kind": "software",
        "state": "recovered",
        "detected_at": "2026-01-02T12:00:00Z",
        "classified_at": "2026-01-02T12:00:00.250Z",
        "replaced_at": None,  # a software failure: no replacement
        "restored_at": "2026-01-02T12:00:03.250Z",
        "resumed_at": "2026-01-02T12:03:12Z",
        "recovery_s": 192.0,  # the API's recovery time: detection to training resumed
        "details": {},
    }
    rows = {name: took for name, _, took in failures.phase_rows(failure)}
    assert rows == {
        "detect": "0 s",  # a process exit is detected when its agent reports it
        "classify": "250 ms",
        "restore": "3.0 s",
        "resume": "3 min 9 s",
        "recovery time": "3 min 12 s",
    }
    failure.update(state="recovering", resumed_at=None, recovery_s=None)
    rows = {name: took for name, _, took in failures.phase_rows(failure)}
    assert rows["resume"].startswith("under way") and rows["recovery time"] == "-"


def test_mask_token() -> None:
    assert client.mask_token("castor-admin.abcdefghijklmnop") == "castor-admin.abcd..."
    assert client.mask_token("wrong") == "w... (5 characters)"
    assert "secret-value" not in client.mask_token("secret-value-that-is-long")


def test_connection_precedence(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    (state / "admin-token").write_text("from-state-dir\n")
    (tmp_path / ".castor").mkdir()
    (tmp_path / ".castor" / "admin-token").write_text("from-dot-castor\n")
    env = {
        "CASTOR_ROOT_URL": "http://root:9000/",
        "CASTOR_ADMIN_TOKEN": "from-env",
        "CASTOR_STATE_DIR": str(state),
    }

    flag = client.resolve_connection("10.0.0.1:8080", "from-flag", env, tmp_path)
    assert (flag.root_url, flag.token, flag.token_source) == ("http://10.0.0.1:8080", "from-flag", "--token")
    from_env = client.resolve_connection(None, None, env, tmp_path)
    assert (from_env.root_url, from_env.token, from_env.token_source) == (
        "http://root:9000",
        "from-env",
        "CASTOR_ADMIN_TOKEN",
    )
    del env["CASTOR_ADMIN_TOKEN"]
    assert client.resolve_connection(None, None, env, tmp_path).token == "from-state-dir"
    del env["CASTOR_STATE_DIR"]
    dot = client.resolve_connection(None, None, env, tmp_path)
    assert (dot.token, dot.token_source) == ("from-dot-castor", "the file .castor/admin-token")
    assert client.resolve_connection(None, None, {}, tmp_path).root_url == client.DEFAULT_ROOT_URL
    with pytest.raises(client.CliError, match="no admin token"):
        client.resolve_connection(None, None, {}, tmp_path / "state")


def test_launch_command_is_cut_at_the_first_double_dash() -> None:
    argv = ["jobs", "create", "j", "--machines", "2", "--launch", "--", "python", "t.py", "--json", "--", "x"]
    options, command = _split_launch_command(argv)
    assert command == ["python", "t.py", "--json", "--", "x"]
    args = build_parser(agent_arguments=False).parse_args(options)
    assert args.launch and args.machines == 2 and args.ops == "jobs_create"
    assert _split_launch_command(["agent", "--", "python"]) == (["agent", "--", "python"], [])


def test_existing_subcommands_still_parse() -> None:
    parser = build_parser()
    agent = parser.parse_args(
        ["agent", "--root", "http://r", "--job", "j", "--token", "t", "--", "python", "x.py"]
    )
    assert agent.root == "http://r" and agent.command == ["--", "python", "x.py"]
    assert parser.parse_args(["serve", "--port", "9"]).port == 9
    assert parser.parse_args(["db", "upgrade"]).revision == "head"


# ---- rich output against the real root: colours only on a terminal, --json untouched ---------------------

ANSI = "\x1b["


def _stopped_job(root: Root) -> dict[str, Any]:
    """A job whose documents no longer change (stopped: its ETTR and times are final)."""
    job = create_job(root, unique("render"), machines=2)
    root.api(
        "POST",
        f"/api/v1/worker/jobs/{job['id']}/machines",
        token=job["worker_token"],
        json={"instance_id": "i-render", "address": "127.0.0.1", "data_port": 9300},
    ).raise_for_status()
    root.api("POST", f"/api/v1/jobs/{job['id']}/stop").raise_for_status()
    return job


def test_tables_have_no_escape_sequences_without_a_terminal(root: Root) -> None:
    job = _stopped_job(root)
    for args in (("jobs", "list"), ("jobs", "show", job["name"]), ("failures", "list", job["name"])):
        result = castor(root, *args)
        assert result.returncode == 0, result.stderr
        assert ANSI not in result.stdout and ANSI not in result.stderr, (args, result.stdout)
    shown = castor(root, "jobs", "show", job["name"]).stdout
    machines = shown[shown.index("RANK") :].splitlines()
    assert machines[0].split()[:3] == ["RANK", "STATE", "INSTANCE"]
    assert machines[1].split()[:3] == ["0", "healthy", "i-render"]


def test_a_terminal_gets_colours_unless_no_color(root: Root, monkeypatch: pytest.MonkeyPatch) -> None:
    job = _stopped_job(root)
    code, screen = castor_on_tty(root, "jobs", "show", job["name"])
    assert code == 0 and "i-render" in screen
    assert ANSI in screen, "a terminal shows the states in colour"
    monkeypatch.setenv("NO_COLOR", "1")  # https://no-color.org: the CLI's rich console honours it
    code, screen = castor_on_tty(root, "jobs", "show", job["name"])
    assert code == 0 and "i-render" in screen
    assert ANSI not in screen, repr(screen)


def test_json_output_is_the_apis_documents_byte_for_byte(root: Root) -> None:
    job = _stopped_job(root)

    def document(value: Any) -> str:
        return json.dumps(value, indent=2, ensure_ascii=False) + "\n"

    api = f"/api/v1/jobs/{job['id']}"
    shown = castor(root, "jobs", "show", job["name"], "--json")
    expected = {
        "job": root.api("GET", api).json(),
        "machines": root.api("GET", f"{api}/machines").json(),
        "placement": root.api("GET", f"{api}/placement").json(),
        "failures": root.api("GET", f"{api}/failures").json(),
    }
    assert shown.stdout == document(expected)
    listed = castor(root, "jobs", "list", "--state", "stopped", "--limit", "500", "--json")
    page = root.api("GET", "/api/v1/jobs", params={"state": "stopped", "limit": 500}).json()
    assert listed.stdout == document(page)
    # On a terminal too: --json is never coloured or redrawn.
    code, screen = castor_on_tty(root, "jobs", "show", job["name"], "--json")
    assert code == 0 and ANSI not in screen
    assert json.loads(screen) == expected
