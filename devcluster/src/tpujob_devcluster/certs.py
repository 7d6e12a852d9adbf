"""Certificates and keys for a local control plane: a CA, the apiserver's serving cert, an admin
client cert (group system:masters) and the service-account signing key pair."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import NameOID

_VALIDITY = datetime.timedelta(days=365)


@dataclass(frozen=True)
class PkiFiles:
    ca_cert: Path
    ca_key: Path
    serving_cert: Path
    serving_key: Path
    admin_cert: Path
    admin_key: Path
    sa_public: Path
    sa_private: Path


def _key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def _write_key(path: Path, key: rsa.RSAPrivateKey) -> None:
    path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    path.chmod(0o600)


def _cert(
    subject: x509.Name,
    key: rsa.RSAPrivateKey,
    issuer: x509.Name,
    signer: rsa.RSAPrivateKey,
    *,
    ca: bool,
    sans: list[x509.GeneralName] | None = None,
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + _VALIDITY)
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(signer, hashes.SHA256())


def _name(common_name: str, organization: str | None = None) -> x509.Name:
    attributes = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    if organization:
        attributes.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization))
    return x509.Name(attributes)


def issue_serving_cert(pki: PkiFiles, directory: Path, common_name: str) -> tuple[Path, Path]:
    """A serving certificate for 127.0.0.1/localhost signed by the devcluster CA (for webhooks)."""
    cert_path, key_path = directory / "tls.crt", directory / "tls.key"
    if cert_path.exists() and key_path.exists():
        return cert_path, key_path
    directory.mkdir(parents=True, exist_ok=True)
    ca_key = serialization.load_pem_private_key(pki.ca_key.read_bytes(), password=None)
    ca_cert = x509.load_pem_x509_certificate(pki.ca_cert.read_bytes())
    assert isinstance(ca_key, rsa.RSAPrivateKey)
    key = _key()
    sans: list[x509.GeneralName] = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    cert = _cert(_name(common_name), key, ca_cert.subject, ca_key, ca=False, sans=sans)
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_key(key_path, key)
    return cert_path, key_path


def make_pki(directory: Path) -> PkiFiles:
    """Create the files once; reuse them when they exist (so `make up` is idempotent)."""
    directory.mkdir(parents=True, exist_ok=True)
    files = PkiFiles(
        *(
            directory / n
            for n in (
                "ca.crt",
                "ca.key",
                "apiserver.crt",
                "apiserver.key",
                "admin.crt",
                "admin.key",
                "sa.pub",
                "sa.key",
            )
        )
    )
    if all(p.exists() for p in files.__dict__.values()):
        return files
    ca_key, ca_name = _key(), _name("tpujob-devcluster-ca")
    files.ca_cert.write_bytes(_cert(ca_name, ca_key, ca_name, ca_key, ca=True).public_bytes(serialization.Encoding.PEM))
    _write_key(files.ca_key, ca_key)
    serving_key = _key()
    sans: list[x509.GeneralName] = [
        x509.DNSName("localhost"),
        x509.DNSName("kubernetes"),
        x509.DNSName("kubernetes.default"),
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
    ]
    files.serving_cert.write_bytes(
        _cert(_name("kube-apiserver"), serving_key, ca_name, ca_key, ca=False, sans=sans).public_bytes(
            serialization.Encoding.PEM
        )
    )
    _write_key(files.serving_key, serving_key)
    admin_key = _key()
    files.admin_cert.write_bytes(
        _cert(_name("admin", "system:masters"), admin_key, ca_name, ca_key, ca=False).public_bytes(
            serialization.Encoding.PEM
        )
    )
    _write_key(files.admin_key, admin_key)
    sa_key = _key()
    _write_key(files.sa_private, sa_key)
    files.sa_public.write_bytes(
        sa_key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    return files
