"""JSON Schemas of the documents kvpolicy reads (policies, layouts, the connector's
``kv_connector_extra_config``) and writes (key contracts, discovery reports),
generated from the models so they cannot drift."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from kvpolicy.documents.settings import KVPolicySettings
from kvpolicy.evidence.discovery import DiscoveryReport
from kvpolicy.language.models import Layout, Policy
from kvpolicy.planning.contract import KeyContract

SCHEMA_FILES: dict[str, type[BaseModel]] = {
    "policy.schema.json": Policy,
    "layout.schema.json": Layout,
    "keys.schema.json": KeyContract,
    "connector.schema.json": KVPolicySettings,
    "discovery.schema.json": DiscoveryReport,
}


def json_schema(model: type[BaseModel]) -> dict[str, Any]:
    schema = model.model_json_schema()
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **schema}


def render(model: type[BaseModel]) -> str:
    return json.dumps(json_schema(model), indent=2, sort_keys=False) + "\n"


def stale_files(directory: Path) -> list[Path]:
    """Schema files in ``directory`` that are missing or differ from the models."""
    return [
        directory / name
        for name, model in SCHEMA_FILES.items()
        if not (directory / name).is_file() or (directory / name).read_text(encoding="utf-8") != render(model)
    ]


def write(directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, model in SCHEMA_FILES.items():
        (directory / name).write_text(render(model), encoding="utf-8")
        written.append(directory / name)
    return written
