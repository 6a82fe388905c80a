"""The built documentation site reads as written: no paragraph turned into a quotation
(a docstring or page line that starts with ``>=`` is a Markdown blockquote), no link
to an anchor the target page does not have (``#x`` and ``page/#x``, checked against
the ids the built HTML really has: `mkdocs build --strict` checks the Markdown
pages' links, not the notebooks' tables of contents nor the API reference), and the
API reference's long signatures wrapped (the docs extra installs Ruff for
mkdocstrings; without a formatter each is one clipped line).

The site is the one .ci/run built (``TFMP_DOCS_SITE``), or built here into a
temporary directory where the docs extra is installed (6 s of CPU time on the 2-core
AMD EPYC Zen 3, 13 s of wall time there at a load average of 8; Ruff's formatting of
the signatures is within that spread)."""

import html
import html.parser
import os
import pathlib
import re
import subprocess
import sys
import urllib.parse

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# The longest signature line the reference may show: mkdocstrings wraps at 60
# characters, and a default value longer than that stays on its line.
SIGNATURE_LINE = 88
SIGNATURE = re.compile(r'<div class="doc-signature highlight"><pre>(.*?)</pre>', flags=re.S)


class _Page(html.parser.HTMLParser):
    """The ids, the link targets and the blockquotes of one HTML page."""

    def __init__(self, text):
        super().__init__()
        self.ids, self.links, self.quotes = set(), [], 0
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if "id" in attrs:
            self.ids.add(attrs["id"])
        if tag == "a" and attrs.get("href"):
            self.links.append(attrs["href"])
        self.quotes += tag == "blockquote"


def problems(site):
    """Each blockquote, dead in-page anchor and unwrapped signature of the site at `site`."""
    pages = {path: _Page(path.read_text(encoding="utf-8")) for path in sorted(site.rglob("*.html"))}
    found = []
    for path, page in pages.items():
        where = path.relative_to(site).as_posix()
        if page.quotes:
            found.append(f"{where}: {page.quotes} blockquote(s): a line starting with '>'")
        for link in page.links:
            parts = urllib.parse.urlsplit(link)
            if parts.scheme or parts.netloc or not parts.fragment:
                continue
            target = (path.parent / urllib.parse.unquote(parts.path)).resolve() if parts.path else path
            target = target / "index.html" if target.is_dir() else target
            if target not in pages:
                found.append(f"{where}: {link} names no page of the site")
            elif urllib.parse.unquote(parts.fragment) not in pages[target].ids:
                found.append(f"{where}: {link}: no such id in {target.relative_to(site).as_posix()}")
    for signature in SIGNATURE.findall((site / "reference" / "index.html").read_text(encoding="utf-8")):
        text = html.unescape(re.sub(r"<[^>]+>", "", signature))
        found += [f"reference: signature line of {len(line)} characters: {line[:60]}..."
                  for line in text.splitlines() if len(line) > SIGNATURE_LINE]
    return found


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    if os.environ.get("TFMP_DOCS_SITE"):
        built = pathlib.Path(os.environ["TFMP_DOCS_SITE"])
        assert (built / "reference" / "index.html").is_file(), f"TFMP_DOCS_SITE={built}: no site there"
        return built
    for module in ("mkdocs", "material", "mkdocstrings_handlers.python", "mkdocs_jupyter"):
        pytest.importorskip(module, reason="the docs extra (pip install .[docs]) builds the site")
    built = tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(built)],
                   cwd=ROOT, check=True, env=dict(os.environ, NO_MKDOCS_2_WARNING="1"))
    return built


def test_the_site_has_no_blockquote_no_dead_anchor_and_wrapped_signatures(site):
    assert problems(site) == []
    # What it reads is there: the reference's signatures, and the in-page links of
    # a notebook's table of contents.
    reference = (site / "reference" / "index.html").read_text(encoding="utf-8")
    assert len(SIGNATURE.findall(reference)) >= 50
    notebook = _Page((site / "notebooks" / "01_quickstart" / "index.html").read_text(encoding="utf-8"))
    assert sum(link.startswith("#") for link in notebook.links) >= 5


def test_the_check_finds_a_blockquote_a_dead_anchor_and_a_clipped_signature(tmp_path):
    (tmp_path / "reference").mkdir()
    (tmp_path / "guide").mkdir()
    long = "x" * (SIGNATURE_LINE + 1)
    (tmp_path / "reference" / "index.html").write_text(
        '<h3 id="tfmp.enable">enable</h3><blockquote><p>= 8.0</p></blockquote>'
        f'<div class="doc-signature highlight"><pre><code>enable(a,\n    b)</code></pre></div>'
        f'<div class="doc-signature highlight"><pre><code>compare({long})</code></pre></div>'
        '<a href="#tfmp.enable">ok</a><a href="#tfmp.gone">dead</a>', encoding="utf-8")
    (tmp_path / "guide" / "index.html").write_text(
        '<h2 id="2-data-through-tfdata">2</h2><a href="#2-data-through">dead</a>'
        '<a href="../reference/#tfmp.enable">ok</a><a href="../reference/#tfmp.disable">dead</a>'
        '<a href="../missing/#x">no page</a><a href="https://example.com/#x">outside</a>', encoding="utf-8")
    assert problems(tmp_path) == [
        "guide/index.html: #2-data-through: no such id in guide/index.html",
        "guide/index.html: ../reference/#tfmp.disable: no such id in reference/index.html",
        "guide/index.html: ../missing/#x names no page of the site",
        "reference/index.html: 1 blockquote(s): a line starting with '>'",
        "reference/index.html: #tfmp.gone: no such id in reference/index.html",
        f"reference: signature line of {len(long) + 9} characters: compare({long[:52]}...",
    ]
