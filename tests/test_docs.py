"""The documentation a newcomer reads first: README stays one screenful of usage with a row and an
example per command, and every link between the docs reaches a file and a heading that exist."""

import re
from pathlib import Path

from megamoe_cli.cli import main

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
LINK = re.compile(r"\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but hyphens dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set:
    return {slug(line.lstrip("#")) for line in path.read_text().splitlines() if line.startswith("#")}


def relative_links(path: Path):
    for target in LINK.findall(path.read_text()):
        if not re.match(r"[a-z]+:", target):
            yield target


def test_slug_matches_githubs_anchors():
    assert slug(" Exit statuses") == "exit-statuses"
    assert slug(" In a serving engine (DeepSeek-V4, MXFP4, `torch.compile`, CUDA graphs)") == \
        "in-a-serving-engine-deepseek-v4-mxfp4-torchcompile-cuda-graphs"


def test_the_readme_stays_short():
    lines = README.read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; move reference material to docs/"


def test_every_command_has_a_readme_row_and_example_and_a_section_in_the_commands_doc():
    readme = README.read_text()
    commands_doc = REPO / "docs" / "COMMANDS.md"
    sections = anchors(commands_doc)
    assert main.commands, "the CLI group lists no commands"
    for name in main.commands:
        assert re.search(rf"^\| `{name}` \|", readme, re.M), f"README's command table has no row for {name}"
        assert re.search(rf"^megamoe {name} ", readme, re.M), f"README shows no example of megamoe {name}"
        assert name in sections, f"docs/COMMANDS.md has no section for {name}"


def test_links_between_the_docs_reach_files_and_headings():
    pages = [README, *sorted((REPO / "docs").glob("*.md"))]
    checked = 0
    for page in pages:
        for target in relative_links(page):
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            assert dest.exists(), f"{page.relative_to(REPO)} links to {target}, which does not exist"
            if anchor:
                assert anchor in anchors(dest), f"{page.relative_to(REPO)} links to {target}: no such heading"
            checked += 1
    assert checked >= 10, f"only {checked} links found: is the link pattern still right?"
