"""mDNS advertisement of ``_wyoming._tcp`` so Home Assistant discovers the server.

A wildcard bind address (``0.0.0.0``, ``::``) is never advertised: wyoming-piper does that and
clients then try to connect to 0.0.0.0. We advertise the address of the interface that routes
to the mDNS group instead, which is the machine's LAN address.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from zeroconf.asyncio import AsyncServiceInfo, AsyncZeroconf

_LOGGER = logging.getLogger(__name__)

SERVICE_TYPE = "_wyoming._tcp.local."
MDNS_GROUP = "224.0.0.251"


def lan_address() -> str:
    """The local IPv4 address used to reach the mDNS group (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect((MDNS_GROUP, 5353))
        return str(sock.getsockname()[0])


def advertised_address(bind_host: str | None) -> str:
    """The address to advertise for a server bound to ``bind_host``."""
    if bind_host in (None, "", "0.0.0.0", "::", "*"):
        return lan_address()
    try:
        ip = ipaddress.ip_address(bind_host)
    except ValueError:  # a host name: resolve it
        return socket.gethostbyname(bind_host)
    if ip.is_unspecified:
        return lan_address()
    if ip.is_loopback:
        _LOGGER.warning("Advertising loopback address %s: only this machine can connect", ip)
    return str(ip)


class WyomingZeroconf:
    """Registers one ``<name>._wyoming._tcp.local.`` service; ``close`` unregisters it."""

    def __init__(self, name: str, port: int, bind_host: str | None) -> None:
        self.name, self.port = name, port
        self.address = advertised_address(bind_host)
        self._aiozc: AsyncZeroconf | None = None
        self._info: AsyncServiceInfo | None = None

    async def register(self) -> None:
        from zeroconf import IPVersion
        from zeroconf.asyncio import AsyncServiceInfo, AsyncZeroconf

        self._info = AsyncServiceInfo(
            SERVICE_TYPE,
            f"{self.name}.{SERVICE_TYPE}",
            addresses=[socket.inet_aton(self.address)],
            port=self.port,
        )
        self._aiozc = AsyncZeroconf(ip_version=IPVersion.V4Only)
        await self._aiozc.async_register_service(self._info)
        _LOGGER.info("Zeroconf: advertising %s at %s:%d", self.name, self.address, self.port)

    async def close(self) -> None:
        if self._aiozc is not None:
            if self._info is not None:
                await self._aiozc.async_unregister_service(self._info)
            await self._aiozc.async_close()
            self._aiozc = None
