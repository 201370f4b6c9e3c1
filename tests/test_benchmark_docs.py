"""docs/benchmarks.md's generated sections: benchmarks write their tables between markers, with provenance."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _doc_table():
    spec = importlib.util.spec_from_file_location("doc_table", ROOT / "benchmarks" / "doc_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_section_is_replaced_between_its_markers_with_command_commit_and_machine(tmp_path):
    doc_table = _doc_table()
    page = tmp_path / "benchmarks.md"
    page.write_text("# B\n\nbefore\n<!-- bench:x -->\nold table\n<!-- /bench:x -->\nafter\n")
    doc_table.write_section("x", "| a |\n|---|\n| 1 |", "python benchmarks/x.py --n 2", doc=page)
    doc_table.write_section("x", "| a |\n|---|\n| 2 |", "python benchmarks/x.py --n 3", doc=page)
    text = page.read_text()
    assert text.startswith("# B\n\nbefore\n<!-- bench:x -->\n") and text.endswith("<!-- /bench:x -->\nafter\n")
    assert "old table" not in text and "| 1 |" not in text and "| 2 |" in text
    provenance = next(line for line in text.splitlines() if "python benchmarks/x.py --n 3" in line)
    assert provenance.startswith("| `python") and re.search(r"\| `[0-9a-f]{7,}(\+changes)?` \|", provenance)


def test_a_page_without_the_markers_is_an_error_not_an_append(tmp_path):
    page = tmp_path / "benchmarks.md"
    page.write_text("# B\n")
    with pytest.raises(SystemExit, match="bench:x"):
        _doc_table().write_section("x", "| a |", "python x.py", doc=page)
    assert page.read_text() == "# B\n"


def test_every_generated_section_of_the_page_has_both_markers():
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    begins = re.findall(r"<!-- bench:([\w-]+) -->", text)
    assert begins and sorted(begins) == sorted(re.findall(r"<!-- /bench:([\w-]+) -->", text))


def test_every_generated_section_names_the_benchmark_that_writes_it():
    """A section's provenance names a script in benchmarks/ that takes ``--doc`` and writes that key (literal, or
    as ``f"rollout-{...}"`` for keys built from the setup)."""
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    sections = re.findall(r"<!-- bench:([\w-]+) -->\n(.*?)<!-- /bench:\1 -->", text, flags=re.S)
    assert sections
    for key, body in sections:
        script = re.search(r"^\| `python (benchmarks/\w+\.py)", body, flags=re.M)
        assert script, f"section {key!r} has no provenance row naming its benchmark"
        source = (ROOT / script.group(1)).read_text()
        prefix = key.split("-")[0]
        assert '"--doc"' in source and (f'"{key}"' in source or f'f"{prefix}-{{' in source), (key, script.group(1))
