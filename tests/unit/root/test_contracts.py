"""Checked-in artefacts agree with the code: openapi.yaml, docker-compose.yml."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import urlparse

import yaml

from services.root.openapi import openapi_yaml
from services.root.settings import Settings

ROOT = Path(__file__).resolve().parents[3]


def test_openapi_yaml_is_current() -> None:
    committed = (ROOT / "openapi.yaml").read_text()
    assert committed == openapi_yaml(), (
        "openapi.yaml is stale: run `.venv/bin/python -m services.root.openapi > openapi.yaml`"
    )


def test_openapi_documents_the_error_shape() -> None:
    document = yaml.safe_load(openapi_yaml())
    create = document["paths"]["/api/v1/jobs"]["post"]["responses"]
    assert create["409"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
    assert {"401", "403", "422"} <= set(create)


def _service_ports(service: dict[str, object]) -> dict[int, int]:
    """container port -> published port"""
    mapping = {}
    for entry in service.get("ports", []):  # type: ignore[attr-defined]
        published, container = str(entry).split(":")
        mapping[int(container)] = int(published)
    return mapping


def test_compose_stack_agrees_with_settings() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"postgres", "etcd", "moto", "root"} <= set(services)
    assert services["etcd"]["image"].split(":")[1].startswith("v3.5"), "the paper's etcd v3.5"
    assert services["root"]["build"] == "." and (ROOT / "Dockerfile").exists()

    env = {k: str(v) for k, v in services["root"]["environment"].items()}
    castor_env = {k.removeprefix("CASTOR_").lower(): v for k, v in env.items() if k.startswith("CASTOR_")}
    unknown = set(castor_env) - set(Settings.model_fields)
    assert not unknown, f"compose sets variables the service does not read: {unknown}"
    # No default admin token: ${VAR:?message} makes compose refuse to start while VAR is unset or empty.
    required = r"\$\{CASTOR_ADMIN_TOKEN:\?[^}]+\}"
    assert re.fullmatch(required, castor_env["admin_token"]), castor_env["admin_token"]
    assert "change-me" not in (ROOT / "docker-compose.yml").read_text()
    settings = Settings(**{**castor_env, "admin_token": "t"})

    database = urlparse(settings.resolved_database_url.replace("+asyncpg", ""))
    postgres_env = services["postgres"]["environment"]
    assert database.hostname == "postgres" and database.port == 5432 in _service_ports(services["postgres"])
    assert (database.username, database.password, database.path.lstrip("/")) == (
        postgres_env["POSTGRES_USER"],
        postgres_env["POSTGRES_PASSWORD"],
        postgres_env["POSTGRES_DB"],
    )
    assert settings.etcd_endpoints == ["etcd:2379"] and 2379 in _service_ports(services["etcd"])
    assert any("--listen-client-urls=http://0.0.0.0:2379" in arg for arg in services["etcd"]["command"])
    assert settings.aws_endpoint_url == settings.s3_endpoint_url == "http://moto:5000"
    assert 5000 in _service_ports(services["moto"])
    assert _service_ports(services["root"]) == {settings.port: settings.port}
    assert settings.cloud == "aws" and settings.asg_name and settings.s3_bucket
    assert (
        "--port" in (ROOT / "Dockerfile").read_text()
        and str(settings.port) in (ROOT / "Dockerfile").read_text()
    )


def test_settings_from_environment(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("CASTOR_DATABASE_URL", "postgresql+asyncpg://u:p@db:5432/castor")
    monkeypatch.setenv("CASTOR_ETCD_ENDPOINTS", "e1:2379, e2:2379")
    monkeypatch.setenv("CASTOR_CLOUD", "aws")
    monkeypatch.setenv("CASTOR_PORT", "9090")
    settings = Settings()
    assert settings.resolved_database_url.startswith("postgresql+asyncpg://")
    assert settings.etcd_endpoints == ["e1:2379", "e2:2379"]
    assert settings.cloud == "aws" and settings.resolved_public_url == "http://127.0.0.1:9090"


def test_admin_token_is_generated_once_and_kept(tmp_path: Path) -> None:
    settings = Settings(state_dir=tmp_path)
    token = settings.resolved_admin_token()
    assert token.startswith("castor-admin.") and Settings(state_dir=tmp_path).resolved_admin_token() == token
    assert (tmp_path / "admin-token").stat().st_mode & 0o077 == 0, "the token file is private"


def test_the_configuration_page_documents_every_setting() -> None:
    page = (ROOT / "docs" / "configuration.md").read_text()
    missing = [
        f"CASTOR_{name.upper()}" for name in Settings.model_fields if f"`CASTOR_{name.upper()}`" not in page
    ]
    assert not missing, f"docs/configuration.md's table lacks {missing}"
