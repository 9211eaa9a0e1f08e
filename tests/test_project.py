"""The promises the README makes to a new user: its first commands are the ones CI runs."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def readme_commands() -> list[str]:
    lines = (ROOT / "README.md").read_text().splitlines()
    block = lines[lines.index("```bash") + 1 : lines.index("```", lines.index("```bash") + 1)]
    return [line.split("  #")[0].strip() for line in block]


def test_readme_starts_with_the_two_commands():
    assert (ROOT / "README.md").read_text().splitlines()[2] == "```bash"
    run, test = readme_commands()
    assert run.endswith("./launch.sh") and "torch==2.13.0" in run
    assert test.endswith("python -m pytest -q") and "'.[test]'" in test


def test_ci_runs_the_readmes_test_command():
    ci_lines = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    assert ci_lines[-1] == readme_commands()[1]


def test_every_chapter_is_in_the_reading_order():
    reading_order = (ROOT / "tutorials" / "README.md").read_text()
    for chapter in sorted((ROOT / "tutorials").glob("[0-9][0-9]*_*.py")):
        assert chapter.name in reading_order, f"{chapter.name} missing from tutorials/README.md"
