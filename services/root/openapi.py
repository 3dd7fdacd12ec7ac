"""Print the API's OpenAPI document as YAML: `python -m services.root.openapi > openapi.yaml`."""

from __future__ import annotations

from typing import Any

import yaml

from services.root.app import create_app
from services.root.settings import Settings


def openapi_document() -> dict[str, Any]:
    # Settings do not shape the schema; fixed ones keep the output independent of the environment.
    return create_app(Settings(admin_token="unused", migrate_on_start=False)).openapi()


def openapi_yaml() -> str:
    return yaml.safe_dump(openapi_document(), sort_keys=False, allow_unicode=True, width=110)


if __name__ == "__main__":
    print(openapi_yaml(), end="")
