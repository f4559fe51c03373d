"""One convention for every port flag: a number, 0 for a free port, `off` for a
server that may be left out; and the ports a launcher picks for its services."""
import argparse
import socket

import pytest

from services.common import ports
from services.common.ports import ephemeral_ports_start, free_port, optional_port, port_number
from services.engine_core.__main__ import parse_args as engine_core_args
from services.frontend.__main__ import parse_args as frontend_args
from services.worker.__main__ import parse_args as worker_args


def test_a_port_is_a_number_0_picks_one_and_off_leaves_the_server_out():
    assert port_number("0") == 0 and port_number("8000") == 8000
    assert optional_port("off") is None and optional_port("OFF") is None
    assert optional_port("0") == 0
    for bad in ("-1", "65536", "http", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="0: a free port"):
            optional_port(bad)
    with pytest.raises(argparse.ArgumentTypeError):
        port_number("off")  # a service's own gRPC port cannot be off


def test_every_service_reads_its_port_flags_the_same_way():
    frontend = frontend_args(["--engine-core-addresses", "h:1", "--port", "0",
                              "--http-port", "off", "--metrics-port", "0"])
    assert (frontend.port, frontend.http_port, frontend.metrics_port) == (0, None, 0)
    assert frontend.health_port is None
    assert frontend_args(["--engine-core-addresses", "h:1"]).http_port == 8000
    engine = engine_core_args(["--worker-addresses", "h:1", "--health-port", "0"])
    assert (engine.health_port, engine.metrics_port) == (0, None)
    assert worker_args(["--metrics-port", "9100"]).metrics_port == 9100


def test_picked_ports_are_free_distinct_and_below_outgoing_connections_ports(monkeypatch):
    """A local stack's services bind their ports seconds after the launcher picks
    them: a port in the kernel's range for outgoing connections could be taken by
    one meanwhile, and one picked twice by the second service to bind it."""
    low = ephemeral_ports_start()
    assert 1024 <= low <= 65535
    if low - ports.PICKED_PORTS_FROM < 1000:
        pytest.skip(f"outgoing connections' ports start at {low}: no room below")
    picked = [free_port("127.0.0.1") for _ in range(300)]
    assert len(set(picked)) == len(picked)
    assert all(ports.PICKED_PORTS_FROM <= port < low for port in picked)
    for port in picked[:20]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free
    # Two ports of the range this process has not picked: one held, one free.
    held, free = [port for port in range(ports.PICKED_PORTS_FROM, low)
                  if port not in picked and ports._binds("127.0.0.1", port)][:2]
    with socket.socket() as taken:  # a port something holds is passed over
        taken.bind(("127.0.0.1", held))
        tries = iter([picked[0], held, free])
        monkeypatch.setattr(ports.random, "randrange", lambda lo, hi: next(tries))
        assert free_port("127.0.0.1") == free


def test_without_room_below_the_range_the_kernel_picks(monkeypatch):
    monkeypatch.setattr(ports, "ephemeral_ports_start", lambda: 1024)
    port = free_port("127.0.0.1")
    assert 1024 <= port <= 65535 and port != free_port("127.0.0.1")
