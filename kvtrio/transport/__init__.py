"""ZeroMQ under trio: the only package that touches pyzmq sockets; CURVE keys and ZAP."""

from ._endpoints import check_endpoint, ensure_endpoint_free, group_id
from ._keys import (
    ANY_TENANT,
    AllowedKey,
    ClientCredentials,
    KeyPair,
    curve_client_options,
    default_key_dir,
    ensure_default_keys,
    load_allowed_keys,
    load_keypair,
    load_public_key,
    resolve_client_credentials,
    write_keypair,
)
from ._monitor import Monitor, open_monitor
from ._zap import serve_zap
from ._zmq import Socket, open_socket

__all__ = [
    "ANY_TENANT",
    "AllowedKey",
    "ClientCredentials",
    "KeyPair",
    "Monitor",
    "Socket",
    "check_endpoint",
    "curve_client_options",
    "default_key_dir",
    "ensure_default_keys",
    "ensure_endpoint_free",
    "group_id",
    "load_allowed_keys",
    "load_keypair",
    "load_public_key",
    "open_monitor",
    "open_socket",
    "resolve_client_credentials",
    "serve_zap",
    "write_keypair",
]
