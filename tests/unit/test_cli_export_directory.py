"""`castor checkpoints export`'s target directory: an export that fails or is interrupted partway leaves
nothing behind, so that a retry with the same `--to` is not refused as "not an empty directory"."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.cli.checkpoints import export_directory
from services.cli.client import CliError


def write_part_of_an_export(target: Path) -> None:
    (target / "__0_0.distcp").write_bytes(b"x" * 10)
    (target / "nested").mkdir()
    (target / "nested" / "file").write_text("y")


@pytest.mark.parametrize("failure", [OSError("No space left on device"), KeyboardInterrupt()])
def test_a_directory_the_export_made_is_removed_when_it_fails(tmp_path: Path, failure: BaseException) -> None:
    target = tmp_path / "made" / "out"
    with pytest.raises(type(failure)), export_directory(target):
        write_part_of_an_export(target)
        raise failure
    assert not target.exists()
    with export_directory(target):  # the retry is not refused
        write_part_of_an_export(target)
    assert sorted(p.name for p in target.iterdir()) == ["__0_0.distcp", "nested"]


def test_an_empty_directory_given_stays_and_is_emptied_when_the_export_fails(tmp_path: Path) -> None:
    target = tmp_path / "given"
    target.mkdir()
    with pytest.raises(OSError), export_directory(target):
        write_part_of_an_export(target)
        raise OSError("disk full")
    assert target.is_dir() and not list(target.iterdir())


def test_a_used_directory_is_refused_and_left_alone(tmp_path: Path) -> None:
    (tmp_path / "keep").write_text("mine")
    with pytest.raises(CliError, match="is not an empty directory"), export_directory(tmp_path):
        pass
    assert (tmp_path / "keep").read_text() == "mine"
