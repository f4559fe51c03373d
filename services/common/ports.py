"""One convention for every port flag: a port number, where 0 asks the
operating system for a free port (the service logs the port it got; --port-file
records the gRPC one), or `off` for a server that may be left out (HTTP API,
metrics, the plaintext health port). And free_port: the port a launcher picks for
a server it starts, which binds it later."""
from __future__ import annotations

import argparse
import random
import socket
from pathlib import Path

OFF = "off"
# Where a port that something binds later is picked (free_port): below the range
# the kernel hands out to outgoing connections' local ports.
PICKED_PORTS_FROM = 20000
_picked: set[int] = set()  # by this process, never handed out twice


def port_number(text: str) -> int:
    """A port flag's value: 0-65535."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port (0-65535; 0: a free port)")
    return port


def optional_port(text: str) -> int | None:
    """A port flag's value where `off` turns the server off (None)."""
    return None if text.strip().lower() == OFF else port_number(text)


def add_port_arg(parser: argparse.ArgumentParser, flag: str, default: int, what: str) -> None:
    """--port for a service's gRPC server."""
    parser.add_argument(flag, type=port_number, default=default,
                        help=f"{what} (0: a free port; default: %(default)s)")


def add_optional_port_arg(parser: argparse.ArgumentParser, flag: str, default: int | None,
                          what: str) -> None:
    """A port flag for a server that `off` leaves out."""
    shown = OFF if default is None else default
    parser.add_argument(flag, type=optional_port, default=default,
                        help=f"{what} (0: a free port; {OFF}: none; default: {shown})")


def port_to_argv(flag: str, port: int | None) -> list[str]:
    return [flag, OFF if port is None else str(port)]


def free_port(host: str) -> int:
    """A port nothing is bound to now, for a server that binds it seconds later
    (a service of a local stack, started at once with those that call it). Picked
    below the kernel's range for outgoing connections' local ports: in that range
    one of them can take the port first (a tensor-parallel group's connections took
    an engine core's, which then failed to start). Never one this process picked
    before. Where the range leaves little room below it, the kernel's bind(0)."""
    low = ephemeral_ports_start()
    if low - PICKED_PORTS_FROM >= 1000:
        for _ in range(100):
            port = random.randrange(PICKED_PORTS_FROM, low)
            if port not in _picked and _binds(host, port):
                _picked.add(port)
                return port
    with socket.socket() as s:
        s.bind((host, 0))
        port = s.getsockname()[1]
    _picked.add(port)
    return port


def ephemeral_ports_start() -> int:
    """The first port of Linux's range for outgoing connections' local ports."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default, and most systems' range starts there or above


def _binds(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True
