"""Every test sits in exactly one tier, and only `system` tests may start the Prefect server."""

import subprocess

import pytest

from helpers.tiers import SYSTEM_FIXTURES, TIERS, tiers_of


def test_every_collected_test_has_exactly_one_tier(request):
    wrong = {item.nodeid: sorted(tiers_of(item)) for item in request.session.items if len(tiers_of(item)) != 1}
    assert not wrong, f"tests without exactly one of the tiers {TIERS}: {wrong}"


def test_only_system_tests_use_the_fixtures_that_start_servers(request):
    wrong = [item.nodeid for item in request.session.items
             if SYSTEM_FIXTURES & set(getattr(item, "fixturenames", ())) and tiers_of(item) != {"system"}]
    assert not wrong, f"tests that start a server outside the system tier: {wrong}"


def test_a_test_outside_the_system_tier_cannot_start_a_process():
    with pytest.raises(AssertionError, match="mark it `system`"):
        subprocess.run(["true"])
