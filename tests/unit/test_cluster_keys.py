"""The cluster key file: round trip, refusals a user can hit, and `lmdd keygen`."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import zmq

from lmd import cli
from lmd.cluster.keys import ClusterKey


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_saved_key_loads_back_and_only_its_owner_can_read_it(tmp_path: Path) -> None:
    key = ClusterKey.generate()
    path = tmp_path / "cluster.key"
    key.save(path)
    assert _mode(path) == 0o600
    assert ClusterKey.load(path) == key
    assert ClusterKey.load(str(path)) == key  # a config value is a str


def test_the_secret_stays_out_of_repr_and_the_mac_key_is_not_the_secret() -> None:
    key = ClusterKey.generate()
    assert key.secret.decode() not in repr(key)
    assert len(key.mac_key) == 32
    assert key.mac_key == ClusterKey(key.public, key.secret).mac_key  # same on every node
    assert key.mac_key not in (key.secret, zmq.utils.z85.decode(key.secret))
    assert key.mac_key != ClusterKey.generate().mac_key


def test_save_never_overwrites(tmp_path: Path) -> None:
    path = tmp_path / "cluster.key"
    first = ClusterKey.generate()
    first.save(path)
    with pytest.raises(ValueError, match="already exists") as err:
        ClusterKey.generate().save(path)
    assert str(path) in str(err.value)
    assert ClusterKey.load(path) == first


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660, 0o700 | 0o020])
def test_load_refuses_a_key_others_can_access(tmp_path: Path, mode: int) -> None:
    path = tmp_path / "cluster.key"
    ClusterKey.generate().save(path)
    path.chmod(mode)
    with pytest.raises(ValueError, match=f"chmod 600 {path}$") as err:
        ClusterKey.load(path)
    assert "\n" not in str(err.value)


def test_load_takes_a_read_only_key(tmp_path: Path) -> None:
    path = tmp_path / "cluster.key"
    key = ClusterKey.generate()
    key.save(path)
    path.chmod(0o400)
    assert ClusterKey.load(path) == key


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o600)
    return path


@pytest.mark.parametrize(
    "text",
    [
        "public = ",  # not TOML
        'public = "abc"\n',  # no secret
        'public = "{p}"\nsecret = "{p}"\n',  # a secret that is not the public key's pair
        'public = "{p}"\nsecret = "{s}"\nextra = 1\n',
        'public = "{p}"\nsecret = 7\n',
        'public = "{p}"\nsecret = "~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~"\n',  # not Z85
    ],
)
def test_load_refuses_a_malformed_key_in_one_line_naming_the_file(
    tmp_path: Path, text: str
) -> None:
    public, secret = zmq.curve_keypair()
    path = _write(tmp_path / "cluster.key", text.format(p=public.decode(), s=secret.decode()))
    with pytest.raises(ValueError, match="malformed") as err:
        ClusterKey.load(path)
    assert str(path) in str(err.value)
    assert "\n" not in str(err.value)


def test_load_says_when_the_file_is_missing(tmp_path: Path) -> None:
    path = tmp_path / "nowhere.key"
    with pytest.raises(ValueError, match=f"cannot read cluster key {path}: No such file"):
        ClusterKey.load(path)


def test_lmdd_keygen_writes_a_key_every_node_can_load(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "cluster.key"
    assert cli.main(["keygen", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1
    assert str(path) in out
    assert "every node" in out
    assert _mode(path) == 0o600
    ClusterKey.load(path)


def test_lmdd_keygen_refuses_an_existing_file_or_a_missing_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "cluster.key"
    path.write_text("precious\n")
    assert cli.main(["keygen", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "already exists" in err
    assert path.read_text() == "precious\n"

    missing = tmp_path / "no" / "such" / "dir" / "cluster.key"
    assert cli.main(["keygen", str(missing)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert f"cannot create {missing}" in err
    assert not os.path.exists(missing)
