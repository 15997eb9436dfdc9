"""The documentation lists what the registries hold, and code cites only documents in the repository."""

from __future__ import annotations

import re
from pathlib import Path

from flowcredit.advantages import CREDITS
from flowcredit.presets import COMPARED_PRESETS, NEWER_PRESETS, PRESETS
from flowcredit.sde import SAMPLER_ENTRIES
from flowcredit.step_schedules import STEP_SCHEDULES
from flowcredit.step_weights import STEP_WEIGHTS
from flowcredit.updates import UPDATES
from flowcredit.values import ESTIMATORS

REPO = Path(__file__).resolve().parents[1]
ALGORITHMS = (REPO / "docs" / "algorithms.md").read_text()
TRAINING = (REPO / "docs" / "training.md").read_text()


def test_readme_table_lists_every_compared_and_newer_preset():
    table = [ln for ln in (REPO / "README.md").read_text().splitlines() if ln.startswith("| ")]
    presets = {m.group(1) for ln in table for m in [re.search(r"\| `(\w+)` \|$", ln)] if m}
    assert presets == set(COMPARED_PRESETS) | set(NEWER_PRESETS)


def built_in(registry: dict, fn=lambda entry: entry.fn) -> list[str]:
    """The names of ``registry`` registered inside the package (other tests register their own)."""
    return [name for name, entry in registry.items() if fn(entry).__module__.startswith("flowcredit.")]


def test_algorithms_doc_covers_every_registered_variant():
    for name in [*CREDITS, *SAMPLER_ENTRIES, *ESTIMATORS]:
        assert f"`{name}`" in ALGORITHMS, name
    for name in [*built_in(STEP_SCHEDULES), *built_in(STEP_WEIGHTS), *built_in(UPDATES)]:
        assert f"`{name}`" in ALGORITHMS, name


def test_training_doc_lists_every_preset_and_the_method_fields():
    rows = {m.group(1) for m in re.finditer(r"^\| `(\w+)` \|", TRAINING, flags=re.M)}
    presets = set(built_in(PRESETS, fn=lambda make: make))
    assert presets >= set(NEWER_PRESETS) and presets <= rows, presets - rows
    for name in ("step_schedule", "step_weight", "update"):
        assert f"| `{name}` | `{name}_options` |" in TRAINING, name


def test_algorithms_doc_has_a_section_per_newer_preset():
    sections = re.findall(r"^### .*\(`--preset (\w+)`\)$", ALGORITHMS, flags=re.M)
    assert sorted(sections) == sorted(NEWER_PRESETS)


def test_code_cites_existing_sections_and_no_outside_spec():
    headings = set(re.findall(r"^##+ (\d+(?:\.\d+)?)\.? ", ALGORITHMS, flags=re.M))
    for path in [*REPO.glob("flowcredit/**/*.py"), *REPO.glob("benchmarks/**/*.py"), *REPO.glob("docs/*.md")]:
        text = path.read_text()
        assert not re.search(r"\bSPEC\b", text), f"{path} cites SPEC, which is not in the repository"
        for section in re.findall(r"docs/algorithms\.md §(\d+(?:\.\d+)?)", text):
            assert section in headings, f"{path} cites docs/algorithms.md §{section}, which does not exist"
