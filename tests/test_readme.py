"""The README's commands and examples stay true."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def test_two_setup_commands_and_ci_runs_the_test_one():
    commands = re.findall(r"```bash\n(.*?)\n```", README, re.S)
    assert len(commands) == 2
    start, test = commands
    assert "python -m jkv.server" in start and "pip install" in start
    assert "pytest" in test and ".[dev]" in test
    assert test in (ROOT / ".ci" / "run").read_text()


@pytest.mark.smollm2
def test_research_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", README, re.S)
    example = next(b for b in blocks if "forward(" in b)
    namespace: dict = {}
    exec(compile(example, "README.md", "exec"), namespace)
    assert int(namespace["logits"].argmax()) == 7042


def test_the_readme_links_the_architecture_document():
    assert "(docs/architecture.md)" in README
    assert (ROOT / "docs" / "architecture.md").is_file()
