"""A free TCP port on the loopback interface (standard library only, so shell scripts can ask cheaply).

python -m utils.runtime.ports        # prints one port number
"""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port nothing listens on now (the OS picks it); the caller binds it soon after."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    print(free_port())
