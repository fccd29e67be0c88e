"""The example Grafana dashboard plots only metrics that the server's /metrics exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

DASHBOARD = Path(__file__).resolve().parent.parent / "examples" / "grafana" / "jkv-dashboard.json"

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENTIFIER = re.compile(r"\b[A-Za-z_][A-Za-z0-9_]*\b(?!\s*\()")  # not a function's name
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring",
             "group_left", "group_right", "inf", "nan"}
_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
             "summary": ("_sum", "_count")}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: its identifiers less strings, label
    matchers, ranges, grouping clauses, Grafana variables, functions and keywords."""
    expr = _STRING.sub('""', expr)
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]|\$\{?\w+\}?", " ", expr)
    expr = _GROUPING.sub(" ", expr)
    return {n for n in _IDENTIFIER.findall(expr) if n.lower() not in _KEYWORDS}


def exported_series(text: str) -> set[str]:
    """The series names an exposition text offers: its samples' names, and for each family
    the names its type gives (a counter's _total, a histogram's _bucket, _sum and _count),
    families with no sample yet (a labelled metric no label has been set on) included."""
    names = {line.split("{")[0].split()[0] for line in text.splitlines()
             if line and not line.startswith("#")}
    for family, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M):
        if kind == "counter":
            names.add(family if family.endswith("_total") else family + "_total")
        else:
            names.add(family)
            names.update(family + s for s in _SUFFIXES.get(kind, ()))
    return names


def dashboard_expressions(dashboard: dict) -> list[tuple[str, str]]:
    """(panel title, expression) for every query of every panel, rows' panels included."""
    out, panels = [], list(dashboard["panels"])
    while panels:
        panel = panels.pop()
        panels.extend(panel.get("panels", ()))
        out += [(panel["title"], t["expr"]) for t in panel.get("targets", ()) if "expr" in t]
    return out


def test_metric_names_are_read_off_promql():
    expr = ('histogram_quantile(0.9, sum by (le) (rate(jkv_a_bucket{tier="host", '
            'x=~"$v"}[$__rate_interval]))) / ignoring(kind) jkv_b offset 5m and on() '
            'sum without (part) (jkv_c_total) > bool 0')
    assert metric_names(expr) == {"jkv_a_bucket", "jkv_b", "jkv_c_total"}
    assert metric_names("jkv_kv_pages_used") == {"jkv_kv_pages_used"}


def test_series_names_follow_the_family_type():
    text = ("# TYPE a counter\na_total 1\n# TYPE b_total counter\n# TYPE h histogram\n"
            'h_bucket{le="1"} 0\n# TYPE g gauge\n')
    assert exported_series(text) == {"a_total", "b_total", "h", "h_bucket", "h_sum", "h_count",
                                     "g"}
    assert "g_bucket" not in exported_series(text)  # a suffix only where the type has it


@pytest.mark.smollm2
def test_every_metric_the_dashboard_plots_is_exported():
    from test_server import serving  # a real server on a free port

    from jkv import LLM

    dashboard = json.loads(DASHBOARD.read_text())
    queries = dashboard_expressions(dashboard)
    assert len(queries) >= 12
    with serving(LLM(max_model_len=256, max_num_seqs=2, host_cache_bytes="64MiB")) as srv:
        exported = exported_series(srv.http.get(srv.base + "/metrics").text)
    for title, expr in queries:
        names = metric_names(expr)
        assert names, f"{title!r}: {expr!r} names no metric"
        missing = names - exported
        assert not missing, f"{title!r} plots {sorted(missing)}, which /metrics does not export"
