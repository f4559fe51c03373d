"""One convention for every port flag: a port number, where 0 asks the
operating system for a free port (the service logs the port it got; --port-file
records the gRPC one), or `off` for a server that may be left out (HTTP API,
metrics, the plaintext health port)."""
from __future__ import annotations

import argparse

OFF = "off"


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
