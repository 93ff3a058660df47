"""/openapi.json, /docs and /redoc on the api worker (api_stack.py), and 404 for a path it
lacks."""

from __future__ import annotations

import re

from tests.integration.api_stack import Stack, assert_error


async def test_openapi_and_docs(stack: Stack) -> None:
    spec = (await stack.http.get("/openapi.json")).json()
    body = spec["paths"]["/v1/chat/completions"]["post"]["requestBody"]
    assert body["content"]["application/json"]["schema"]["$ref"].endswith("ChatCompletionRequest")
    assert "temperature" in spec["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert (await stack.http.get("/docs")).status_code == 200
    assert_error(await stack.http.get("/v1/nothing"), 404)


async def test_docs_pages_need_nothing_but_this_server(stack: Stack) -> None:
    """/docs and /redoc load their scripts and styles from the api itself: from a CDN they
    rendered blank on a host without internet access."""
    for page in ("/docs", "/redoc"):
        r = await stack.http.get(page)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        html = r.text
        assert not re.findall(r"https?://", html), page  # no URL outside this server
        assets = re.findall(r"""(?:src|href)=['"]?([^'" >]+)""", html)
        assert len(assets) >= 2, html  # the script and the favicon at least
        for asset in [*assets, "/openapi.json"]:
            got = await stack.http.get(asset)
            assert got.status_code == 200 and got.content, asset
    bundle = await stack.http.get("/docs/assets/swagger-ui-bundle.js")
    assert b"SwaggerUIBundle" in bundle.content  # Swagger UI 5: renders OpenAPI 3.1
    assert "'/openapi.json'" in (await stack.http.get("/docs")).text
