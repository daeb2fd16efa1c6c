"""Every relative link of the user documentation resolves: to a file or folder of the repository, and a
`#anchor` into a Markdown file to one of its headings (GitHub's heading ids)."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest
from markdown_it import MarkdownIt

ROOT = Path(__file__).resolve().parents[2]
DOCS = ["README.md", "CHANGELOG.md", "bench/README.md", "gpu_checks/README.md",
        *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))]

MD = MarkdownIt("commonmark").enable("table")
SCHEME = re.compile(r"^([a-z][a-z0-9+.-]*:|//)", re.IGNORECASE)


def inline_tokens(text: str):
    for block in MD.parse(text):
        yield from block.children or ()


def link_targets(text: str) -> list[str]:
    """href of every link and src of every image, code spans and fenced code excluded (the parser's job)."""
    out = []
    for tok in inline_tokens(text):
        target = tok.attrGet("href") if tok.type == "link_open" else tok.attrGet("src") if tok.type == "image" else None
        if target is not None:
            out.append(target)
    return out


def heading_ids(text: str) -> set[str]:
    """The ids GitHub gives a file's headings: lower case, punctuation dropped, spaces as hyphens, -1, -2 ...
    after repeats (github-slugger)."""
    ids: set[str] = set()
    seen: dict[str, int] = {}
    tokens = MD.parse(text)
    for opening, inline in zip(tokens, tokens[1:]):
        if opening.type != "heading_open":
            continue
        words = "".join(c.content for c in inline.children or () if c.type in ("text", "code_inline"))
        slug = re.sub(r"[^\w\- ]", "", words.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        ids.add(slug if n == 0 else f"{slug}-{n}")
    return ids


def broken_links(doc: Path, root: Path = ROOT) -> list[str]:
    """'target: why' for each relative link of `doc` that does not resolve inside `root`."""
    problems = []
    for target in link_targets(doc.read_text()):
        if SCHEME.match(target):
            continue  # http(s), mailto: not ours to check here
        part, _, anchor = target.partition("#")
        dest = (doc.parent / unquote(part)).resolve() if part else doc.resolve()
        if not dest.is_relative_to(root):
            problems.append(f"{target}: outside the repository")
        elif not dest.exists():
            problems.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in heading_ids(dest.read_text()):
            problems.append(f"{target}: no heading #{anchor} in {dest.relative_to(root).as_posix()}")
    return problems


PATH_IN_CODE = re.compile(r"^[\w.-]+(/[\w.-]+)+\.(py|md|sh|yaml|json|txt|csv|log|jinja)$")


def stale_paths(doc: Path, root: Path = ROOT) -> list[str]:
    """Paths named in code spans (`clover_export/pipeline/build.py`, `engines/builder.py`, `results/x.json`)
    whose first folder is one of ours (the repository's, the package's or the doc's own) but that name no file
    there: what a moved module leaves behind. Other paths (an upstream project's) are not ours to check."""
    bases = (doc.parent, root, root / "clover_export")
    stale = []
    for tok in inline_tokens(doc.read_text()):
        if tok.type != "code_inline":
            continue
        for word in re.split(r"[\s:,()]+", tok.content):
            if PATH_IN_CODE.match(word) and any((b / word.split("/")[0]).is_dir() for b in bases):
                if not any((b / word).exists() for b in bases):
                    stale.append(word)
    return stale


@pytest.mark.parametrize("name", DOCS)
def test_every_repository_path_named_in_code_exists(name):
    assert stale_paths(ROOT / name) == [], f"{name}: paths that name no file"


@pytest.mark.parametrize("name", DOCS)
def test_every_relative_link_resolves(name):
    doc = ROOT / name
    assert doc.is_file(), f"{name}: missing"
    assert broken_links(doc) == [], f"{name}: broken links"


def test_the_checker_finds_a_missing_file_a_missing_heading_and_a_way_out(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "b.md").write_text("# The `b` page: one\n\n## Two\n\n## Two\n")
    doc = tmp_path / "a.md"
    doc.write_text("[ok](docs/b.md#the-b-page-one) [ok](docs/b.md#two-1) [ok](docs/) [ok](#top) [ok](https://x.org/y)\n"
                   "`[in code](nowhere.md)`\n\n```\n[fenced](nowhere.md)\n```\n\n# Top\n\n"
                   "[f](docs/c.md) [h](docs/b.md#three) [o](../outside.md) | [t](docs/b.md#two-2) |\n")
    assert broken_links(doc, tmp_path) == ["docs/c.md: no such file", "docs/b.md#three: no heading #three in docs/b.md",
                                 "../outside.md: outside the repository",
                                 "docs/b.md#two-2: no heading #two-2 in docs/b.md"]


def test_a_moved_module_is_a_stale_path_and_an_upstream_one_is_not(tmp_path):
    (tmp_path / "clover_export" / "pipeline").mkdir(parents=True)
    (tmp_path / "clover_export" / "pipeline" / "build.py").touch()
    doc = tmp_path / "a.md"
    doc.write_text("`pipeline/build.py`, `clover_export/pipeline/build.py: check_inputs`, `python/pkg/x.py` are fine;\n"
                   "`engines/build.py` is no folder of ours; `pipeline/gone.py` (`clover_export/pipeline/old.py`)\n")
    assert stale_paths(doc, tmp_path) == ["pipeline/gone.py", "clover_export/pipeline/old.py"]
