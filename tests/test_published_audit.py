"""The credit audit's tables in README.md and docs/benchmarks.md are rendered from the published
``audit.json`` files by benchmarks/audit/audit_tables.py, never typed by hand: each table follows a
marker ``<!-- audit-table: FOLDER -->`` (one checkpoint) or ``<!-- audit-compare: LABEL=FOLDER; ... -->``
(the README's comparison), FOLDER under benchmarks/results/audit/."""

import importlib.util
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
AUDITS = REPO / "benchmarks" / "results" / "audit"
MARKER = re.compile(r"<!-- audit-(table|compare): ([^>]*?) -->\n")


def _tables():
    script = REPO / "benchmarks" / "audit" / "audit_tables.py"
    spec = importlib.util.spec_from_file_location("audit_tables", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _markers():
    for doc in ("README.md", "docs/benchmarks.md"):
        text = (REPO / doc).read_text()
        for m in MARKER.finditer(text):
            yield doc, m.group(1), m.group(2), text[m.end() :]


MARKERS = list(_markers())


@pytest.mark.parametrize("doc, kind, args, after", MARKERS, ids=[f"{d}:{k}:{a}" for d, k, a, _ in MARKERS])
def test_an_audit_table_in_the_docs_is_the_rendered_one(doc, kind, args, after):
    tables = _tables()
    if kind == "table":
        expected = tables.checkpoint_table(tables.load(AUDITS / args))
    else:
        pairs = [a.strip().split("=", 1) for a in args.split(";")]
        expected = tables.compare_table({label: tables.load(AUDITS / folder) for label, folder in pairs})
    shown = after[: len(expected) + 1]
    assert shown == expected + "\n", f"{doc}: rerun benchmarks/audit/audit_tables.py for {args}"


def test_the_docs_show_every_published_audit():
    shown = {args for _, kind, args, _ in MARKERS if kind == "table"}
    published = {p.parent.name for p in AUDITS.glob("*/audit.json")}
    assert published <= shown, published - shown
    assert any(kind == "compare" for _, kind, _, _ in MARKERS)


def test_the_verdict_is_the_pre_registered_rule():
    verdict = _tables().verdict
    assert verdict(0.05, 0.04) == "more accurate" and verdict(-0.05, 0.04) == "less accurate"
    assert verdict(0.036, 0.108) == "level" and verdict(-0.04, 0.04) == "level"
