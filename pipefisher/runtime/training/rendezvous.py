"""Where a local group meets: the rendezvous store the launcher serves on a port the OS gives as it
binds (so two runs on one host never race for one), and the checks of a port asked for."""

from __future__ import annotations

import socket
from datetime import timedelta

import torch.distributed as dist

from pipefisher.core.settings import ConfigError


class PortInUse(ConfigError):
    """The port asked for the launcher's rendezvous store is taken (one line, a usage error)."""

    def __init__(self, port: int, host: str):
        super().__init__(
            f"run.master_port: port {port} on {host} is in use; pass --master-port with a free port, "
            "or 0 (the default) to let the launcher take one"
        )


def hosted_store(host: str, port: int, timeout: float) -> dist.TCPStore:
    """The rendezvous store of a local group, served by this process: on `port`, or (0) on a port
    the OS picks as it binds, so that no other job can take it between choosing and binding.
    Its `.port` is the bound port; it serves until the object is dropped. PortInUse when `port`
    is taken."""
    try:
        return dist.TCPStore(host, port, None, True, timedelta(seconds=timeout), wait_for_workers=False)
    except dist.DistNetworkError:
        raise PortInUse(port, host) from None


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now (another process may take it before it is bound: `hosted_store` does not
    race)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """True if something listens on the port (TIME_WAIT leftovers do not count, as for the store)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False
