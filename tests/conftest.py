import pytest
import torch

from meshpipe.testing import shutdown_pools


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread, as every meshpipe process runs: on a small shared machine more
    threads only contend."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    shutdown_pools()
