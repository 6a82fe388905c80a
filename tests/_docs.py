"""The documentation's pages and their fenced blocks, for tests/test_docs.py and
tests/test_readme.py: README.md, every page of the site under docs/ (not the
notebooks) and the repository files a page includes with `--8<-- "path"`."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
# A fenced block, possibly indented (inside a list item): its indent, language, code.
FENCE = re.compile(r"^( *)```(\w*)[^\n]*\n(.*?)^\1```[ \t]*$", flags=re.S | re.M)
NOT_RUN = re.compile(r"<!--\s*not-run:(.*?)-->", flags=re.S)
INCLUDE = re.compile(r'^--8<--\s+"([^"]+)"\s*$', flags=re.M)


def site_pages():
    """README.md and the Markdown pages of docs/, without the files they include."""
    pages = [ROOT / "README.md"]
    for page in sorted(DOCS.rglob("*.md")):
        if "notebooks" not in page.relative_to(DOCS).parts:
            pages.append(page)
    return pages


def pages():
    """`site_pages()` and the repository files they include."""
    found = site_pages()
    for page in list(found):
        for included in INCLUDE.findall(page.read_text(encoding="utf-8")):
            found.append(ROOT / included)
    return found


def blocks(paths, root=ROOT):
    """(path from `root`, line, language, code, not-run reason or None) of each fenced block."""
    found = []
    for page in paths:
        text = page.read_text(encoding="utf-8")
        for match in FENCE.finditer(text):
            before = text[:match.start()].rstrip().rsplit("\n", 1)[-1].strip()
            marker = NOT_RUN.fullmatch(before)
            indent = len(match.group(1))
            code = "\n".join(line[indent:] for line in match.group(3).split("\n"))
            found.append((page.relative_to(root).as_posix(), text.count("\n", 0, match.start()) + 1,
                          match.group(2), code, marker.group(1).strip() if marker else None))
    return found
