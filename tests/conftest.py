"""Shared pytest setup: Triton's interpreter without a GPU, the `gpu` marker, and reproducible hypothesis examples."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import settings

HAS_CUDA = torch.cuda.is_available()

# CI must not pass or fail by the examples a run happens to draw: by default every run draws the same ones (derived
# from each test's source); HYPOTHESIS_PROFILE=explore draws new ones (a search, for development)
settings.register_profile("reproducible", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "reproducible"))

# internal buffers start as NaN, so that an entry a kernel should write but does not fails the comparison
os.environ.setdefault("RELGEN_POISON_BUFFERS", "1")

if not HAS_CUDA:
    # must happen before triton is first imported: kernels then run in Triton's interpreter on the CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _release_cached_gpu_memory():
    """GPU tests share one device among parallel workers (pytest-xdist): after each test a worker hands back what its
    caching allocator kept, so that an idle worker does not hold memory a large test in another worker needs."""
    yield
    if HAS_CUDA and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """Under pytest-xdist, a CUDA fault poisons its process (errors are sticky): end the worker so that the
    fault is charged to the test that caused it and the next tests get a fresh worker."""
    outcome = yield
    report = outcome.get_result()
    if (
        report.failed
        and call.excinfo is not None
        and os.environ.get("PYTEST_XDIST_WORKER")
        and "CUDA" in f"{type(call.excinfo.value).__name__} {call.excinfo.value}"
    ):
        import sys

        sys.stderr.write(f"\nCUDA fault in {item.nodeid}:\n{call.excinfo.getrepr(style='short')}\n")
        sys.stderr.flush()
        os._exit(3)
