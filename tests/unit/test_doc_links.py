"""Every link in the README, docs/ and the benchmarks' results files points at something that exists: a file or
folder of the repository, and, after a `#`, a heading of that page (GitHub's anchors)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "bench").glob("*RESULTS.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {anchor(line.lstrip("#")) for line in text.splitlines() if line.startswith("#")}


def broken_links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # code blocks hold no links
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, fragment = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
        elif fragment and resolved.suffix == ".md" and fragment not in anchors(resolved):
            broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    return broken


def test_the_anchor_rule_matches_githubs() -> None:
    assert anchor("Kettle's CPU kernels (`kettle/kernels/`)") == "kettles-cpu-kernels-kettlekernels"
    assert anchor("Settings") == "settings"


def test_every_link_points_at_something_that_exists() -> None:
    broken = [entry for page in PAGES if page.exists() for entry in broken_links(page)]
    assert not broken, "\n".join(broken)


def test_the_readme_starts_with_the_two_set_up_commands_and_stays_a_guide() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert lines[0].split()[:2] == ["make", "serve"] and lines[1].split()[:2] == ["make", "test"]
    assert len(lines) <= 300
