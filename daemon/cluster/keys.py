"""The cluster key: one CURVE key pair that every node of a cluster holds.

Holding it is what makes a host a member: the TCP inboxes (links.py) accept only CURVE
clients that present the pair, and membership records in etcd are signed with a secret
derived from it (`mac_key`).

The file (`lmdd keygen PATH` writes one, mode 0600; every node needs a copy) is TOML:

    # lmd cluster key: every node of the cluster needs a copy; keep it secret
    public = "<40 Z85 characters>"
    secret = "<40 Z85 characters>"

Both keys are Z85 text, 40 bytes, as pyzmq takes them. `load` refuses a file that group
or others can access, so a secret never sits readable on a shared host by mistake.
"""

from __future__ import annotations

import hashlib
import os
import stat
import struct
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import zmq
from zmq.utils import z85

_Z85_KEY_LEN = 40  # a 32-byte Curve25519 key in Z85
_MAC_LABEL = b"lmd cluster record mac v1\x00"  # keeps mac_key apart from other uses


@dataclass(frozen=True, slots=True)
class ClusterKey:
    public: bytes  # Z85, 40 bytes
    secret: bytes = field(repr=False)  # Z85, 40 bytes; never in a repr or a log

    def __post_init__(self) -> None:
        for name in ("public", "secret"):
            value: bytes = getattr(self, name)
            if len(value) != _Z85_KEY_LEN or not _is_z85(value):
                raise ValueError(f"the {name} key is not {_Z85_KEY_LEN} Z85 characters")
        if zmq.curve_public(self.secret) != self.public:
            raise ValueError("the public key is not the secret key's pair")

    @classmethod
    def generate(cls) -> ClusterKey:
        public, secret = zmq.curve_keypair()
        return cls(public, secret)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ClusterKey:
        """The key in `path`; a one-line ValueError naming the path if it cannot be used."""
        path = Path(path)
        try:
            with path.open("rb") as f:
                mode = stat.S_IMODE(os.fstat(f.fileno()).st_mode)
                if mode & 0o077:
                    raise ValueError(
                        f"cluster key {path} is accessible by group or others "
                        f"(mode {mode:04o}): chmod 600 {path}"
                    )
                text = f.read().decode("utf-8")
        except OSError as exc:
            raise ValueError(f"cannot read cluster key {path}: {exc.strerror}") from None
        except UnicodeDecodeError:
            raise ValueError(f"cluster key {path} is not a text file") from None
        try:
            table = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"cluster key {path} is malformed: {exc}") from None
        if set(table) != {"public", "secret"} or not all(
            isinstance(v, str) for v in table.values()
        ):
            raise ValueError(
                f'cluster key {path} is malformed: expected exactly public = "..." and '
                f'secret = "..." (make a new one with `lmdd keygen`)'
            )
        try:
            return cls(table["public"].encode(), table["secret"].encode())
        except ValueError as exc:
            raise ValueError(f"cluster key {path} is malformed: {exc}") from None

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write a new key file with mode 0600; never overwrites (one-line ValueError)."""
        path = Path(path)
        text = (
            "# lmd cluster key: every node of the cluster needs a copy; keep it secret\n"
            f'public = "{self.public.decode()}"\n'
            f'secret = "{self.secret.decode()}"\n'
        )
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            raise ValueError(
                f"{path} already exists: not overwriting a cluster key (remove it first)"
            ) from None
        except OSError as exc:
            raise ValueError(f"cannot create {path}: {exc.strerror}") from None
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)

    @property
    def mac_key(self) -> bytes:
        """A secret for HMAC-signing cluster records, derived from (not equal to) `secret`."""
        return hashlib.sha256(_MAC_LABEL + z85.decode(self.secret)).digest()


def _is_z85(value: bytes) -> bool:
    try:
        z85.decode(value)
    except (KeyError, ValueError, struct.error):  # a bad character, length or value
        return False
    return True
