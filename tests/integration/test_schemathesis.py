"""Schemathesis against the api's OpenAPI document, on a real daemon (model-less engines).

Every operation of /openapi.json gets schemathesis's examples, coverage (boundary values,
wrong types, missing fields, media-type and method probes) and fuzzing phases, positive
and negative, derandomized, with at most MAX_EXAMPLES fuzzed cases per operation, and
every answer goes through schemathesis's default checks:
  not_a_server_error            no 5xx
  status_code_conformance       the status is one the document lists for the route
  content_type_conformance      so is the media type
  response_schema_conformance   and the body fits the documented schema (api/docs.py):
                                error bodies, and each server-sent event of a stream (a
                                chunk, an error body or [DONE]); JSON-lines streams
                                (interactive) are not parsed, schemathesis has no reader
  response_headers_conformance, negative_data_rejection (schema-invalid input is a 4xx),
  unsupported_method (405 with Allow), missing_required_header, ignored_auth, ...
Left out, and why:
  positive_data_acceptance      a schema-valid request can still be refused with a 4xx for
                                rules a JSON Schema cannot state: the served model's name
                                (404), its vocabulary (token ids) and session length
                                (prompt + output), its chat template (role order), and
                                cross-field rules (top_logprobs needs logprobs, an
                                interactive_mode turn needs a session_id).
The HTTP side has no destructive route (drain, scale, shutdown are control-socket
commands), so every operation runs; `--session-len 64` bounds each generation, streams
included, so that the run stays short (~45 s with the daemon's start on 2 cores).

The schema is the document the daemon builds, made in-process at import: schemathesis's
lazy `from_fixture` loader does not run under pytest 9 (it reads the removed
`Node._nodeid`); `test_the_daemon_serves_the_tested_document` checks that the daemon
serves the same document.
"""

from __future__ import annotations

import os
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.specs.openapi.checks import positive_data_acceptance

from lmd.api.worker import ApiWorker
from lmd.config import ServeConfig
from lmd.protocol import Role
from lmd.roles import WorkerSpec
from tests.integration.api_stack import metric_values_kept
from tests.integration.daemon import DISAGGREGATED, Daemon, served
from tests.integration.test_hostile_http import assert_unharmed

SEED = 20240611
MAX_EXAMPLES = 30  # per operation and phase; the whole module runs in ~30 s on 2 cores


def api_document() -> dict[str, Any]:
    """/openapi.json as an api worker builds it (it depends on no setting)."""
    config = ServeConfig(runtime_dir=Path(tempfile.gettempdir()) / "lmd-openapi")
    spec = WorkerSpec("api-0", Role.API, 0, os.getpid(), config.to_dict())
    with metric_values_kept():
        document: dict[str, Any] = ApiWorker(spec, config).build_app().openapi()
    return document


DOCUMENT = api_document()
schema = schemathesis.openapi.from_dict(DOCUMENT)
ANSWERS: Counter[tuple[str, int, str]] = Counter()  # (operation, status, media type) of each call


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    yield from served(Daemon(*DISAGGREGATED, "--session-len", "64", "--heartbeat-timeout", "10"))


def test_the_daemon_serves_the_tested_document(daemon: Daemon) -> None:
    assert httpx.get(f"{daemon.url}/openapi.json").json() == DOCUMENT


@schema.parametrize()
@settings(
    max_examples=MAX_EXAMPLES,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
def test_api(case: schemathesis.Case[Any], daemon: Daemon) -> None:
    response = case.call_and_validate(
        base_url=daemon.url, timeout=30, excluded_checks=[positive_data_acceptance]
    )
    media = response.headers.get("content-type", [""])[0].partition(";")[0]
    ANSWERS[case.operation.label, response.status_code, media] += 1


def test_every_operation_was_served_and_refused() -> None:
    """Runs after test_api: it reached every operation, and generation both ways."""
    print("\n".join(f"{' '.join(map(str, key))}: {n}" for key, n in sorted(ANSWERS.items())))
    operations = {f"{m.upper()} {path}" for path, ops in DOCUMENT["paths"].items() for m in ops}
    assert {label for label, _, _ in ANSWERS} == operations, "run the whole module"
    for label in operations:
        if label.startswith("POST"):  # both served and refused
            statuses = {status for op, status, _ in ANSWERS if op == label}
            assert {200, 400} <= statuses, (label, statuses)


def test_the_daemon_is_unharmed(daemon: Daemon) -> None:
    """After all of it: healthy, serving, nothing restarted or dropped, every KV block free."""
    assert_unharmed(daemon)
