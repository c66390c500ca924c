"""The address the HTTP server binds: TGI's rule for `--hostname` / `HOSTNAME`.

`--hostname` also reads the `HOSTNAME` environment variable, which Docker and Kubernetes set to the container's
or pod's name. Binding that name would listen on one interface only (or fail), so TGI's router takes the value
only when it is an IP address and otherwise warns and listens on 0.0.0.0. Kettle does the same, with TGI's
warning text, so a TGI manifest behaves the same with Kettle in it.
"""

from __future__ import annotations

import ipaddress
import logging

log = logging.getLogger("kettle.router")

ANY_ADDRESS = "0.0.0.0"


def listen_address(hostname: str) -> str:
    """`hostname` when it is an IPv4 or IPv6 address, else 0.0.0.0 (with a warning)."""
    try:
        ipaddress.ip_address(hostname)
    except ValueError:
        log.warning(
            "Invalid hostname, defaulting to %s (--hostname/HOSTNAME %r is not an IP address)", ANY_ADDRESS, hostname
        )
        return ANY_ADDRESS
    return hostname
