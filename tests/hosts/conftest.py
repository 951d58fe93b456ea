"""Tests on real hosts: a Ray cluster across network namespaces (``tests/hosts.py``).

They run in a pytest session of their own (`make test` runs it after the main one:
``pytest --hosts tests/hosts``): their head node binds to the bridge's address, and this machine
has room for one Ray cluster at a time. Skipped, with the reason, where namespaces cannot be made.
"""

from __future__ import annotations

import pytest

from benchmarks.hosts import HostCluster, unavailable

REASON = unavailable()


def pytest_collection_modifyitems(items):
    for item in items:
        item.add_marker(pytest.mark.hosts)
        if REASON is not None:
            item.add_marker(pytest.mark.skip(reason=f"no network namespaces here: {REASON}"))


@pytest.fixture(scope="module")
def hosts():
    """A head on the bridge, driver connected; each test adds the hosts it needs."""
    with HostCluster() as cluster:
        yield cluster
