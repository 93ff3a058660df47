"""Cluster mode (`lmdd serve --cluster etcd://HOST:PORT`): nodes that find each other.

Each node's supervisor registers its record (host, pid, state, workers) in etcd under a
lease it keeps alive, and watches every other node's record: `membership` is that
registration and view; `records` is the signed record itself.
"""
