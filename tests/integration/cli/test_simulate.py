"""`castor simulate --from-job` reads a real job's failures through the REST API."""

from __future__ import annotations

from tests.integration.cli.conftest import Root, castor, create_job, unique


def test_from_job_without_recovered_failures_says_so(root: Root) -> None:
    job = create_job(root, unique("sim"), machines=2)
    result = castor(root, "simulate", "--from-job", job["name"], "--seeds", "2", "--days", "1")
    assert result.returncode == 2
    assert (
        result.stderr.strip()
        == f"castor simulate: error: job {job['name']} has no recovered failures to take costs from"
    )


def test_from_job_unknown_job(root: Root) -> None:
    result = castor(root, "simulate", "--from-job", "no-such-job", "--seeds", "2")
    assert result.returncode == 1 and "no job with id or name 'no-such-job'" in result.stderr
