"""`castor agent` takes the worker token from a file or the environment, never needs the command line, and
keeps it out of what it starts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from services.cli import build_parser
from worker_lib.agent.cli import worker_token

TOKEN = "castor-job.00ff.secret"


def parse(*options: str):  # type: ignore[no-untyped-def]
    return build_parser().parse_args(["agent", "--root", "http://r", "--job", "j", *options, "--", "python"])


def test_the_token_file_is_read_and_the_variable_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "worker-token"
    path.write_text(TOKEN + "\n")
    monkeypatch.setenv("CASTOR_WORKER_TOKEN", "castor-job.other")
    assert worker_token(parse("--token-file", str(path))) == TOKEN
    assert "CASTOR_WORKER_TOKEN" not in os.environ, "nothing the agent starts may inherit it"
    monkeypatch.setenv("CASTOR_WORKER_TOKEN_FILE", str(path))
    assert worker_token(parse()) == TOKEN


def test_the_environment_variable_works_without_any_option(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CASTOR_WORKER_TOKEN_FILE", raising=False)
    monkeypatch.setenv("CASTOR_WORKER_TOKEN", TOKEN)
    assert worker_token(parse()) == TOKEN
    assert "CASTOR_WORKER_TOKEN" not in os.environ
    assert worker_token(parse()) is None


def test_token_on_the_command_line_still_works_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("CASTOR_WORKER_TOKEN_FILE", raising=False)
    assert worker_token(parse("--token", TOKEN)) == TOKEN
    assert "--token-file" in capsys.readouterr().err


def test_bad_token_sources_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CASTOR_WORKER_TOKEN_FILE", raising=False)
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(SystemExit, match="is empty"):
        worker_token(parse("--token-file", str(empty)))
    with pytest.raises(SystemExit, match="cannot read"):
        worker_token(parse("--token-file", str(tmp_path / "missing")))
    with pytest.raises(SystemExit, match="not both"):
        worker_token(parse("--token-file", str(empty), "--token", TOKEN))
