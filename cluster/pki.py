"""The cluster's certificates and kubeconfigs: one CA, a serving certificate per server, a client
certificate per identity (the Node authorizer and RBAC read the subject: CN = user, O = groups)."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from cluster.layout import API_PORT, NODES, SERVICE_SUBNET, State

VALID = datetime.timedelta(days=365)


@dataclass(frozen=True)
class Identity:
    file: str
    user: str
    groups: tuple[str, ...] = ()


# Every client of the API server, by the file names its kubeconfig and key pair get.
ADMIN = Identity("admin", "airflow-torchrun-admin", ("system:masters",))
CLIENTS = (
    ADMIN,
    Identity("controller-manager", "system:kube-controller-manager"),
    Identity("scheduler", "system:kube-scheduler"),
    Identity("apiserver-kubelet-client", "kube-apiserver-kubelet-client", ("system:masters",)),
    Identity("coredns", "system:airflow-torchrun:coredns"),
    # Kueue runs as a host process of the cluster with the rights its own manifests grant it.
    Identity("kueue", "system:airflow-torchrun:kueue", ("system:masters",)),
    # What Airflow's connection uses: only the Role that docs/kubernetes.md documents (bound by up).
    Identity("airflow", "airflow-torchrun-worker"),
    *(Identity(f"kubelet-{n.name}", f"system:node:{n.name}", ("system:nodes",)) for n in NODES),
)


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey) -> None:
    path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    path.chmod(0o600)


def _name(cn: str, groups: tuple[str, ...] = ()) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, g) for g in groups]
    return x509.Name([*attrs, x509.NameAttribute(NameOID.COMMON_NAME, cn)])


class Authority:
    def __init__(self, pki: Path) -> None:
        self.pki = pki
        pki.mkdir(parents=True, exist_ok=True)
        key_path, cert_path = pki / "ca.key", pki / "ca.crt"
        if not cert_path.exists():
            key = ec.generate_private_key(ec.SECP256R1())
            now = datetime.datetime.now(datetime.UTC)
            cert = (
                x509.CertificateBuilder()
                .subject_name(_name("airflow-torchrun-cluster-ca"))
                .issuer_name(_name("airflow-torchrun-cluster-ca"))
                .public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + VALID)
                .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                .add_extension(x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True)
                .sign(key, hashes.SHA256())
            )
            _write_key(key_path, key)
            cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        loaded = serialization.load_pem_private_key(key_path.read_bytes(), None)
        assert isinstance(loaded, ec.EllipticCurvePrivateKey)
        self.key = loaded
        self.cert = x509.load_pem_x509_certificate(cert_path.read_bytes())

    def issue(
        self, file: str, cn: str, groups: tuple[str, ...] = (), *, server: bool = False, sans: tuple[str, ...] = ()
    ) -> tuple[Path, Path]:
        crt, key_path = self.pki / f"{file}.crt", self.pki / f"{file}.key"
        if crt.exists() and key_path.exists():
            return crt, key_path
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(cn, groups))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + VALID)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        )
        if sans:
            names: list[x509.GeneralName] = []
            for san in sans:
                try:
                    names.append(x509.IPAddress(ipaddress.ip_address(san)))
                except ValueError:
                    names.append(x509.DNSName(san))
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        _write_key(key_path, key)
        crt.write_bytes(builder.sign(self.key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM))
        return crt, key_path


def kubeconfig(path: Path, ca: Path, crt: Path, key: Path, user: str) -> None:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "airflow-torchrun",
                "cluster": {"server": f"https://127.0.0.1:{API_PORT}", "certificate-authority": str(ca)},
            }
        ],
        "users": [{"name": user, "user": {"client-certificate": str(crt), "client-key": str(key)}}],
        "contexts": [{"name": "airflow-torchrun", "context": {"cluster": "airflow-torchrun", "user": user}}],
        "current-context": "airflow-torchrun",
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    path.chmod(0o600)


def service_ip(index: int) -> str:
    return str(ipaddress.ip_network(SERVICE_SUBNET)[index])


def make_all(state: State) -> Authority:
    """Every certificate and kubeconfig the cluster needs (kept across restarts: made once)."""
    ca = Authority(state.pki)
    api_sans = (
        "127.0.0.1",
        service_ip(1),  # the `kubernetes` Service's ClusterIP
        "localhost",
        "kubernetes",
        "kubernetes.default",
        "kubernetes.default.svc",
        "kubernetes.default.svc.cluster.local",
    )
    ca.issue("apiserver", "kube-apiserver", server=True, sans=api_sans)
    ca.issue("kueue-webhook", "kueue-webhook", server=True, sans=("127.0.0.1",))
    for node in NODES:
        ca.issue(f"kubelet-serving-{node.name}", node.name, server=True, sans=(node.address, node.name))
    sa_key = state.pki / "service-account.key"
    if not sa_key.exists():
        rsa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        _write_key(sa_key, rsa_key)
        (state.pki / "service-account.pub").write_bytes(
            rsa_key.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
        )
    for ident in CLIENTS:
        crt, key = ca.issue(ident.file, ident.user, ident.groups)
        target = state.kubeconfig if ident is ADMIN else state.pki / f"{ident.file}.kubeconfig"
        kubeconfig(target, state.pki / "ca.crt", crt, key, ident.user)
    return ca
