"""The README's commands, examples and option tables stay true."""

import functools
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

import jkv
from jkv.config import OPTIONS
from jkv.config_checks import parse_bytes
from jkv.server.flags import flag_names
from jkv.server.option_table import OPTION_HEADER, SERVER_HEADER, replace_tables, tables

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
SERVER_URL = "http://127.0.0.1:8000"  # where the README says the server listens


def code_blocks(text: str) -> list[tuple[str, str]]:
    """(language, code) of each fenced block, in order."""
    return re.findall(r"```(\w*)\n(.*?)```", text, re.S)


def readme_block(language: str, marker: str) -> str:
    return next(code for lang, code in code_blocks(README) if lang == language and marker in code)


def test_the_two_setup_commands_come_first_and_ci_runs_them():
    (lang1, start), (lang2, test) = code_blocks(README)[:2]
    assert lang1 == lang2 == "bash"
    installs, serve = start.strip().rsplit(" && ", 1)
    assert serve == "python -m jkv.server"
    ci = (ROOT / ".ci" / "run").read_text()
    for install in installs.split(" && "):  # CI's first stage installs what it does, alone
        assert install.replace("pip install", "pip install -q") in ci
    assert ".[dev]" in test and "pytest" in test
    assert test.strip() in ci  # the second stage runs the test command as it is written


def test_the_option_tables_are_the_generated_ones():
    assert tables() in README, (
        "the README's option tables differ from the flags: run "
        "`python -m jkv.server.option_table --write README.md`")
    assert replace_tables(README) == README


def table_rows(header: str) -> dict[str, list[str]]:
    """A generated table's rows by flag: [default, what]."""
    text = tables()
    lines = text[text.index(header):].split("\n\n")[0].splitlines()[2:]
    rows = [line.split(" | ") for line in lines]
    return {flag.strip("`"): cells for flag, *cells in rows}


def test_every_option_has_a_row_with_its_own_default():
    rows = table_rows(OPTION_HEADER)
    assert list(rows) == [o.flag for o in OPTIONS]
    for o in OPTIONS:
        default, what = (cell.replace("`", "") for cell in rows[o.flag])
        help_text = flag_names(o.help)  # as the table names other options
        assert what and help_text.startswith(what), o.name
        stated = re.search(r"default: (.*)", help_text, re.I)
        if stated:  # the help's own words
            assert default and stated[1].startswith(default), o.name
        elif isinstance(o.default, bool) or o.default is None:
            assert default == {True: "on", False: "off", None: "none"}[o.default], o.name
        else:  # the value itself, as the flag would take it
            value = (parse_bytes(default, o.name) if o.name.endswith("_bytes")
                     else o.value_type(default))
            assert value == o.default, o.name
    server = table_rows(SERVER_HEADER)
    assert {"--host", "--port", "--api-key", "--log-level"} <= set(server)
    assert server["--port"][0] == "`8000`" and not set(server) & set(rows)


def test_replace_tables_rewrites_only_the_tables():
    stale = "intro\n\n" + tables().replace("`8000`", "`9000`") + "\n## after\n"
    assert replace_tables(stale) == "intro\n\n" + tables() + "\n## after\n"
    with pytest.raises(ValueError, match="no option tables"):
        replace_tables("no tables here")


def test_the_readme_links_the_architecture_document_and_the_dashboard():
    for target in ("docs/architecture.md", "examples/grafana/jkv-dashboard.json"):
        assert f"]({target})" in README
        assert (ROOT / target).is_file()
    assert "](docs/results.md)" in README


@pytest.fixture(scope="module")
def srv():
    from test_server import serving  # a real server on a free port

    with serving(jkv.LLM(max_model_len=1024, max_num_seqs=2)) as s:
        yield s


@pytest.mark.smollm2
def test_the_client_example_gets_a_whole_answer(srv, capsys):
    example = readme_block("python", "OpenAI(")
    assert f'base_url="{SERVER_URL}/v1"' in example
    namespace: dict = {}
    exec(compile(example.replace(SERVER_URL, srv.base), "README.md", "exec"), namespace)
    choice = namespace["reply"].choices[0]
    assert choice.finish_reason == "stop"  # max_tokens does not cut the answer
    assert choice.message.content and capsys.readouterr().out == choice.message.content + "\n"


@pytest.mark.smollm2
def test_the_curl_example_gets_a_whole_answer(srv):
    if shutil.which("curl") is None:
        pytest.skip("no curl here")
    command = readme_block("bash", "curl ")
    assert SERVER_URL in command
    out = subprocess.run(["bash", "-c", command.replace(SERVER_URL, srv.base)],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    choice = json.loads(out)["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"]


@pytest.mark.smollm2
def test_the_library_example_runs(monkeypatch, capsys):
    # the example as written, on a smaller context than the model's 8192 (faster to compile)
    monkeypatch.setattr(jkv, "LLM", functools.partial(jkv.LLM, max_model_len=512,
                                                       max_num_seqs=2))
    namespace: dict = {}
    exec(compile(readme_block("python", "from jkv import"), "README.md", "exec"), namespace)
    assert namespace["reply"].finish_reason == "stop"
    assert namespace["outs"][0].text in capsys.readouterr().out


@pytest.mark.smollm2
def test_the_research_example_in_the_architecture_document_runs():
    text = (ROOT / "docs" / "architecture.md").read_text()
    example = next(code for lang, code in code_blocks(text) if "forward(" in code)
    namespace: dict = {}
    exec(compile(example, "docs/architecture.md", "exec"), namespace)
    assert int(namespace["logits"].argmax()) == 7042
