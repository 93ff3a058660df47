"""Who may use the control socket: the uid rule, and the peer credentials it is fed."""

from __future__ import annotations

import os
import socket

from lmd.http_server import Peer, peer_of
from lmd.supervisor.control import peer_allowed


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
