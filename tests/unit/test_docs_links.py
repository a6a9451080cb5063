"""The documentation's links lead somewhere, and nowhere outside the repository.

Every relative link in README.md, docs/*.md and the folder guides (deploy/, benchmarks/)
must name a file of this tree, and a ``#anchor`` must name a heading of the page it points to,
as GitHub spells heading anchors. Web addresses (``https:``, ``mailto:``) are not followed;
any other scheme, an absolute path or a path that climbs out of the tree is refused. The
checker is pure text work over files, so its rules are tested on a tree of their own too.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parents[2]

# An opening or closing code fence (``` or ~~~, indented at most three spaces).
FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
HEADING = re.compile(r"^ {0,3}#{1,6}[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$")
# An inline code span: a run of backticks, then the same run again (never part of a longer one).
CODE_SPAN = re.compile(r"(?<!`)(`+)(?!`).+?(?<!`)\1(?!`)", re.DOTALL)
# [text](target) or ![alt](target), the target optionally in <>, with an optional "title";
# the text may hold one level of brackets and span lines, as a wrapped paragraph's does.
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^>]*>|[^\s()]+)(?:\s+\"[^\"]*\")?\s*\)")
INLINE_LINK = re.compile(r"\[([^\]]*)\]\([^)]*\)")
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
WEB_SCHEMES = frozenset({"http", "https", "mailto"})


def pages(root: Path = ROOT) -> list[Path]:
    """The documentation: the README, every page of docs/, and the folder guides."""
    return [
        root / "README.md",
        *sorted((root / "docs").glob("*.md")),
        root / "deploy" / "README.md",
        root / "benchmarks" / "README.md",
    ]


def unfenced(text: str) -> str:
    """``text`` with its fenced code blocks blanked, line numbers kept."""
    kept: list[str] = []
    fence: str | None = None
    for line in text.splitlines():
        opening = FENCE.match(line)
        if fence is None and opening:
            fence = opening.group(1)
            kept.append("")
        elif fence is not None:
            if opening and opening.group(1)[0] == fence[0] and len(opening.group(1)) >= len(fence):
                fence = None
            kept.append("")
        else:
            kept.append(line)
    return "\n".join(kept)


def prose(text: str) -> str:
    """``text`` without its code blocks and code spans (line numbers kept): what looks like a
    link there is code, not a link."""
    return CODE_SPAN.sub(lambda m: "\n" * m.group(0).count("\n"), unfenced(text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text (link targets and code marks dropped),
    lower-cased, without punctuation but ``-`` and ``_``, spaces made hyphens."""
    text = INLINE_LINK.sub(r"\1", heading).replace("`", "").lower()
    return "".join(c for c in text if c.isalnum() or c in "-_ ").replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading anchor of a Markdown page; a repeated one gets ``-1``, ``-2``… as on
    GitHub."""
    seen: dict[str, int] = {}
    found: set[str] = set()
    for line in unfenced(text).splitlines():
        heading = HEADING.match(line)
        if heading is None:
            continue
        base = slug(heading.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(text: str) -> Iterator[tuple[int, str]]:
    """(line number, target) of every link and image in a page's prose."""
    body = prose(text)
    for match in LINK.finditer(body):
        target = match.group(1).removeprefix("<").removesuffix(">")
        yield body.count("\n", 0, match.start(1)) + 1, target


def broken(page: Path, root: Path = ROOT) -> list[str]:
    """What is wrong with each link of ``page``: a missing file or heading, or a target that
    is not in the tree."""
    problems: list[str] = []
    root = root.resolve()
    for line, target in links(page.read_text()):
        where = f"{page.relative_to(root)}:{line}: {target}"
        scheme = SCHEME.match(target)
        if scheme:
            if scheme.group(0)[:-1].lower() not in WEB_SCHEMES:
                problems.append(f"{where}: not a web address nor a path in the repository")
            continue
        path_part, _, anchor = target.partition("#")
        if path_part.startswith("/"):
            problems.append(f"{where}: an absolute path; link relative to the page")
            continue
        file = (page.parent / unquote(path_part)).resolve() if path_part else page.resolve()
        if not file.is_relative_to(root):
            problems.append(f"{where}: outside the repository")
            continue
        if not file.exists():
            problems.append(f"{where}: no such file")
            continue
        if not anchor:
            continue
        if file.suffix != ".md":
            problems.append(f"{where}: an anchor into a file that has no headings")
        elif unquote(anchor) not in anchors(file.read_text()):
            problems.append(f"{where}: no heading with that anchor in {file.relative_to(root)}")
    return problems


def test_every_link_in_the_documentation_leads_to_a_file_and_heading_in_the_repository() -> None:
    documented = pages()
    assert (ROOT / "docs" / "design.md") in documented
    assert all(page.exists() for page in documented), documented
    problems = [problem for page in documented for problem in broken(page)]
    assert not problems, "\n".join(problems)


def test_the_readme_maps_every_page_of_docs() -> None:
    """A page nobody links to is a page nobody finds."""
    readme = {target.partition("#")[0] for _, target in links((ROOT / "README.md").read_text())}
    unlisted = sorted(
        page.name for page in (ROOT / "docs").glob("*.md") if f"docs/{page.name}" not in readme
    )
    assert not unlisted, unlisted


# The checker's own rules, on a tree of their own: each kind of bad link is caught.


def tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


def test_a_link_to_a_missing_file_or_heading_is_caught(tmp_path: Path) -> None:
    root = tree(
        tmp_path,
        {
            "README.md": "# Top\n\nSee [a](docs/a.md#one), [b](docs/b.md), [c](docs/a.md#two),\n"
            "[d](#top) and [e](#nowhere).\n",
            "docs/a.md": "# One\n",
        },
    )
    assert broken(root / "README.md", root) == [
        "README.md:3: docs/b.md: no such file",
        "README.md:3: docs/a.md#two: no heading with that anchor in docs/a.md",
        "README.md:4: #nowhere: no heading with that anchor in README.md",
    ]


def test_a_link_out_of_the_tree_or_by_absolute_path_or_odd_scheme_is_caught(
    tmp_path: Path,
) -> None:
    outside = tmp_path / "shared"
    outside.mkdir()
    (outside / "DESIGN.md").write_text("# Design\n")
    root = tree(
        tmp_path / "repo",
        {
            "docs/a.md": "[x](../../shared/DESIGN.md) [y](/etc/hosts) [z](file:///etc/hosts)\n"
            "[w](https://example.org/x) [m](mailto:a@example.org)\n",
        },
    )
    assert broken(root / "docs" / "a.md", root) == [
        "docs/a.md:1: ../../shared/DESIGN.md: outside the repository",
        "docs/a.md:1: /etc/hosts: an absolute path; link relative to the page",
        "docs/a.md:1: file:///etc/hosts: not a web address nor a path in the repository",
    ]


def test_links_wrapped_over_lines_and_images_are_read_and_code_is_not(tmp_path: Path) -> None:
    root = tree(
        tmp_path,
        {
            "a.md": "A [wrapped\nlink](missing.md) and ![an image](gone.png).\n\n"
            "```sh\n[not](a-link.md)\n```\n\n`[nor](this.md)` ``[nor ` this](x.md)``\n",
        },
    )
    assert broken(root / "a.md", root) == [
        "a.md:2: missing.md: no such file",
        "a.md:2: gone.png: no such file",
    ]


def test_anchors_are_spelt_as_github_spells_them() -> None:
    page = (
        "# Guarantees, and how they are kept\n"
        "## Failures: the reaper\n"
        "### One machine: `coordinator up`\n"
        "## What `sync_interval: always` costs\n"
        "## A [linked](x.md) heading ##\n"
        "## Notes\n## Notes\n"
        "```\n# not a heading\n```\n"
    )
    assert anchors(page) == {
        "guarantees-and-how-they-are-kept",
        "failures-the-reaper",
        "one-machine-coordinator-up",
        "what-sync_interval-always-costs",
        "a-linked-heading",
        "notes",
        "notes-1",
    }
