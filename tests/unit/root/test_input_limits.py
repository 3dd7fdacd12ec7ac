"""The pieces of the input limits that need no database: the body limit's setting, how stored JSON is made
readable, the escaping of log records, and the local operator's own launch limit."""

from __future__ import annotations

import logging
import math
import uuid
from pathlib import Path

import httpx
import pytest

from services.root.app import create_app
from services.root.clients import CloudOperatorError, JobInfo
from services.root.clients.local import LocalOperator
from services.root.logs import escape, escape_control_characters
from services.root.schemas import MAX_READ_DEPTH, readable_json
from services.root.settings import Settings


async def test_the_body_limit_comes_from_castor_max_body_bytes(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("CASTOR_MAX_BODY_BYTES", "2048")
    app = create_app(Settings(state_dir=tmp_path))  # no lifespan: the body is refused before any lookup
    transport = httpx.ASGITransport(app=app)
    headers = {"content-type": "application/json", "Authorization": "Bearer x"}
    async with httpx.AsyncClient(transport=transport, base_url="http://castor.test") as client:
        response = await client.post("/api/v1/jobs", content=b"[" + b"0," * 1100 + b"0]", headers=headers)
        assert response.status_code == 413
        assert response.json()["error"]["code"] == "payload_too_large"
        assert "2048" in response.json()["error"]["message"]
        under = await client.post("/api/v1/jobs", content=b"{not json" + b" " * 1500, headers=headers)
        assert under.status_code == 422


def test_stored_json_is_made_readable() -> None:
    deep: dict[str, object] = {}
    node = deep
    for _ in range(300):
        node["a"] = {}
        node = node["a"]  # type: ignore[assignment]
    readable = readable_json({"deep": deep, "nan": math.nan, "inf": [math.inf], "text": "a\ud800b", 7: 1})
    assert readable["nan"] is None and readable["inf"] == [None]
    assert readable["text"] == "a\ufffdb" and readable["7"] == 1
    depth, node = 0, readable
    while isinstance(node, dict):
        node = node.get("deep", node.get("a"))
        depth += 1
    assert depth == MAX_READ_DEPTH and node == "..."


def test_log_records_of_the_service_are_escaped(caplog: pytest.LogCaptureFixture) -> None:
    assert escape("a\nb\x1b[0m\u2028c\td") == "a\\x0ab\\x1b[0m\\u2028c\\x09d"
    assert escape("ünïcode and emoji ✓") == "ünïcode and emoji ✓"
    escape_control_characters()
    escape_control_characters()  # idempotent: one wrapper, not two (no double escaping)
    with caplog.at_level(logging.INFO):
        logging.getLogger("services.root.test").info("id %s rank %d", "x\ny", 3)
        logging.getLogger("services.root.test").info("error %s", ValueError("bad\r\nline"))
        logging.getLogger("other.library").info("kept %s", "as\nis")
    messages = [record.getMessage() for record in caplog.records]
    assert messages == ["id x\\x0ay rank 3", "error bad\\x0d\\x0aline", "kept as\nis"]


async def test_the_local_operator_refuses_to_start_more_machines_than_its_limit(tmp_path: Path) -> None:
    """Behind the API's 422: even a job that got past it never starts more agents than the limit."""
    operator = LocalOperator("http://127.0.0.1:1", tmp_path, tmp_path / "shm", max_machines=2)
    job = JobInfo(uuid.uuid4(), "many", 3, {"command": ["true"]})
    with pytest.raises(CloudOperatorError, match="CASTOR_LOCAL_MAX_MACHINES"):
        await operator.provision(job, "castor-job.token")
    assert operator._processes == {}
