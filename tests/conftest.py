"""pytest's own set-up for this suite: the helpers under tests/support assert too, so pytest rewrites their asserts
(a failing helper then says what it compared, as a test does).

Under pytest-xdist (the README's `-n auto`, `--dist loadgroup` from pyproject.toml's addopts): the modules whose
tests share expensive module fixtures (SHARED_SETUP) each run whole on one worker, so that those are made once
rather than once on each worker; and with a worker per core each worker's OpenBLAS (CI preloads it) runs one
thread, not a thread per core in each worker (OPENBLAS_NUM_THREADS, unless set). The emulator's compiled kernels
and the real models are cached on disk under file locks, shared by the workers (tests/emulator/build.py,
tq_mlx.models.demo.cache_lock).

The prompt cache on disk that tq-server and tq-chat keep by default (tq_mlx.prompt_cache.store) goes to a folder of
this run's own, so that no run finds another's caches (the tests that use it give their folder with
--tq-prompt-cache-dir)."""

import atexit
import os
import shutil
import tempfile

import pytest

FOLDER_ENV = "TQ_MLX_PROMPT_CACHE_DIR"  # tq_mlx.prompt_cache.store.FOLDER_ENV (tests/test_prompt_store.py checks it)
if not os.environ.get(FOLDER_ENV):
    os.environ[FOLDER_ENV] = tempfile.mkdtemp(prefix="tq-prompt-cache-tests-")
    atexit.register(shutil.rmtree, os.environ[FOLDER_ENV], ignore_errors=True)

pytest.register_assert_rewrite("tests.support")

# Test modules whose tests share module fixtures that take long to make (test_benchmarks: a benchmark script run
# each, and test_readme_tables_render uses all five; test_distributed: generations in subprocesses). Under xdist each
# runs whole on one worker, its fixtures made once; any other test goes wherever a worker is free.
SHARED_SETUP = ("tests/test_benchmarks.py", "tests/test_distributed.py")


def pytest_configure(config: pytest.Config) -> None:
    # In the xdist controller, before it starts the workers, which inherit its environment (OpenBLAS reads this
    # when it starts).
    workers = getattr(config.option, "numprocesses", None)  # an int by now (xdist resolves "auto" first)
    if isinstance(workers, int) and workers > 1 and not os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ.setdefault("OPENBLAS_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // workers)))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """--dist loadgroup (pyproject's addopts), with each SHARED_SETUP module one group. (xdist_group marks would do
    it, but pytest 9.2's node ids no longer take the group xdist 3.8 appends to them: pytest-xdist issue 1386.)"""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class SharedSetupScheduling(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return module if module in SHARED_SETUP else super()._split_scope(nodeid)

    return SharedSetupScheduling(config, log)
