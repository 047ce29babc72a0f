"""The course's pages (README.md, CONTRIBUTING.md, BENCHMARKS.md, docs/*.md): every link and every repository path they
name leads somewhere, and the README stays a page for a first visit, with the one test command that .ci/run runs.

What counts as a pointer:
- a Markdown link `[text](target)` whose target is not a URL (http, https, mailto): the file or folder must exist,
  relative to the page; an anchor (`#section`) must be a heading of the page it points to, slugged as GitHub does;
- a repository path named in backticks or in a fenced code block: a word that starts with one of the repository's
  top-level folders (`utils/decoder.py`, `tests/part3_grpo/`), a top-level file named bare (`constraints.txt`,
  `Dockerfile`), or a module run with `python -m` from the course's own packages (`python -m solutions.part3_grpo`).
  Words with a placeholder (`partN_<topic>`, `part*.ipynb`, `...`) are patterns, not paths, and are left alone, as is
  the file CONTRIBUTING.md's worked example has the reader write.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, ROOT / "CONTRIBUTING.md", ROOT / "BENCHMARKS.md", *sorted(ROOT.glob("docs/*.md"))]
README_MAX_LINES = 260  # issue 44: a README that fits a first visit; the rest lives in docs/

TOP_FOLDERS = (".ci", "bench", "chapters", "docs", "solutions", "tests", "utils")
TOP_FILE = re.compile(r"[\w.-]+\.(?:md|txt|ini|toml|cfg)|Dockerfile|conftest\.py")  # named bare: at the root
PACKAGES = ("bench", "solutions", "tests", "utils")  # `python -m` targets that are the course's own
PLACEHOLDER = re.compile(r"[<>*…]|\.\.\.|partN")
# Files a page has the reader make: CONTRIBUTING.md's worked example scaffolds the exercise token_entropy
MADE_BY_THE_READER = {"tests/part0_warmup/test_token_entropy.py"}
FENCE = re.compile(r"^```.*?^```[^\n]*$", re.M | re.S)
LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
CODE_SPAN = re.compile(r"`([^`]+)`")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$", re.M)


def name(page: Path) -> str:
    return str(page.relative_to(ROOT))


def slugs(page: Path) -> set[str]:
    """The anchors GitHub gives the page's headings: lower case, punctuation dropped, spaces made hyphens, and a
    repeated heading numbered (-1, -2, ...)."""
    seen: dict[str, int] = {}
    found = set()
    for _, title in HEADING.findall(FENCE.sub("", page.read_text())):
        title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", title)  # a link in a heading: its text
        slug = re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def links(page: Path) -> list[str]:
    """The page's link targets outside code blocks, URLs left out."""
    targets = LINK.findall(FENCE.sub("", page.read_text()))
    return [t for t in targets if not re.match(r"(?:https?|mailto):", t)]


def named_paths(page: Path) -> list[tuple[str, str]]:
    """The repository paths ("path", `utils/decoder.py`) and course modules run with `python -m` ("module",
    `solutions.part3_grpo`) that the page names in backticks or in code blocks."""
    text = page.read_text()
    code = [m.group(0) for m in FENCE.finditer(text)] + CODE_SPAN.findall(FENCE.sub("", text))
    named = []
    for piece in code:
        words = [w.strip("()[]{},;:\"'`") for w in piece.split()]
        for before, word in zip(["", *words], words):
            if not word or PLACEHOLDER.search(word):
                continue
            word = word.removeprefix("./")
            if before == "-m":
                if word.split(".")[0] in PACKAGES:
                    named.append(("module", word))
            elif "/" in word and word.split("/")[0] in TOP_FOLDERS or TOP_FILE.fullmatch(word):
                named.append(("path", word))
    return named


def path_exists(path: str) -> bool:
    """A file or folder, or an object in a module named after its file (`tests/meta.message_faults`)."""
    if path in MADE_BY_THE_READER or (ROOT / path).exists():
        return True
    module, dot, attribute = path.rpartition(".")
    return bool(dot) and "/" not in attribute and (ROOT / f"{module}.py").is_file()


def module_exists(module: str) -> bool:
    path = ROOT.joinpath(*module.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file() or (path / "__main__.py").is_file()


@pytest.mark.parametrize("page", PAGES, ids=name)
def test_every_link_leads_somewhere(page):
    """A relative link must reach a file or folder of the repository, and its anchor a heading of that page: a section
    moved to docs/ must not leave a link to where it was."""
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        where = (page.parent / path).resolve() if path else page
        if not where.exists() or not where.is_relative_to(ROOT):
            broken.append(f"{target}: no such file or folder (looked for {where})")
        elif anchor and where.suffix == ".md" and anchor not in slugs(where):
            broken.append(f"{target}: {name(where)} has no heading with the anchor #{anchor} "
                          f"(its anchors: {', '.join(sorted(slugs(where)))})")
    assert not broken, f"{name(page)} has {len(broken)} broken link(s):\n  " + "\n  ".join(broken)


@pytest.mark.parametrize("page", PAGES, ids=name)
def test_every_repository_path_named_exists(page):
    """A path or a module named in backticks or in a command must exist, so that a moved file cannot leave a page that
    sends the reader (or the reader's shell) nowhere."""
    missing = sorted({word for kind, word in named_paths(page)
                      if not (module_exists(word) if kind == "module" else path_exists(word))})
    assert not missing, f"{name(page)} names what the repository does not have: {missing}"


def test_the_pages_name_paths_at_all():
    """The path finder finds what it should: a check that finds nothing would pass on every page."""
    found = [word for _, word in named_paths(README)]
    for expected in ("requirements.txt", "constraints.txt", "solutions.part3_grpo", "tests/part1_ppo"):
        assert expected in found, f"README.md names {expected}, but the path finder found only {sorted(set(found))}"
    assert "docs/learners.md" in links(README), f"README.md links docs/learners.md; found {links(README)}"


def test_readme_has_one_test_command_on_one_line():
    """.ci/run runs what lies between the markers, less the marker and fence lines
    (`sed -n '/<!-- test-command -->/,/<!-- \\/test-command -->/p' README.md | grep -v -e '<!--' -e '```'`): that must
    be one command, on one line, and CI must not pick up a second block."""
    lines = README.read_text().splitlines()
    opens = [i for i, line in enumerate(lines) if "<!-- test-command -->" in line]
    closes = [i for i, line in enumerate(lines) if "<!-- /test-command -->" in line]
    assert len(opens) == 1 and len(closes) == 1, (
        f"README.md should hold one <!-- test-command --> ... <!-- /test-command --> block; it has {len(opens)} "
        f"opening and {len(closes)} closing marker(s)")
    assert opens[0] < closes[0], "README.md's <!-- /test-command --> comes before <!-- test-command -->"
    kept = [line for line in lines[opens[0]:closes[0] + 1] if "<!--" not in line and "```" not in line]
    assert len(kept) == 1 and kept[0].strip(), (
        f"between its markers README.md should hold one non-empty line of command (what .ci/run runs); it holds "
        f"{kept}")
    assert "pytest" in kept[0], f"README.md's test command does not run pytest: {kept[0]!r}"


def test_readme_fits_a_first_visit():
    """The README says what the course is, the two commands with their figures, the parts, and where to go next; the
    rest lives in docs/, each page linked from it."""
    count = len(README.read_text().splitlines())
    assert count <= README_MAX_LINES, (
        f"README.md has {count} lines, over {README_MAX_LINES}: move a section to docs/ (and link it from the README)")
    linked = {(README.parent / target.partition("#")[0]).resolve() for target in links(README)}
    unlinked = [name(page) for page in sorted(ROOT.glob("docs/*.md")) if page.resolve() not in linked]
    assert not unlinked, f"README.md's 'Where to go next' should link every page of docs/; it misses {unlinked}"
