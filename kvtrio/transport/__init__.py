"""ZeroMQ under trio: the only package that touches pyzmq sockets."""

from ._endpoints import check_endpoint, ensure_endpoint_free
from ._zmq import Monitor, Socket, open_monitor, open_socket

__all__ = [
    "Monitor",
    "Socket",
    "check_endpoint",
    "ensure_endpoint_free",
    "open_monitor",
    "open_socket",
]
