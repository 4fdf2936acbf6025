"""Real certificates for the TLS tests, made by Debian's `openssl` (Makefile installs it if missing):
CAs, a server certificate for 127.0.0.1/localhost and client certificates, all short-lived files."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path


def _openssl(*args: str) -> None:
    binary = shutil.which("openssl")
    assert binary, "openssl is missing: `apt-get install openssl` (make test-service does it)"
    subprocess.run([binary, *args], check=True, capture_output=True, timeout=60)


@dataclass(frozen=True)
class Pair:
    cert: Path
    key: Path


class Authority:
    """A self-signed CA that signs server and client certificates into `directory`."""

    def __init__(self, directory: Path, name: str) -> None:
        self.directory = directory
        self.name = name
        directory.mkdir(parents=True, exist_ok=True)
        self.key = directory / f"{name}.key"
        self.cert = directory / f"{name}.pem"
        _openssl(
            "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", str(self.key), "-out", str(self.cert), "-days", "2", "-subj", f"/CN={name}",
            "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign",
        )  # fmt: skip

    def issue(self, name: str, *, server: bool) -> Pair:
        key = self.directory / f"{name}.key"
        csr = self.directory / f"{name}.csr"
        cert = self.directory / f"{name}.pem"
        ext = self.directory / f"{name}.ext"
        usage = "serverAuth" if server else "clientAuth"
        lines = ["basicConstraints=CA:FALSE", f"extendedKeyUsage={usage}"]
        if server:
            lines.append("subjectAltName=IP:127.0.0.1,DNS:localhost")
        ext.write_text("\n".join(lines) + "\n")
        _openssl(
            "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", str(key), "-out", str(csr), "-subj", f"/CN={name}",
        )  # fmt: skip
        _openssl(
            "x509", "-req", "-in", str(csr), "-CA", str(self.cert), "-CAkey", str(self.key),
            "-CAcreateserial", "-out", str(cert), "-days", "2", "-extfile", str(ext),
        )  # fmt: skip
        return Pair(cert, key)


def install(source: Pair, cert: Path, key: Path) -> None:
    """Copy a pair over the files a server reads (what an operator's rotation does)."""
    shutil.copyfile(source.cert, cert)
    shutil.copyfile(source.key, key)
