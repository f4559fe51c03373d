"""TLS for every gRPC hop and the HTTP API, and mutual TLS between services.

Each service takes --tls-cert and --tls-key (PEM) for what it serves; with
--tls-ca as well, a service requires its clients to present a certificate
signed by that CA (mutual TLS), and presents its own when it calls the next
service (frontend -> engine core -> worker). The frontend's public API never
requires client certificates: its callers use API keys (services/common/auth.py).
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import grpc

from services.common.grpc_options import CHANNEL_OPTIONS


@dataclass(frozen=True)
class TlsConfig:
    cert_file: str = ""
    key_file: str = ""
    ca_file: str = ""  # set: mutual TLS between services

    @property
    def enabled(self) -> bool:
        return bool(self.cert_file)

    def server_credentials(self, require_client_cert: bool) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(_read(self.key_file), _read(self.cert_file))],
            root_certificates=_read(self.ca_file) if self.ca_file else None,
            require_client_auth=require_client_cert and bool(self.ca_file))

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Trusts --tls-ca (or the system's roots) and presents this service's
        certificate when mutual TLS is on."""
        mutual = bool(self.ca_file)
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca_file) if self.ca_file else None,
            private_key=_read(self.key_file) if mutual else None,
            certificate_chain=_read(self.cert_file) if mutual else None)


def add_tls_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tls-cert", default="", help="PEM certificate this service serves "
                        "with (default: plaintext)")
    parser.add_argument("--tls-key", default="", help="its PEM private key")
    parser.add_argument("--tls-ca", default="", help="PEM CA bundle: servers require client "
                        "certificates it signed (mutual TLS), clients trust the servers it signed")


def tls_from_args(args: argparse.Namespace) -> TlsConfig:
    if bool(args.tls_cert) != bool(args.tls_key):
        raise SystemExit("--tls-cert and --tls-key go together")
    return TlsConfig(args.tls_cert, args.tls_key, args.tls_ca)


def tls_to_argv(tls: TlsConfig) -> list[str]:
    if not tls.enabled:
        return []
    return ["--tls-cert", tls.cert_file, "--tls-key", tls.key_file,
            *(["--tls-ca", tls.ca_file] if tls.ca_file else [])]


def sync_channel(address: str, tls: TlsConfig | None = None) -> grpc.Channel:
    if tls is not None and tls.enabled:
        return grpc.secure_channel(address, tls.channel_credentials(), options=CHANNEL_OPTIONS)
    return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)


def aio_channel(address: str, tls: TlsConfig | None = None,
                server_name: str = "") -> grpc.aio.Channel:
    """server_name: the name the server's certificate must hold, when the address
    is not it (an IP that a DNS name resolved to)."""
    if tls is not None and tls.enabled:
        override = [("grpc.ssl_target_name_override", server_name)] if server_name else []
        return grpc.aio.secure_channel(address, tls.channel_credentials(),
                                       options=[*CHANNEL_OPTIONS, *override])
    return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)


def _read(path: str) -> bytes:
    return Path(path).read_bytes()
