import pytest

from meshpipe.testing import shutdown_pools


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    shutdown_pools()
