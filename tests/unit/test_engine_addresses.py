"""--engine-core-addresses: host:port lists and gRPC's dns: naming syntax."""
import pytest

from services.frontend.engine_addresses import (DnsAddresses, StaticAddresses,
                                                parse_engine_addresses)


def test_a_list_of_addresses():
    addresses = parse_engine_addresses("a:1, b:2")
    assert isinstance(addresses, StaticAddresses) and addresses.addresses == ["a:1", "b:2"]


@pytest.mark.parametrize("text, host, port, nameserver", [
    ("dns:///llmserve-engine:50052", "llmserve-engine", 50052, None),
    ("dns:llmserve-engine.ns.svc:50052", "llmserve-engine.ns.svc", 50052, None),
    ("dns://10.0.0.10/engine:7", "engine", 7, ("10.0.0.10", 53)),
    ("dns://127.0.0.1:5353/engine:7", "engine", 7, ("127.0.0.1", 5353)),
    ("dns://[::1]:5353/engine:7", "engine", 7, ("::1", 5353)),
])
def test_dns_names(text, host, port, nameserver):
    addresses = parse_engine_addresses(text)
    assert isinstance(addresses, DnsAddresses)
    assert (addresses.host, addresses.port, addresses.nameserver) == (host, port, nameserver)
    if nameserver:
        assert str(addresses) == f"dns://{nameserver[0]}:{nameserver[1]}/{host}:{port}"


@pytest.mark.parametrize("text, message", [
    ("dns:///engine", "expected host:port"),
    ("dns://server", r"expected dns://\[server\]/name:port"),
    ("dns:///engine:http", "not a number"),
    ("", "no engine-core address"),
])
def test_bad_addresses_say_what_is_wrong(text, message):
    with pytest.raises(ValueError, match=message):
        parse_engine_addresses(text)
