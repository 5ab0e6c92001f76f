"""The docs agree with the code: every flag documented, no stale flag, no broken link, README the front page."""

import re
from pathlib import Path

import pytest

import run

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")  # [text](target), ![alt](target)
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*(?!\w)")  # --batch-size; not a--b, -- run.py or --xla_force_...


def run_flags() -> set[str]:
    """Every option `python run.py --help` lists (but -h / --help)."""
    return {option for action in run.parser()._actions for option in action.option_strings
            if option.startswith("--") and option != "--help"}


def cli_reference() -> str:
    return (DOCS / "cli.md").read_text()


OTHER_PROGRAM = re.compile(r"(time )?(python (?!run\.py)\S+|tensorboard|pytest|pip|srun|mpirun)\b")


def run_section(text: str) -> str:
    """docs/cli.md's part about run.py: up to the section on other commands (whose flags are their own), without
    code that runs another program (`tensorboard --logdir DIR`, `python benchmarks/overhead.py --rounds 3`)."""
    text = text.split("\n## Other commands", 1)[0]
    text = re.sub(r"^(?!```).*$", lambda m: "" if OTHER_PROGRAM.match(m.group(0)) else m.group(0), text, flags=re.M)
    return re.sub(r"`[^`]*`", lambda m: "" if OTHER_PROGRAM.match(m.group(0)[1:]) else m.group(0), text)


ROW = re.compile(r"^\| `(--[a-z][a-z0-9-]*)", re.M)  # a table row of its own: | `--flag ARG` | default | meaning |


def test_every_run_flag_is_in_the_cli_reference():
    documented = set(ROW.findall(run_section(cli_reference())))
    missing = sorted(run_flags() - documented)
    assert not missing, f"flags of python run.py --help without their row (default, meaning) in docs/cli.md: {missing}"


def test_every_flag_the_cli_reference_names_is_real():
    stale = sorted(set(FLAG.findall(run_section(cli_reference()))) - run_flags() - {"--help"})
    assert not stale, f"docs/cli.md names flags run.py does not have: {stale}"


def test_the_flag_parser_finds_flags_in_markdown():  # the two tests above are only as good as these
    assert FLAG.findall("`--batch-size B`, `--lr`; -- run.py --mesh 2x4, not a--b, x---y or --xla_flag") == [
        "--batch-size", "--lr", "--mesh"]
    text = ("`python run.py --steps 3`, `time python run.py\n--seed 1`, `python benchmarks/overhead.py --rounds 3`,\n"
            "`tensorboard --logdir DIR`, --keep\n```bash\npython run.py --lr 1\npytest --maxfail 1\n```\n"
            "## Other commands\n--nproc 2")
    assert FLAG.findall(run_section(text)) == ["--steps", "--seed", "--keep", "--lr"]


def links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # code blocks hold no links
    return [a or b for a, b in LINK.findall(text)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_to_existing_files(page):
    broken = []
    for target in links(page):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):  # https:, mailto:, an anchor in the page
            continue
        path = target.split("#", 1)[0]
        if not (page.parent / path).exists():
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)} links to missing files: {broken}"


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(ROOT / target.split("#", 1)[0]).resolve() for target in links(ROOT / "README.md")}
    unlinked = [page.name for page in DOCS.glob("*.md") if page.resolve() not in linked]
    assert not unlinked, f"docs pages the README's contents do not link: {unlinked}"


def test_readme_is_a_front_page():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) < 260, f"README.md has {len(lines)} lines; move detail into docs/"


def ci_test_command() -> str:
    """The command .ci/run runs: its last line."""
    lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    return [line for line in lines if line and not line.startswith("#")][-1]


def test_readme_opens_with_the_ci_test_command():
    command = ci_test_command()
    assert "pytest" in command, f".ci/run's last command does not run the tests: {command!r}"
    first_block = re.search(r"```[a-z]*\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    assert first_block, "README.md has no code block"
    commands = [line.split("  #", 1)[0].strip() for line in first_block.group(1).splitlines()]
    assert command in commands, f"README's first code block does not hold .ci/run's command {command!r}: {commands}"
    assert any(c.startswith("pip install -e . && python run.py") for c in commands), \
        f"README's first code block does not install and run the main job: {commands}"
