"""A CA and certificates made at test time with `cryptography` (nothing secret is
checked in): one for the services (server and client use, for 127.0.0.1,
localhost and llmserve-engine, the engines' Service name in deploy/k8s), and
one from another CA that the services must refuse."""
from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


@dataclass
class CertFiles:
    ca: str
    cert: str
    key: str


def make_certificates(directory: Path, name: str = "llmserve") -> CertFiles:
    """A new CA, and a certificate it signs for 127.0.0.1 / localhost / llmserve-engine."""
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = _certificate(f"{name} test CA", ca_key.public_key(), ca_key, None, is_ca=True)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = _certificate(f"{name} service", key.public_key(), ca_key, ca_cert.subject,
                        is_ca=False)
    files = CertFiles(str(directory / f"{name}-ca.pem"), str(directory / f"{name}.pem"),
                      str(directory / f"{name}-key.pem"))
    Path(files.ca).write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    Path(files.cert).write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    Path(files.key).write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    return files


def _certificate(common_name: str, public_key, signing_key, issuer: x509.Name | None,
                 is_ca: bool) -> x509.Certificate:
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder()
               .subject_name(subject).issuer_name(issuer or subject)
               .public_key(public_key).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=is_ca, path_length=None), critical=True))
    if not is_ca:
        builder = builder.add_extension(x509.SubjectAlternativeName([
            x509.DNSName("localhost"), x509.DNSName("llmserve-engine"),
            x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False)
    return builder.sign(signing_key, hashes.SHA256())
