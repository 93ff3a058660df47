"""/openapi.json and /docs on the api worker (api_stack.py), and 404 for a path it lacks."""

from __future__ import annotations

from tests.integration.api_stack import Stack, assert_error


async def test_openapi_and_docs(stack: Stack) -> None:
    spec = (await stack.http.get("/openapi.json")).json()
    body = spec["paths"]["/v1/chat/completions"]["post"]["requestBody"]
    assert body["content"]["application/json"]["schema"]["$ref"].endswith("ChatCompletionRequest")
    assert "temperature" in spec["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert (await stack.http.get("/docs")).status_code == 200
    assert_error(await stack.http.get("/v1/nothing"), 404)
