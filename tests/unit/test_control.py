"""The control API: who may use it (the uid rule, peer credentials) and how it refuses."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

import httpx
import pytest

from lmd.http_server import Peer, peer_of
from lmd.supervisor.control import build_control_app, peer_allowed
from lmd.supervisor.supervisor import Supervisor
from tests.unit.test_supervisor import running_supervisor


def test_root_and_the_daemons_own_user_are_allowed() -> None:
    assert peer_allowed(0, own_uid=1000)
    assert peer_allowed(1000, own_uid=1000)
    assert peer_allowed(os.getuid())  # own_uid defaults to ours


def test_any_other_user_is_refused() -> None:
    assert not peer_allowed(65534, own_uid=1000)  # nobody
    assert not peer_allowed(1001, own_uid=1000)  # e.g. a member of the socket's group
    assert not peer_allowed(65534, own_uid=0)  # a daemon run as root


def test_peer_credentials_are_the_connecting_process() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        assert peer_of(a) == Peer(os.getpid(), os.getuid(), os.getgid())


def test_no_credentials_without_a_peer() -> None:
    with socket.socket() as s:  # the kernel answers (0, -1, -1)
        assert peer_of(s) is None


def control_client(sup: Supervisor) -> httpx.AsyncClient:
    """The control app over ASGI (no socket: no peer credentials, so the uid rule passes)."""
    transport = httpx.ASGITransport(app=build_control_app(sup))
    return httpx.AsyncClient(transport=transport, base_url="http://lmd")


async def test_a_bad_reload_is_400_bad_config_and_config_is_unchanged(tmp_path: Path) -> None:
    sup, file = running_supervisor(tmp_path)
    async with control_client(sup) as ctl:
        before = (await ctl.get("/v1/config")).json()
        file.write_bytes(b"max_request_bytes = 99999999999999999999\n")
        r = await ctl.post("/v1/reload")
        assert r.status_code == 400
        assert r.json() == {
            "error": {
                "code": "bad_config",
                "message": f"{file}: max_request_bytes: 99999999999999999999 is out of range "
                "(it does not fit in a 64-bit integer)",
            }
        }
        after = await ctl.get("/v1/config")
        assert after.status_code == 200 and after.json() == before


async def test_bad_parameters_are_400_in_one_readable_line(tmp_path: Path) -> None:
    sup, _ = running_supervisor(tmp_path)
    async with control_client(sup) as ctl:
        r = await ctl.post("/v1/scale/decode/lots")
        assert r.status_code == 400
        assert r.json()["error"] == {
            "code": "bad_request",
            "message": "count: Input should be a valid integer, unable to parse string as an "
            "integer (got 'lots')",
        }
        r = await ctl.get("/v1/metrics", params={"interval": "soon"})
        assert r.status_code == 400
        assert r.json()["error"]["message"].startswith("interval: Input should be a valid number")


async def test_a_bug_is_a_structured_500_not_a_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sup, _ = running_supervisor(tmp_path)

    def broken() -> dict[str, Any]:
        raise KeyError("workers")

    monkeypatch.setattr(sup, "status", broken)
    transport = httpx.ASGITransport(app=build_control_app(sup), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://lmd") as ctl:
        r = await ctl.get("/v1/status")
    assert r.status_code == 500
    assert r.json()["error"] == {
        "code": "internal_error",
        "message": "internal error: KeyError: 'workers' (the daemon's log has more)",
    }
