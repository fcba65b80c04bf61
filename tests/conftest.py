"""Shared test setup: GPU detection for the `gpu` marker, and a private kernel cache per session."""
import os
import tempfile

import pytest


def _gpu_skip_reason():
    try:
        import cupy
    except ImportError as exc:
        return f"CuPy is not installed ({exc})"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # no driver, insufficient driver, no device
        return f"no usable CUDA GPU ({type(exc).__name__}: {exc})"
    return None if n > 0 else "no CUDA GPU visible"


GPU_SKIP_REASON = _gpu_skip_reason()


def pytest_configure(config):
    # Kernels compiled by the tests go to a cache of their own unless the caller chose one.
    if "CUFLASH_CACHE_DIR" not in os.environ:
        os.environ["CUFLASH_CACHE_DIR"] = tempfile.mkdtemp(prefix="cuflash-test-cache-")


def pytest_collection_modifyitems(config, items):
    if GPU_SKIP_REASON is None:
        return
    skip = pytest.mark.skip(reason=f"GPU test skipped: {GPU_SKIP_REASON}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
