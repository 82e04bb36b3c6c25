"""Which hosts are this machine's own: the rule ``outbox serve`` applies to its bind address
(insecure mode, the plain-HTTP warning) and the API applies to a request's ``Host``. Pure."""

from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """``localhost`` or a loopback address (a name that resolves elsewhere is not)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
