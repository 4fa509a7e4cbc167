"""Throwaway PKI for the lab control plane (``cryptography`` only).

Everything here is for a single-machine lab cluster that lives for one test run:
ECDSA P-256 keys, one CA, certificates valid for a year, keys written 0600.
"""

from __future__ import annotations

import datetime as _dt
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALIDITY = _dt.timedelta(days=365)
# Backdate a little so a clock that is slightly off never makes a fresh cert "not yet valid".
BACKDATE = _dt.timedelta(hours=1)


def new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.TraditionalOpenSSL,  # "EC PRIVATE KEY": Go, etcd and OpenSSL all read it
        serialization.NoEncryption(),
    )


def public_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _name(cn: str, orgs: Sequence[str] = ()) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in orgs]
    attrs.append(x509.NameAttribute(NameOID.COMMON_NAME, cn))
    return x509.Name(attrs)


def _now() -> _dt.datetime:
    return _dt.datetime.now(_dt.timezone.utc)


@dataclass
class CertKey:
    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey

    @property
    def cert_pem(self) -> bytes:
        return cert_pem(self.cert)

    @property
    def key_pem(self) -> bytes:
        return key_pem(self.key)


def make_ca(cn: str = "kxlb-lab-ca") -> CertKey:
    key = new_key()
    name = _name(cn)
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(_now() - BACKDATE)
        .not_valid_after(_now() + VALIDITY)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=False, key_cert_sign=True,
                crl_sign=True, encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(ski, critical=False)
        .sign(key, hashes.SHA256())
    )
    return CertKey(cert, key)


def _san(names: Iterable[str]) -> x509.SubjectAlternativeName:
    out: list[x509.GeneralName] = []
    seen = set()
    for n in names:
        if n in seen:
            continue
        seen.add(n)
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(n)))
        except ValueError:
            out.append(x509.DNSName(n))
    return x509.SubjectAlternativeName(out)


def issue(
    ca: CertKey,
    cn: str,
    *,
    orgs: Sequence[str] = (),
    server_names: Sequence[str] = (),
    client: bool = False,
    server: bool = False,
) -> CertKey:
    """Issue a leaf certificate signed by *ca*.

    ``server_names`` are SANs (IP literals become IP SANs, the rest DNS SANs).
    """
    if not (client or server):
        raise ValueError("a certificate must be for client and/or server use")
    key = new_key()
    usages = []
    if server:
        usages.append(ExtendedKeyUsageOID.SERVER_AUTH)
    if client:
        usages.append(ExtendedKeyUsageOID.CLIENT_AUTH)
    b = (
        x509.CertificateBuilder()
        .subject_name(_name(cn, orgs))
        .issuer_name(ca.cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(_now() - BACKDATE)
        .not_valid_after(_now() + VALIDITY)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=False, key_cert_sign=False,
                crl_sign=False, encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key()), critical=False
        )
    )
    if server_names:
        b = b.add_extension(_san(server_names), critical=False)
    return CertKey(b.sign(ca.key, hashes.SHA256()), key)


def write_private(path: Path, data: bytes) -> None:
    """Write *data* to *path* with mode 0600 (created that way, never world-readable)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def write_public(path: Path, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def save(ck: CertKey, directory: Path, stem: str) -> tuple[Path, Path]:
    """Write ``<stem>.crt`` and ``<stem>.key``; return their paths."""
    directory = Path(directory)
    crt, key = directory / f"{stem}.crt", directory / f"{stem}.key"
    write_public(crt, ck.cert_pem)
    write_private(key, ck.key_pem)
    return crt, key


def load(directory: Path, stem: str) -> CertKey:
    """The certificate and key ``save`` wrote (``<stem>.crt``, ``<stem>.key``)."""
    cert = x509.load_pem_x509_certificate((Path(directory) / f"{stem}.crt").read_bytes())
    key = serialization.load_pem_private_key((Path(directory) / f"{stem}.key").read_bytes(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValueError(f"{directory}/{stem}.key is not an EC key")
    return CertKey(cert, key)


# ---- a cluster's certificates and kubeconfigs ----------------------------------------------------

def kubeconfig(server: str, ca_pem: bytes, user: str, cert_pem: bytes, key_pem: bytes,
               cluster: str = "kxlb") -> str:
    """A kubeconfig for *user* (certificates embedded); JSON, which is YAML too."""
    import base64
    import json

    def b64(b: bytes) -> str:
        return base64.b64encode(b).decode()
    ctx = f"{user}@{cluster}"
    return json.dumps({
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": cluster, "cluster": {"server": server, "certificate-authority-data": b64(ca_pem)}}],
        "users": [{"name": user, "user": {"client-certificate-data": b64(cert_pem),
                                          "client-key-data": b64(key_pem)}}],
        "contexts": [{"name": ctx, "context": {"cluster": cluster, "user": user}}],
        "current-context": ctx,
    }, indent=2) + "\n"


def make_cluster(pki_dir: Path, kubeconfig_dir: Path, *, cluster: str, server: str,
                 apiserver_names: Sequence[str]) -> None:
    """A control plane's PKI as kubeadm lays it out: the cluster CA and the serving and
    client certificates of each component, the front-proxy CA, the service-account key
    pair, and a kubeconfig per user (admin, controller-manager, scheduler, kube-proxy)."""
    d = Path(pki_dir)
    ca = make_ca(f"{cluster}-lab-ca")
    save(ca, d, "ca")
    save(issue(ca, "kube-apiserver", server_names=apiserver_names, server=True), d, "apiserver")
    save(issue(ca, "kube-apiserver-kubelet-client", orgs=["system:masters"], client=True),
         d, "apiserver-kubelet-client")
    local = ["127.0.0.1", "localhost"]
    save(issue(ca, "kube-controller-manager", server_names=local, server=True), d, "controller-manager-serving")
    save(issue(ca, "kube-scheduler", server_names=local, server=True), d, "scheduler-serving")

    # Front-proxy (requestheader) CA: without it the controller-manager and the
    # scheduler log an error every few seconds, and aggregated APIs cannot work.
    fp = make_ca(f"{cluster}-lab-front-proxy-ca")
    save(fp, d, "front-proxy-ca")
    save(issue(fp, "front-proxy-client", client=True), d, "front-proxy-client")

    sa = new_key()
    write_private(d / "sa.key", key_pem(sa))
    write_public(d / "sa.pub", public_pem(sa))

    users = {
        "admin": issue(ca, "kubernetes-admin", orgs=["system:masters"], client=True),
        "controller-manager": issue(ca, "system:kube-controller-manager", client=True),
        "scheduler": issue(ca, "system:kube-scheduler", client=True),
        # For running upstream kube-proxy against the lab, for comparison.
        "kube-proxy": issue(ca, "system:kube-proxy", orgs=["system:node-proxier"], client=True),
    }
    for user, ck in users.items():
        save(ck, d, f"{user}-client")
        text = kubeconfig(server, ca.cert_pem, user, ck.cert_pem, ck.key_pem, cluster)
        write_private(Path(kubeconfig_dir) / f"{user}.kubeconfig", text.encode())
