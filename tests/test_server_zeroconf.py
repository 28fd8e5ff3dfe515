"""--zeroconf advertises _wyoming._tcp with a real address, never the wildcard."""

from __future__ import annotations

import asyncio
import socket

import pytest

from wyoming_cosyvoice.zeroconf import (
    SERVICE_TYPE,
    WyomingZeroconf,
    advertised_address,
    lan_address,
)


def test_wildcard_binds_advertise_the_lan_address() -> None:
    for bind in ("0.0.0.0", "::", "", None):
        address = advertised_address(bind)
        assert address not in ("0.0.0.0", "::")
        socket.inet_aton(address)  # a usable IPv4 address
    assert advertised_address("10.1.2.3") == "10.1.2.3"  # an explicit address is kept
    assert advertised_address("localhost") == "127.0.0.1"


def test_the_service_can_be_found_by_a_browser() -> None:
    from zeroconf import IPVersion
    from zeroconf.asyncio import AsyncZeroconf

    async def main() -> tuple[str, int]:
        try:  # the machine's part: a multicast socket and a route to the mDNS group
            probe = AsyncZeroconf(ip_version=IPVersion.V4Only)
            await probe.async_close()
            lan_address()
        except OSError as err:
            pytest.skip(f"mDNS unavailable on this machine: {err}")
        advert = WyomingZeroconf("cosyvoice-test", 10299, "0.0.0.0")
        await advert.register()
        browser = AsyncZeroconf(ip_version=IPVersion.V4Only)
        try:
            info = await browser.async_get_service_info(
                SERVICE_TYPE, f"cosyvoice-test.{SERVICE_TYPE}", timeout=3000
            )
        finally:
            await browser.async_close()
            await advert.close()
        assert info is not None
        return socket.inet_ntoa(info.addresses[0]), info.port

    address, port = asyncio.run(main())
    assert port == 10299
    assert address == advertised_address("0.0.0.0") != "0.0.0.0"
