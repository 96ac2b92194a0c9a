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


@pytest.fixture(autouse=True)
def _processes_need_the_distributed_marker(request, monkeypatch):
    """A test that starts processes (a worker pool's call, a subprocess, a spawned process)
    must carry the ``distributed`` marker, so that ``pytest -m "not distributed"`` is the
    fast in-process suite: this fails the test that does not."""
    import multiprocessing.process
    import subprocess

    from meshpipe import testing

    started: list[str] = []

    def noting(original, what):
        def call(*args, **kwargs):
            started.append(what)
            return original(*args, **kwargs)
        return call

    monkeypatch.setattr(testing.WorkerPool, "run", noting(testing.WorkerPool.run,
                                                          "a worker pool call"))
    monkeypatch.setattr(subprocess.Popen, "__init__", noting(subprocess.Popen.__init__,
                                                             "a subprocess"))
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", noting(
        multiprocessing.process.BaseProcess.start, "a spawned process"))
    yield
    if started and request.node.get_closest_marker("distributed") is None:
        pytest.fail(f"{request.node.nodeid} starts {started[0]} but is not marked "
                    "@pytest.mark.distributed", pytrace=False)
