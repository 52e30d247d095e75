"""Messages between a command and a daemon: one JSON object per line on a Unix socket,
the first carrying the command's standard streams as file descriptors::

    >>> import socket
    >>> a, b = socket.socketpair()
    >>> send(a, {"argv": ["estimate"]})
    >>> receive(b)
    ({'argv': ['estimate']}, [])
"""

from __future__ import annotations

import json
import os
import socket

LIMIT = 1 << 20
"""The longest message (a command's arguments, directory and environment)."""


def send(sock: socket.socket, message: dict, fds: tuple[int, ...] = ()) -> None:
    """One message, with ``fds`` passed alongside its first byte."""
    data = json.dumps(message).encode() + b"\n"
    sent = socket.send_fds(sock, [data], list(fds)) if fds else 0
    if sent < len(data):
        sock.sendall(data[sent:])


def receive(sock: socket.socket) -> tuple[dict | None, list[int]]:
    """The next message and the descriptors that came with it; None when the other end
    closed first."""
    data, fds, _, _ = socket.recv_fds(sock, LIMIT, 8)
    while data and not data.endswith(b"\n"):
        more = sock.recv(LIMIT)
        if not more:
            break
        data += more
    if not data.endswith(b"\n"):
        for fd in fds:
            os.close(fd)
        return None, []
    return json.loads(data), fds
