"""Certificates for TLS tests: a CA, the broker's and a client's, made with openssl in a
directory of the test's own."""

from __future__ import annotations

import subprocess
from pathlib import Path


def make_certificates(d: Path) -> None:
    """A CA, a server certificate for localhost and 127.0.0.1, a client certificate and an
    unrelated CA, all by openssl."""
    for ca in ("ca", "other-ca"):
        _openssl(
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            "-subj",
            f"/CN=outbox test {ca}",
            "-keyout",
            f"{ca}.key",
            "-out",
            f"{ca}.pem",
            cwd=d,
        )
    (d / "server.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    for name, cn, ext in (
        ("server", "localhost", ["-extfile", "server.ext"]),
        ("client", CLIENT_CN, []),
    ):
        _openssl(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            f"/CN={cn}",
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
            cwd=d,
        )
        _openssl(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "2",
            "-out",
            f"{name}.pem",
            *ext,
            cwd=d,
        )
    # a client certificate with the right CN, signed by the CA the broker does not trust
    _openssl(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        f"/CN={CLIENT_CN}",
        "-keyout",
        "stranger.key",
        "-out",
        "stranger.csr",
        cwd=d,
    )
    _openssl(
        "x509",
        "-req",
        "-in",
        "stranger.csr",
        "-CA",
        "other-ca.pem",
        "-CAkey",
        "other-ca.key",
        "-CAcreateserial",
        "-days",
        "2",
        "-out",
        "stranger.pem",
        cwd=d,
    )
    for key in d.glob("*.key"):
        key.chmod(0o644)  # the broker runs as this user; test keys only


CLIENT_CN = "outbox-client"


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)
