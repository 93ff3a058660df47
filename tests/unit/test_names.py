"""Worker names: a single host's `decode-0`, a cluster node's `decode-0@b`."""

from __future__ import annotations

from lmd.names import WORKER_NAME, index_of, node_of, role_of, worker_name


def test_single_host_and_cluster_names_tell_role_index_and_node() -> None:
    assert worker_name("decode", 3) == "decode-3"
    assert worker_name("decode", 3, "gpu_7") == "decode-3@gpu_7"
    for name, role, index, node in (
        ("decode-3", "decode", 3, ""),
        ("decode-3@gpu_7", "decode", 3, "gpu_7"),
        ("tokenizer-0@a", "tokenizer", 0, "a"),
    ):
        assert (role_of(name), index_of(name), node_of(name)) == (role, index, node)
        assert WORKER_NAME.fullmatch(name)


def test_names_that_are_no_worker_names() -> None:
    for bad in ("../x", "decode-0@", "decode-0@a@b", "decode-0@a/b", "x" * 65, ""):
        assert not WORKER_NAME.fullmatch(bad), bad
    assert index_of("api") == -1
