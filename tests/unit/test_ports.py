"""One convention for every port flag: a number, 0 for a free port, `off` for a
server that may be left out."""
import argparse

import pytest

from services.common.ports import optional_port, port_number
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
