"""The documentation holds together: the docs site (mkdocs.yml over docs/) builds with --strict, so a link
or an anchor between its pages that points nowhere fails here; and every link in README.md, the front door,
names a file that exists and, for a Markdown file, a heading that exists in it (anchors as GitHub makes
them, since that is where the README is read)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# A Markdown link or image whose target is in this repository: not a URL, not a mail address.
LOCAL_LINK = re.compile(r"\]\((?!https?://|mailto:)([^)\s]+)\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def github_anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives a file's headings: lower case, punctuation dropped, each space a hyphen,
    and a repeated heading suffixed -1, -2, ..."""
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    in_fence = False
    for line in markdown.splitlines():
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        if in_fence or not re.match(r"#{1,6} ", line):
            continue
        title = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", r"\1", line.lstrip("#").strip())
        slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def local_links(markdown: str) -> list[str]:
    links: list[str] = []
    in_fence = False
    for line in markdown.splitlines():
        if FENCE.match(line):
            in_fence = not in_fence
        elif not in_fence:
            links += LOCAL_LINK.findall(line)
    return links


def test_the_docs_site_builds_without_a_broken_link(tmp_path: Path) -> None:
    site = tmp_path / "site"
    config = str(ROOT / "mkdocs.yml")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", config, "--site-dir", str(site)],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert result.returncode == 0, result.stderr[-6000:]
    for page in (ROOT / "docs").rglob("*.md"):  # every page is in the site (none left out of the build)
        name = page.relative_to(ROOT / "docs").with_suffix("")
        assert (site / ("" if name == Path("index") else name) / "index.html").exists(), name


def test_every_readme_link_names_a_file_and_heading_that_exist() -> None:
    readme = (ROOT / "README.md").read_text()
    broken: list[str] = []
    for link in local_links(readme):
        path, _, anchor = link.partition("#")
        target = ROOT / path if path else ROOT / "README.md"
        if not target.exists():
            broken.append(f"{link}: no file {path}")
        elif anchor and target.suffix == ".md" and anchor not in github_anchors(target.read_text()):
            broken.append(f"{link}: no heading with the anchor #{anchor} in {target.relative_to(ROOT)}")
    assert not broken, "README.md links that point nowhere:\n" + "\n".join(broken)


def test_the_anchor_rule_matches_githubs() -> None:
    text = "# Castor\n## Measured figures\n### Network (`sudo .venv/bin/python benchmarks/network.py`)\n"
    text += "```\n# not a heading\n```\n## Measured figures\n"
    assert github_anchors(text) == {
        "castor",
        "measured-figures",
        "network-sudo-venvbinpython-benchmarksnetworkpy",
        "measured-figures-1",
    }
    sample = "[a](docs/api.md#jobs) [b](https://x.org/y) ![c](docs/c.png)\n```\n[d](e.md)\n```"
    assert local_links(sample) == [
        "docs/api.md#jobs",
        "docs/c.png",
    ]
