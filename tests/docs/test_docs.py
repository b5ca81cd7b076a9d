"""docs/ stays true: the configuration reference is what the parsers say, and every link in README.md and docs/
points at a file that exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from jaxinfer.cli_reference import render

REPO = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_configuration_reference_matches_the_parsers():
    committed = (REPO / "docs" / "configuration.md").read_text()
    assert committed == render(), "regenerate: python -m jaxinfer.cli_reference > docs/configuration.md"


@pytest.mark.parametrize("doc", ["README.md", *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").rglob("*.md"))])
def test_relative_links_resolve(doc: str):
    path = REPO / doc
    for target in LINK.findall(path.read_text()):
        if "://" in target or target.startswith("mailto:"):
            continue
        assert (path.parent / target).exists(), f"{doc} links to missing {target}"
