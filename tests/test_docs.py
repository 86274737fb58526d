"""The repository stands alone: its docs link to files it has, and neither the package nor the
docs point to material outside it."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "RESULTS.md", ROOT / "BENCHMARKS.md",
        *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("page", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        assert (page.parent / target).exists(), f"{page.name}: broken link {target}"


def test_nothing_points_outside_the_repository():
    pattern = re.compile(r"\.\./shared|shared/(NOTES|SPEC|STYLE)|SPEC §|STYLE #|\bthe SPEC\b")
    files = [*ROOT.joinpath("fedjax_rcl").rglob("*.py"), *DOCS,
             *ROOT.joinpath("experiments").glob("*.yaml"),
             *ROOT.joinpath("experiments").glob("*/*.yaml")]
    hits = [f"{p.relative_to(ROOT)}:{i}" for p in files
            for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert hits == []
