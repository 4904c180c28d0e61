"""JSON Schemas of the two documents, generated from the models so they cannot drift."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvpolicy.models import Layout, Policy

SCHEMA_FILES: dict[str, type[Policy] | type[Layout]] = {
    "policy.schema.json": Policy,
    "layout.schema.json": Layout,
}


def json_schema(model: type[Policy] | type[Layout]) -> dict[str, Any]:
    schema = model.model_json_schema()
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **schema}


def render(model: type[Policy] | type[Layout]) -> str:
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
