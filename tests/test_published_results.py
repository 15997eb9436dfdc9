"""Published result files are read on other machines: none names a path of the machine that made it."""

import json
from pathlib import Path

import pytest

from flowcredit.commands.bench_skill import relative_paths

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def _strings(value):
    if isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)
    elif isinstance(value, str):
        yield value


def _absolute(text: str) -> bool:
    return text.startswith(("/", "\\\\")) or (len(text) > 2 and text[1] == ":" and text[2] in "/\\")


PUBLISHED = sorted(RESULTS.rglob("*.json"))


@pytest.mark.parametrize("path", PUBLISHED, ids=lambda p: str(p.relative_to(RESULTS)))
def test_a_published_result_names_no_absolute_path(path):
    found = [s for s in _strings(json.loads(path.read_text())) if _absolute(s)]
    assert not found, found[:3]


def test_relative_paths_rewrites_only_paths_under_the_root(tmp_path):
    root = tmp_path / "runs"
    record = {"run_dir": str(root / "a-seed1"), "n": [1.5, str(root / "a-seed1" / "final")], "x": "/else"}
    assert relative_paths(record, root) == {"run_dir": "a-seed1", "n": [1.5, "a-seed1/final"], "x": "/else"}


def test_published_lists_the_result_files():
    assert len(PUBLISHED) > 10  # the test above would pass on an empty folder
