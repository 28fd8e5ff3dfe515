"""--zeroconf advertises _wyoming._tcp with a real address, never the wildcard.

What needs the network runs in a network namespace the test makes (conftest), whose LAN address
is NAMESPACE_LAN_ADDRESS: the multicast stays inside it, and the address to expect is known.
"""

from __future__ import annotations

import json
from typing import Any

from conftest import NAMESPACE_LAN_ADDRESS, TESTS, run_python_in_network_namespace

from wyoming_cosyvoice.wyoming.zeroconf import advertised_address

PROBE = TESTS / "zeroconf_probe.py"


def _in_namespace(*call: object) -> Any:
    """A function of zeroconf_probe called in the test's network namespace; its result."""
    out = run_python_in_network_namespace(str(PROBE), *map(str, call))
    return json.loads(out.splitlines()[-1])


def test_wildcard_binds_advertise_the_lan_address() -> None:
    assert _in_namespace("advertised_for_wildcards") == [NAMESPACE_LAN_ADDRESS] * 4
    assert advertised_address("10.1.2.3") == "10.1.2.3"  # an explicit address is kept
    assert advertised_address("localhost") == "127.0.0.1"


def test_the_service_can_be_found_by_a_browser() -> None:
    assert _in_namespace("found_by_a_browser", 10299) == [NAMESPACE_LAN_ADDRESS, 10299]
