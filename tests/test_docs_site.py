"""The generated reference and the built site, as a newcomer reads them: no blank description, settings and
plugins split into pages with headings, every nested subcommand's flags, the API's flags and fields, the stage
DAG as Mermaid, and no table left as raw `|` text or code line hidden past the column at 1280 px."""

import contextlib
import io
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs" / "scripts"))

import check_site  # noqa: E402
import reference_pages  # noqa: E402


@pytest.fixture(scope="module")
def pages():
    return reference_pages.all_pages()


def tables(markdown: str):
    """Each Markdown table of a page as (header cells, rows of cells)."""
    lines = markdown.splitlines()
    for i, line in enumerate(lines[:-1]):
        if line.startswith("|") and re.fullmatch(r"\|(-+\|)+", lines[i + 1]):
            rows = []
            for row in lines[i + 2:]:
                if not row.startswith("|"):
                    break
                rows.append([c.strip() for c in re.split(r"(?<!\\)\|", row)[1:-1]])
            yield [c.strip() for c in line.strip("|").split("|")], rows


def test_no_blank_description_in_the_generated_reference(pages):
    """Every described table (settings, plugin configs, spec fields, API attributes) has a description in every row."""
    blank, described = [], 0
    for page, text in pages.items():
        for header, rows in tables(text):
            if "description" not in header:
                continue
            column = header.index("description")
            described += len(rows)
            blank += [f"{page}: {row[0]}" for row in rows if not row[column]]
    assert not blank, "blank descriptions:\n" + "\n".join(blank)
    assert described > 83 + 439  # every stage setting and plugin field at least


def test_every_settings_field_and_plugin_field_has_a_comment_or_description():
    """Said at the source, by name, for the one who adds a field without a comment."""
    import inspect

    from alignflow.core.describe import SETTINGS_MODELS, fields, line_comments
    from alignflow.core.plugins import get_plugins
    from alignflow.core.spec import settings

    blank = []
    for name in SETTINGS_MODELS:
        model, comments = getattr(settings, name), line_comments(getattr(settings, name))
        blank += [f"core/spec/settings.py {name}.{f}" for f in inspect.get_annotations(model)
                  if not (model.model_fields[f].description or comments.get(f))]
    for entry in (e for e in get_plugins().entries() if e.distribution == "alignflow"):  # the built-ins
        blank += [f"{entry.kind} {entry.name}: {f['name']}" for f in fields(entry.obj) if not f["description"].strip()]
    assert not blank, "fields without a trailing comment or Field(description=...):\n" + "\n".join(blank)


def test_settings_and_plugins_are_split_into_pages_with_headings(pages):
    from alignflow.core.describe import SETTINGS_MODELS
    from alignflow.core.plugins import KINDS, get_plugins

    headings = {m for page, text in pages.items() if page.startswith("settings/")
                for m in re.findall(r"^## (\w+)$", text, re.M)}
    assert headings == set(SETTINGS_MODELS)
    assert "[RLSettings](settings/training.md#rlsettings)" in pages["settings.md"]
    for kind in KINDS.values():
        page = pages[f"plugins/{reference_pages.KIND_PAGES[kind]}.md"]
        names = [e.name for e in get_plugins().entries() if e.kind == kind and e.distribution == "alignflow"]
        assert names and re.findall(r"^## `(\w+)`$", page, re.M) == names, kind
        assert all(f"[`{n}`](#{n})" in page for n in names), kind  # the table of contents links each one
    nav = (ROOT / "mkdocs.yml").read_text()
    generated = [p for p in pages if "/" in p]
    assert [p for p in generated if f"reference/{p}" not in nav] == []


def test_cli_page_holds_every_nested_subcommand_and_fits_80_columns(pages):
    cli = pages["cli.md"]
    assert "## alignflow data" in cli and "### alignflow data reasoning-gym" in cli
    section = cli.split("### alignflow data reasoning-gym\n", 1)[1].split("###", 1)[0]
    assert "--size SIZE" in section and "--exclude JSONL" in section
    assert "### alignflow data reasoning-gym-steps" in cli and "--teacher {clean,sloppy}" in cli
    assert "--mermaid" in cli.split("## alignflow validate", 1)[1]
    assert max(len(line) for line in cli.splitlines() if not line.startswith("#")) <= 80


def test_api_pages_list_flags_fields_and_the_python_api(pages):
    def table(page, title):
        return next(rows for header, rows in tables(pages[page].split(f"**{title}**", 1)[1]))

    flags = {row[0]: row for row in table("api/contracts.md", "Flags of `Algorithm`")}
    assert flags["`requires_reference`"][2] == "`False`" and "reference" in flags["`requires_reference`"][3]
    rollout = {row[0] for row in table("api/rl.md", "Fields of `Rollout`")}
    assert {"`rewards`", "`group`", "`old_logprobs`", "`sampler_logprobs`", "`turns`"} <= rollout
    batch = {row[0] for row in table("api/rl.md", "Fields of `PolicyBatch`")}
    assert {"`logprobs`", "`advantages`", "`policy_weights`"} <= batch
    assert "`applies_policy_weights`" in {row[0] for row in table("api/rl.md", "Flags of `RLAlgorithm`")}
    step = {row[0]: row for row in table("api/environments.md", "Fields of `Step`")}
    assert set(step) >= {"`observation`", "`tool_calls`", "`tool_errors`", "`info`", "`success`"}
    for name in ("Environment", "Turn", "Limits"):
        assert f"::: alignflow.core.environments.contract.{name}" in pages["api/environments.md"]
    for name in ("flows.api.run", "flows.api.validate", "flows.api.RunResult", "flows.options.RunOptions"):
        assert f"::: alignflow.{name}\n" in pages["api/python.md"]
    assert "### The `environment:` block" not in pages["pipeline.md"]
    block = pages["pipeline.md"].split("## The `environment:` block", 1)[1].split("\n## ", 1)[0]
    assert all(f"| `{f}` |" in block for f in ("max_turns", "max_tokens", "tool_format", "mcp", "weight"))


def _validate_mermaid(path: str) -> str:
    from alignflow.flows.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["validate", path, "--mermaid"]) == 0
    return out.getvalue()


def test_validate_mermaid_draws_r1_tiny_and_the_docs_show_it(monkeypatch):
    monkeypatch.chdir(ROOT)
    text = _validate_mermaid("pipelines/r1-tiny.yaml")
    lines = text.splitlines()
    assert lines[0] == "flowchart LR"
    stages = dict(re.findall(r'^  (s\d+)\["<b>(\w+)</b>', text, re.M))
    assert sorted(stages.values()) == ["cold_start", "eval_grpo", "eval_sft", "grpo"]
    ids = {name: node for node, name in stages.items()}
    edges = re.findall(r'^  (\w+) -- "(\w+)" --> (\w+)$', text, re.M)
    assert len(edges) == 8  # two inputs per stage
    assert (ids["cold_start"], "model", ids["grpo"]) in edges and (ids["grpo"], "model", ids["eval_grpo"]) in edges
    test_set = re.search(r'^  (i\d+)\(\["data/test.jsonl"\]\)$', text, re.M).group(1)  # one node, read twice
    assert {(test_set, "dataset", ids["eval_sft"]), (test_set, "dataset", ids["eval_grpo"])} <= set(edges)
    assert f'{ids["grpo"]}["<b>grpo</b><br/>rl: grpo, hf, math_accuracy"]' in text
    shown = (ROOT / "docs" / "getting-started.md").read_text()
    assert "```mermaid\n" + text + "```" in shown  # the page shows what the command prints today


def test_validate_mermaid_draws_a_loop_as_rounds(monkeypatch):
    monkeypatch.chdir(ROOT)
    text = _validate_mermaid("pipelines/iterative-dpo-tiny.yaml")
    assert re.search(r'subgraph loop_\w+\["\w+: loop of 3 rounds"\]', text)
    assert [int(r) for r in re.findall(r'subgraph loop_\w+_r(\d)\["round', text)] == [1, 2, 3]
    assert text.count("subgraph") == text.count("  end") == 4


def test_site_check_finds_raw_tables_and_wide_code():
    """The checker itself, on HTML as mkdocs-material writes it."""
    good = ('<p>|x| is small</p><div class="language-python highlight"><pre><span></span><code>'
            + "x" * 110 + '</code></pre></div><pre class="mermaid"><code>' + "y" * 300 + "</code></pre>")
    assert check_site.problems(good) == []
    raw = "<p>text\n| a | b |\n| c | d |</p>"
    assert len(check_site.problems(raw)) == 2
    wide = '<div class="language-bash highlight"><pre><code>' + "z" * 111 + "</code></pre></div>"
    assert "111 characters" in check_site.problems(wide)[0]
    text = '<div class="language-text highlight"><pre><code>' + "t" * 81 + "</code></pre></div>"
    assert "(at most 80)" in check_site.problems(text)[0]


@pytest.mark.stage
def test_the_built_site_has_no_raw_table_nor_hidden_code(tmp_path):
    """`mkdocs build --strict` in-process, then the HTML of every page: the strict build alone lets both pass."""
    from mkdocs.commands.build import build
    from mkdocs.config import load_config

    config = load_config(str(ROOT / "mkdocs.yml"), site_dir=str(tmp_path / "site"), strict=True)
    build(config)
    assert check_site.site_problems(tmp_path / "site") == {}
    assert (tmp_path / "site" / "results" / "plots" / "r1-tiny-grpo.svg").is_file()
    assert 'class="mermaid"' in (tmp_path / "site" / "concepts" / "architecture" / "index.html").read_text()
