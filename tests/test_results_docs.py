"""docs/results.md and benchmarks/results/ stay in step: every file the page links exists,
every figure it shows is drawn from committed JSON by benchmarks/plots.py, and every result
kept under benchmarks/results/<script>/ is read by some doc, test or script (a result nothing
quotes is deleted; the history keeps it)."""

import argparse
import ast
import importlib
import importlib.metadata
import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "docs" / "results.md"
LOCAL_PLOTS = {".svg", ".png"}  # drawn beside a result when it is written; ignored by git


def plots_module():
    """benchmarks/plots.py (not a package: loaded by path, as `python benchmarks/plots.py`)."""
    spec = importlib.util.spec_from_file_location("jkv_bench_plots",
                                                  ROOT / "benchmarks" / "plots.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def page_links() -> list[str]:
    """The relative targets of the page's links and images (anchors and URLs left out)."""
    targets = re.findall(r"\]\(([^)\s]+)\)", PAGE.read_text())
    return [t.split("#")[0] for t in targets if "://" not in t and not t.startswith("#")]


def kept_results() -> list[Path]:
    return sorted(p for p in RESULTS.rglob("*") if p.is_file() and not p.name.startswith(".")
                  and p.suffix not in LOCAL_PLOTS)


def readers_text() -> str:
    """What may read a result: the docs and README, tests, benchmark scripts, the package
    (its shipped profiles name their source). Results naming each other do not count."""
    files = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "tests").rglob("*.py"),
             *(ROOT / "jkv").rglob("*.py"), *(ROOT / "jkv").rglob("*.json")]
    files += [p for p in (ROOT / "benchmarks").rglob("*") if p.suffix in (".py", ".sh")
              and RESULTS not in p.parents]
    return "\n".join(p.read_text(errors="replace") for p in files if p.is_file())


def test_every_file_the_results_page_links_exists():
    links = page_links()
    assert any(t.endswith(".json") for t in links) and any(t.endswith(".svg") for t in links)
    missing = [t for t in links if not (PAGE.parent / t).exists()]
    assert not missing, f"docs/results.md links files that do not exist: {missing}"


def test_no_benchmark_script_shadows_an_installed_package():
    """Running a script puts benchmarks/ first on sys.path (so do the tests that import
    one): a script named like an installed module is imported in its place, as
    benchmarks/kernels.py was for transformers' `kernels`."""
    installed = set(importlib.metadata.packages_distributions()) | set(sys.stdlib_module_names)
    clashes = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py") if p.stem in installed)
    assert not clashes, f"benchmark scripts named like installed modules: {clashes}"


def test_every_result_sits_in_its_scripts_folder_and_is_read_somewhere():
    text = readers_text()
    kept = kept_results()
    assert kept
    misplaced = [str(p.relative_to(RESULTS)) for p in kept
                 if p.parent.parent != RESULTS or p.suffix != ".json"
                 or not (ROOT / "benchmarks" / f"{p.parent.name}.py").is_file()]
    assert not misplaced, ("results belong in benchmarks/results/<script>/ as JSON: "
                           f"{misplaced}")
    unread = [str(p.relative_to(RESULTS)) for p in kept if p.name not in text]
    assert not unread, ("results no doc, test or script reads (quote them in "
                        f"docs/results.md or delete them): {unread}")


def test_the_pages_figures_are_the_ones_plots_draws_from_committed_json():
    plots = plots_module()
    shown = {Path(t).name for t in page_links() if t.startswith("results/")}
    assert shown == set(plots.DOC_FIGURES), "docs/results.md and plots.DOC_FIGURES differ"
    assert {p.name for p in (PAGE.parent / "results").iterdir()} == shown, \
        "docs/results/ holds figures the page does not show (or lacks one it does)"
    for sources in plots.DOC_FIGURES.values():
        for source in sources:
            path = RESULTS / source
            assert path.is_file(), source
            assert plots.kind(path, {}) is not None, f"no figure draws {source}"


def test_every_figure_of_the_page_is_made_and_one_is_saved(tmp_path):
    pytest.importorskip("matplotlib")
    plots = plots_module()
    for name, sources in plots.DOC_FIGURES.items():
        paths = [RESULTS / s for s in sources]
        fig = plots.figure(paths)
        rows = 1 if plots.kind(paths[0], {}) in plots.POOLED else len(sources)
        assert len(fig.axes) >= rows, name  # a row of panels per result, unless pooled
    name, sources = next(iter(plots.DOC_FIGURES.items()))
    out = plots.draw([RESULTS / s for s in sources], tmp_path / name)
    assert out.read_text().lstrip().startswith(("<?xml", "<svg"))


def test_the_harness_writes_a_dated_result_with_its_plot_and_keeps_earlier_ones(tmp_path):
    pytest.importorskip("matplotlib")
    plots = plots_module()  # puts benchmarks/ on the path, as running a script there does
    harness = importlib.import_module("harness")
    budget = json.loads((RESULTS / plots.DOC_FIGURES["kv_budget.svg"][0]).read_text())
    args = argparse.Namespace(requests=2, out=tmp_path)
    first = harness.write_results(tmp_path, "kv_budget-cpu", {"rows": budget["rows"]}, args)
    written = json.loads(first.read_text())
    assert written["benchmark"] == "kv_budget" and written["args"] == {"requests": 2}
    assert {"date", "cpu", "cpu_count", "jax", "device"} <= set(written)
    assert first.name == f"kv_budget-cpu-{written['date']}.json"
    assert first.with_suffix(".svg").is_file()
    second = harness.write_results(tmp_path, "kv_budget-cpu", {"rows": {}}, args)
    assert second.name == f"kv_budget-cpu-{written['date']}-2.json"
    assert json.loads(first.read_text())["rows"] == budget["rows"]  # kept
    again = harness.write_results(tmp_path, "kv_budget-cpu", {"rows": budget["rows"]}, args,
                                  over=second)
    assert again == second and json.loads(second.read_text())["rows"] == budget["rows"]


def test_every_name_a_benchmark_imports_from_jkv_exists():
    """Scripts run only where someone runs them (a GPU session found restore_verify.py
    importing a name jkv had moved): each jkv module a script imports, and each name it
    takes from one, must be there."""
    missing = []
    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                missing += [f"{path.name}: {a.name}" for a in node.names
                            if a.name.startswith("jkv.") and importlib.util.find_spec(a.name)
                            is None]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jkv"):
                module = importlib.import_module(node.module)
                missing += [f"{path.name}: {node.module}.{a.name}" for a in node.names
                            if not hasattr(module, a.name) and not (
                                hasattr(module, "__path__")
                                and importlib.util.find_spec(f"{node.module}.{a.name}"))]
    assert not missing, f"benchmark imports that do not resolve: {missing}"
