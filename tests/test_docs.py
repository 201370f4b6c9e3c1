"""The user docs (README.md, docs/**/*.md) stay navigable and read as docs, not as a lab diary.

* every relative link resolves: the file (or folder) exists, and a ``#anchor`` names a heading of the target;
* no working-session ordinals ("session", "stint", "twenty-third") and no dated section titles;
* commit hashes appear only in the provenance column of a benchmark table (docs/benchmarks.md, docs/quickstart.md).

Pure text checks: no imports of vagent, well under a second.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
# Tables whose provenance column may name the commit that was measured.
PROVENANCE_PAGES = {
    ROOT / "docs" / "benchmarks.md",
    ROOT / "docs" / "quickstart.md",
    ROOT / "docs" / "guide" / "rollout.md",
}

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
ORDINAL = re.compile(
    r"\b(sessions?|stints?|(eleven|twelf|thirteen|fourteen|fifteen|sixteen|seventeen|eighteen|nineteen|twentie|thirtie)th"
    r"|(twenty|thirty)-(first|second|third|fourth|fifth|sixth|seventh|eighth|ninth))\b",
    re.IGNORECASE,
)
DATE = re.compile(
    r"\b(\d{4}-\d{2}-\d{2}|(jan|feb|mar|apr|may|jun|jul|aug|sep|oct|nov|dec)[a-z]*\.? \d{1,2},? \d{4})\b", re.IGNORECASE
)
# 7-40 hex characters with at least one digit and one letter (so "decade" or "2048" are not hashes).
COMMIT = re.compile(r"\b(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")


def _prose_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of the lines outside fenced code blocks."""
    out, fenced = [], False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((number, line))
    return out


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lowercased, punctuation removed, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = text.replace("`", "").replace("*", "").strip().lower()
    return re.sub(r"\s", "-", re.sub(r"[^\w\- ]", "", text))


def _anchors(path: Path) -> set[str]:
    anchors, seen = set(), {}
    for _, line in _prose_lines(path):
        match = HEADING.match(line)
        if match:
            slug = _slug(match.group(2))
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def _links(path: Path) -> list[tuple[int, str]]:
    return [(n, m.group(1)) for n, line in _prose_lines(path) for m in LINK.finditer(INLINE_CODE.sub("", line))]


def test_the_docs_exist():
    assert (ROOT / "README.md").is_file() and len(DOCS) > 5, DOCS


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path: Path):
    broken = []
    for number, target in _links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            broken.append(f"line {number}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"line {number}: {target} (no heading with anchor #{anchor} in {dest.name})")
    assert not broken, f"{path.relative_to(ROOT)}:\n" + "\n".join(broken)


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_diary(path: Path):
    problems = []
    for number, line in _prose_lines(path):
        if ORDINAL.search(line):
            problems.append(f"line {number}: working-session ordinal {ORDINAL.search(line).group(0)!r}: {line[:80]}")
        if HEADING.match(line) and DATE.search(line):
            problems.append(f"line {number}: a dated section title: {line[:80]}")
        in_provenance_table = path in PROVENANCE_PAGES and line.lstrip().startswith("|")
        if COMMIT.search(line) and not in_provenance_table:
            problems.append(f"line {number}: commit hash {COMMIT.search(line).group(0)} outside a benchmark table")
    assert not problems, f"{path.relative_to(ROOT)}:\n" + "\n".join(problems)


def test_the_checks_catch_what_they_are_for(tmp_path):
    """The link, anchor and diary checks fail on a page made to break them (so a pass above means something)."""
    (tmp_path / "other.md").write_text("# Train Qwen2.5-VL-7B\n\n## Known limits\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Results (2026-11-24, twenty-third session)\n\n"
        "[ok](other.md#train-qwen25-vl-7b) [ok](other.md#known-limits) [bad](other.md#nope) [gone](missing.md)\n"
        "```\n[inside a fence](not-a-link.md)\n```\n"
        "Measured at b052cf9.\n"
    )
    assert _anchors(tmp_path / "other.md") == {"train-qwen25-vl-7b", "known-limits"}
    assert [t for _, t in _links(page)] == [
        "other.md#train-qwen25-vl-7b",
        "other.md#known-limits",
        "other.md#nope",
        "missing.md",
    ]
    lines = [line for _, line in _prose_lines(page)]
    assert any(ORDINAL.search(line) for line in lines) and DATE.search(lines[0])
    assert COMMIT.search("Measured at b052cf9.") and not COMMIT.search("a decade, 2048 tokens, defaced")
