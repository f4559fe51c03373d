"""Where the engine cores are: a fixed list, or a DNS name resolved again and again.

`--engine-core-addresses` takes comma-separated host:port, or gRPC's naming
syntax `dns:[//dns-server[:port]/]host:port`: every A and AAAA record of host is
one engine core listening on port. A Kubernetes headless Service's name
resolves to exactly its ready pods, so the router (router.py), which resolves
it every few seconds, sees replicas that are added or removed join or leave
without a restart. dnspython does the lookups: asynchronous, honouring
resolv.conf's search list (pods name a Service in their own namespace by its
short name), and able to ask a given DNS server, as the dns://server/ form
says.
"""
from __future__ import annotations

import dns.asyncresolver
import dns.exception
import dns.resolver

DNS_PORT = 53


class ResolveError(Exception):
    """The name could not be looked up now (no DNS server answered); not "no such name"."""


class StaticAddresses:
    """A fixed list of engine cores."""

    dynamic = False

    def __init__(self, addresses: list[str]):
        self.addresses = addresses

    async def resolve(self) -> list[str]:
        return list(self.addresses)

    def __str__(self) -> str:
        return ",".join(self.addresses)


class DnsAddresses:
    """Every address a DNS name has, each at the same port."""

    dynamic = True

    def __init__(self, host: str, port: int, nameserver: tuple[str, int] | None = None,
                 timeout_s: float = 2.0):
        self.host, self.port, self.nameserver = host, port, nameserver
        self.resolver = dns.asyncresolver.Resolver(configure=nameserver is None)
        if nameserver is not None:
            self.resolver.nameservers = [nameserver[0]]
            self.resolver.port = nameserver[1]
        self.resolver.lifetime = timeout_s

    async def resolve(self) -> list[str]:
        """host:port for each address the name has now, sorted; [] when it has none
        (a headless Service without a ready pod)."""
        ips: set[str] = set()
        for rdtype in ("A", "AAAA"):
            try:
                answer = await self.resolver.resolve(self.host, rdtype, search=True)
            except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
                continue
            except dns.exception.DNSException as e:
                raise ResolveError(f"cannot look up {self.host}: {e}") from None
            ips.update(record.address for record in answer)
        return sorted(_join_host_port(ip, self.port) for ip in ips)

    def __str__(self) -> str:
        server = f"//{self.nameserver[0]}:{self.nameserver[1]}/" if self.nameserver else ""
        return f"dns:{server}{self.host}:{self.port}"


def parse_engine_addresses(text: str) -> StaticAddresses | DnsAddresses:
    """`a:1,b:2` or `dns:[//server[:port]/]name:port`; ValueError says what is wrong."""
    if not text.startswith("dns:"):
        addresses = [a.strip() for a in text.split(",") if a.strip()]
        if not addresses:
            raise ValueError("no engine-core address given")
        return StaticAddresses(addresses)
    rest, nameserver = text[len("dns:"):], None
    if rest.startswith("//"):
        authority, slash, rest = rest[2:].partition("/")
        if not slash:
            raise ValueError(f"{text!r}: expected dns://[server]/name:port")
        if authority:
            nameserver = _split_host_port(authority, DNS_PORT, text)
    host, port = _split_host_port(rest, None, text)
    return DnsAddresses(host, port, nameserver)


def _split_host_port(text: str, default_port: int | None, whole: str) -> tuple[str, int]:
    host, colon, port = text.rpartition(":")
    if not colon or host.endswith(":"):  # no port, or a bare IPv6 address
        host, port = text, ""
    host = host.strip("[]")
    if not host or (not port and default_port is None):
        raise ValueError(f"{whole!r}: expected host:port in {text!r}")
    if port and not port.isdigit():
        raise ValueError(f"{whole!r}: the port in {text!r} is not a number")
    return host, int(port) if port else default_port


def _join_host_port(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"
