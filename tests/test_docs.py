"""The documentation lists what the registries hold, and code cites only documents in the repository."""

from __future__ import annotations

import re
from pathlib import Path

from flowcredit.advantages import CREDITS
from flowcredit.presets import COMPARED_PRESETS
from flowcredit.sde import SAMPLER_ENTRIES
from flowcredit.values import ESTIMATORS

REPO = Path(__file__).resolve().parents[1]
ALGORITHMS = (REPO / "docs" / "algorithms.md").read_text()


def test_readme_table_lists_every_compared_preset():
    table = [ln for ln in (REPO / "README.md").read_text().splitlines() if ln.startswith("| ")]
    presets = {m.group(1) for ln in table for m in [re.search(r"\| `(\w+)` \|$", ln)] if m}
    assert presets == set(COMPARED_PRESETS)


def test_algorithms_doc_covers_every_registered_variant():
    for name in [*CREDITS, *SAMPLER_ENTRIES, *ESTIMATORS]:
        assert f"`{name}`" in ALGORITHMS, name


def test_code_cites_existing_sections_and_no_outside_spec():
    headings = set(re.findall(r"^##+ (\d+(?:\.\d+)?)\.? ", ALGORITHMS, flags=re.M))
    for path in [*REPO.glob("flowcredit/**/*.py"), *REPO.glob("benchmarks/*.py"), *REPO.glob("docs/*.md")]:
        text = path.read_text()
        assert not re.search(r"\bSPEC\b", text), f"{path} cites SPEC, which is not in the repository"
        for section in re.findall(r"docs/algorithms\.md §(\d+(?:\.\d+)?)", text):
            assert section in headings, f"{path} cites docs/algorithms.md §{section}, which does not exist"
