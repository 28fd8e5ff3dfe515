"""What test_server_zeroconf runs inside its network namespace: each function's result is
printed as JSON. Kept apart from the tests so the child imports neither torch nor conftest."""

from __future__ import annotations

import asyncio
import json
import socket
import sys

from wyoming_cosyvoice.wyoming.zeroconf import SERVICE_TYPE, WyomingZeroconf, advertised_address


def advertised_for_wildcards() -> list[str]:
    return [advertised_address(bind) for bind in ("0.0.0.0", "::", "", None)]


def found_by_a_browser(port: int) -> tuple[str, int]:
    """Advertise ``cosyvoice-test`` on ``port`` bound to the wildcard and look it up."""
    from zeroconf import IPVersion
    from zeroconf.asyncio import AsyncZeroconf

    async def main() -> tuple[str, int]:
        advert = WyomingZeroconf("cosyvoice-test", port, "0.0.0.0")
        await advert.register()
        browser = AsyncZeroconf(ip_version=IPVersion.V4Only)
        try:
            info = await browser.async_get_service_info(
                SERVICE_TYPE, f"cosyvoice-test.{SERVICE_TYPE}", timeout=3000
            )
        finally:
            await browser.async_close()
            await advert.close()
        assert info is not None, "the browser found no service"
        return socket.inet_ntoa(info.addresses[0]), info.port

    return asyncio.run(main())


if __name__ == "__main__":
    name, *args = sys.argv[1:]
    print(json.dumps(globals()[name](*map(int, args))))
