"""The CLI's pure pieces, in process: durations, relative times, tables, phases, token masking and the
connection settings' precedence."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from services import cli_ops
from services.cli import _split_launch_command, build_parser


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
    assert cli_ops.format_duration(seconds) == text


def test_relative_and_absolute_times() -> None:
    now = datetime(2026, 1, 2, 12, 0, 0, tzinfo=UTC)
    assert cli_ops.format_ago((now - timedelta(seconds=12)).isoformat(), now) == "12 s ago"
    assert cli_ops.format_ago("2026-01-02T11:57:00Z", now) == "3 min ago"
    assert cli_ops.format_ago(now - timedelta(hours=5, minutes=3), now) == "5 h ago"
    assert cli_ops.format_ago(now, now) == "just now"
    assert cli_ops.format_ago(now + timedelta(seconds=30), now) == "in 30 s"
    assert cli_ops.format_ago(None, now) == "-"
    shown = cli_ops.format_time("2026-01-02T11:59:50Z", now)
    assert shown.endswith("(10 s ago)") and shown[:4] == "2026"


def test_render_table_aligns_and_right_aligns_numbers() -> None:
    table = cli_ops.render_table(
        ("NAME", "ITER", "STATE"), [("a", 5, "running"), ("longer-name", 12345, None), ("b", None, "x")]
    )
    assert table.splitlines() == [
        "NAME          ITER  STATE",
        "a                5  running",
        "longer-name  12345  -",
        "b                -  x",
    ]


def test_phase_rows_skipped_and_pending() -> None:
    failure = {
        "detected_at": "2026-01-02T12:00:00Z",
        "classified_at": "2026-01-02T12:00:00.250Z",
        "replaced_at": None,  # a software failure: no replacement
        "restored_at": "2026-01-02T12:00:03.250Z",
        "resumed_at": None,
    }
    rows = {name: took for name, _, took in cli_ops.phase_rows(failure)}
    assert rows == {
        "detect": "",
        "classify": "250 ms",
        "replace": "skipped",
        "restore": "3.0 s",
        "resume": "pending",
        "recovery time": "-",
    }
    failure["resumed_at"] = "2026-01-02T12:03:12Z"
    failure["recovery_s"] = 192.0  # the API's recovery time: detection to training resumed
    rows = {name: took for name, _, took in cli_ops.phase_rows(failure)}
    assert rows["resume"] == "3 min 9 s" and rows["recovery time"] == "3 min 12 s"


def test_mask_token() -> None:
    assert cli_ops.mask_token("castor-admin.abcdefghijklmnop") == "castor-admin.abcd..."
    assert cli_ops.mask_token("wrong") == "w... (5 characters)"
    assert "secret-value" not in cli_ops.mask_token("secret-value-that-is-long")


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

    flag = cli_ops.resolve_connection("10.0.0.1:8080", "from-flag", env, tmp_path)
    assert (flag.root_url, flag.token, flag.token_source) == ("http://10.0.0.1:8080", "from-flag", "--token")
    from_env = cli_ops.resolve_connection(None, None, env, tmp_path)
    assert (from_env.root_url, from_env.token, from_env.token_source) == (
        "http://root:9000",
        "from-env",
        "CASTOR_ADMIN_TOKEN",
    )
    del env["CASTOR_ADMIN_TOKEN"]
    assert cli_ops.resolve_connection(None, None, env, tmp_path).token == "from-state-dir"
    del env["CASTOR_STATE_DIR"]
    dot = cli_ops.resolve_connection(None, None, env, tmp_path)
    assert (dot.token, dot.token_source) == ("from-dot-castor", "the file .castor/admin-token")
    assert cli_ops.resolve_connection(None, None, {}, tmp_path).root_url == cli_ops.DEFAULT_ROOT_URL
    with pytest.raises(cli_ops.CliError, match="no admin token"):
        cli_ops.resolve_connection(None, None, {}, tmp_path / "state")


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
