"""Published result files are read on other machines: none names a path of the machine that made it."""

import json
import re
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


README = RESULTS.parents[1] / "README.md"
NOTE_WORDS = {"unreliable": "unreliable", "rule_after_seeds": "had landed"}
"""Per note of ``verdict_notes``, the words a README cell must carry when, and only when, it has it."""
CELL = re.compile(r"^\**(\w+)\**(?: \(([+−-]\d\.\d{3}) ± (\d\.\d{3})[;)])?")


def _credit_rule_rows() -> list[tuple[str, str, list[str]]]:
    """The README's "Which credit rule should I use?" table: ``(results folder, arm, cells)`` per row
    that names its arm in backticks; rows after the "one GPU" row read the GPU table."""
    text = README.read_text().split("### Which credit rule should I use?")[1].split("\n\n|")[1]
    rows, folder = [], "skill_compare"
    for line in ("|" + text).split("\n\n")[0].splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        if "one GPU" in cells[0]:
            folder = "skill_compare_gpu"
        elif arm := re.search(r"`(\w+)`", cells[0]):
            rows.append((folder, arm.group(1), cells))
    return rows


def _check_cell(cell: str, verdict: str, mean_half: list[float]) -> None:
    match = CELL.match(cell)
    assert match, cell
    assert match.group(1) == verdict.split()[0], (cell, verdict)
    if match.group(2):  # the interval as the table writes it, to 3 decimals
        assert float(match.group(2).replace("−", "-")) == round(mean_half[0], 3), (cell, mean_half)
        assert float(match.group(3)) == round(mean_half[1], 3), (cell, mean_half)


@pytest.mark.parametrize(
    "folder, arm, cells", _credit_rule_rows(), ids=lambda v: v if isinstance(v, str) else ""
)
def test_the_readme_credit_rule_table_reads_the_published_results(folder, arm, cells):
    paired = json.loads((RESULTS / folder / "results.json").read_text())["paired"]
    if cells[1] == "queued":
        assert f"skill-{arm}" not in paired, f"{arm} has landed: its README row still says queued"
        return
    result = paired[f"skill-{arm}"]
    assert re.search(r"n = (\d+)", cells[0]).group(1) == str(len(result["seeds"])), (
        cells[0],
        result["seeds"],
    )
    _check_cell(cells[1], result["verdict"]["strict/overall"], result["diff"]["strict/overall"])
    _check_cell(cells[2], result["verdict"]["strict/per_image"], result["diff"]["strict/per_image"])
    # what the report says beside a verdict (verdict_notes) the row says too, and only then
    for metric, cell in (("strict/overall", cells[1]), ("strict/per_image", cells[2])):
        notes = result["notes"][metric]
        for tag, words in NOTE_WORDS.items():
            assert (tag in notes) == (words in cell), (arm, metric, cell, notes)
    # runs from before a fix of their update rule (FIXES) are marked as the table marks them
    assert ("run before the fix" in cells[0]) == bool(result.get("before_fix")), (cells[0], result)


def test_the_readme_credit_rule_table_is_read():
    assert {arm for _, arm, _ in _credit_rule_rows()} >= {"tp", "dense_euler1", "stepwise", "egrpo"}


@pytest.mark.parametrize("folder", ["skill_compare", "skill_compare_gpu"])
def test_results_json_is_the_report_of_the_published_runs(folder):
    """``results.json`` is rewritten by hand (benchmarks/skill_grid/skill_grid_report.py) after runs land:
    a run committed without it would leave the README's table checked against stale verdicts."""
    from flowcredit.commands.bench_skill import skill_report
    from flowcredit.tasks.shapes import load_prompts

    records = {f.stem: json.loads(f.read_text()) for f in sorted((RESULTS / folder / "runs").glob("*.json"))}
    fresh = skill_report(records, {m["prompt"]: m["category"] for m in load_prompts("test")})["paired"]
    stored = json.loads((RESULTS / folder / "results.json").read_text())["paired"]
    assert sorted(fresh) == sorted(stored), "rerun benchmarks/skill_grid/skill_grid_report.py on " + folder
    for arm, result in fresh.items():
        assert result["seeds"] == stored[arm]["seeds"], arm
        assert result["verdict"] == stored[arm]["verdict"], arm
        assert result["diff"]["strict/overall"] == pytest.approx(
            stored[arm]["diff"]["strict/overall"], nan_ok=True
        ), arm  # n = 1: no interval
        assert result["before_fix"] == stored[arm].get("before_fix", {}), arm
        assert result["label"] == stored[arm]["label"], arm  # the words beside each verdict
