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


#: NumPy's BLAS threads per pytest-xdist worker: all cores divided among the workers (the float64
#: references run in every worker at once; 8 workers of 16 threads each on 16 cores had made two
#: reference-bound tests take minutes). Set in the controller before the workers start; they inherit it.
_BLAS_THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def pytest_configure(config):
    workers = getattr(config.option, "numprocesses", None)
    if isinstance(workers, int) and workers > 1 and "PYTEST_XDIST_WORKER" not in os.environ:
        for var in _BLAS_THREAD_VARS:
            os.environ.setdefault(var, str(max(1, (os.cpu_count() or 1) // workers)))
    # Kernels compiled by the tests go to a cache of their own unless the caller chose one.
    if "CUFLASH_CACHE_DIR" not in os.environ:
        os.environ["CUFLASH_CACHE_DIR"] = tempfile.mkdtemp(prefix="cuflash-test-cache-")


def pytest_report_header(config):
    return f"GPU tests: {'run' if GPU_SKIP_REASON is None else 'skipped, ' + GPU_SKIP_REASON}"


@pytest.fixture(scope="module")
def torch():
    """PyTorch with a CUDA device, for the PyTorch layer's GPU tests (skipped with the reason otherwise)."""
    torch = pytest.importorskip("torch", reason="PyTorch is not installed (optional extra cuflash[torch])")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch sees no CUDA device")
    return torch


@pytest.fixture
def cache_full_after_one_entry(monkeypatch):
    """The disk fills up after the first kernel cache entry: cuflash.cache.write_atomic raises ENOSPC
    from the second write on."""
    from cuflash import cache

    real, written = cache.write_atomic, []

    def full_after_one(path, data):
        if written:
            raise OSError(28, "No space left on device")
        written.append(path)
        real(path, data)

    monkeypatch.setattr(cache, "write_atomic", full_after_one)


_GPU_DESELECTED = []


def pytest_collection_modifyitems(config, items):
    """Without a usable GPU the GPU tests are deselected (not run, not failed), and one line at the end
    says how many and why, instead of a skip line per test location."""
    if GPU_SKIP_REASON is None:
        return
    gpu = [item for item in items if "gpu" in item.keywords]
    if gpu:
        items[:] = [item for item in items if "gpu" not in item.keywords]
        config.hook.pytest_deselected(items=gpu)
        _GPU_DESELECTED.extend(gpu)


def pytest_terminal_summary(terminalreporter):
    if _GPU_DESELECTED:
        terminalreporter.write_line(f"{len(_GPU_DESELECTED)} GPU tests not run: {GPU_SKIP_REASON}")
