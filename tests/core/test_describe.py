"""`alignflow plugins` on an 80-column terminal, and the Markdown tables the docs are generated from."""

from pydantic import Field

from alignflow.core.contracts import PluginConfig
from alignflow.core.describe import model_table, plugin_fields_table
from alignflow.flows.cli import main


def test_plugins_prints_one_line_per_plugin_in_80_columns(monkeypatch, capsys):
    from alignflow.core.plugins import get_plugins

    monkeypatch.setenv("COLUMNS", "80")
    assert main(["plugins"]) == 0
    lines = capsys.readouterr().out.splitlines()
    entries = get_plugins().entries()
    assert len(lines) == 1 + len(entries)  # a header, then one line per plugin: nothing wrapped
    assert all(len(line) <= 80 for line in lines), max(lines, key=len)
    assert lines[0].split() == ["kind", "name", "distribution", "description"]
    grpo = next(line for line in lines if line.split()[:2] == ["algorithm", "grpo"])
    assert "alignflow" in grpo and grpo.split()[4].startswith("GRPO")


class Demo:
    class Config(PluginConfig):
        beta: float = Field(0.1, gt=0)  # the KL coefficient
        names: list[str] = Field(default_factory=lambda: ["a"], description="what to | match")


def test_model_table_lists_type_bounds_default_and_description():
    rows = model_table(Demo.Config).splitlines()
    assert rows[2] == "| `beta` | `float (> 0)` | `0.1` | the KL coefficient |"
    assert rows[3] == '| `names` | `list[str]` | `["a"]` | what to \\| match |'
    assert plugin_fields_table(lambda prompts, completions: []) == "No config fields."


def test_a_type_with_a_pipe_stays_code_in_a_table():
    class Config(PluginConfig):
        alpha: float | None = None

    assert model_table(Config).splitlines()[2] == "| `alpha` | <code>float &#124; None</code> | `null` |  |"
