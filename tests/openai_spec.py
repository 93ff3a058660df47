"""OpenAI's own OpenAPI document, to check lmd's bodies against (the unit tests of the
request schema and of the response assembly both do)."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import pytest

OPENAPI = Path("/work/shared/reference/openai-openapi.json")


def _nullable(node: Any) -> Any:
    """OpenAPI 3.0's `nullable: true` as JSON Schema 2020-12 (the spec mixes both)."""
    if isinstance(node, list):
        return [_nullable(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: _nullable(v) for k, v in node.items() if k != "nullable"}
    if not node.get("nullable"):
        return out
    if "enum" in out:
        out["enum"] = [*out["enum"], None]
    if isinstance(out.get("type"), str):
        out["type"] = [out["type"], "null"]
        return out
    return {"anyOf": [out, {"type": "null"}]}


@cache
def _openapi() -> Any:
    return _nullable(json.loads(OPENAPI.read_text()))


def assert_schema(instance: Any, name: str) -> None:
    """`instance` is valid as OpenAI's components/schemas/`name` (skips without the spec)."""
    jsonschema = pytest.importorskip("jsonschema")
    referencing = pytest.importorskip("referencing")
    if not OPENAPI.exists():
        pytest.skip(f"{OPENAPI} is not here")
    resource = referencing.Resource.from_contents(_openapi(), referencing.jsonschema.DRAFT202012)
    registry = referencing.Registry().with_resource("openai", resource)
    schema = {"$ref": f"openai#/components/schemas/{name}"}
    jsonschema.Draft202012Validator(schema, registry=registry).validate(instance)
