"""`alignflow plugins`, `validate` and `--version`, run as a user runs them: `--version` through the installed
script, the rest through the script's own function (flows/cli.py `main`) in this process."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from alignflow.flows import cli

ALIGNFLOW = str(Path(sys.executable).parent / "alignflow")

PIPELINE = """
name: tiny
stages:
  sft:
    kind: sft
    inputs: {model: ./base, dataset: data/sft.jsonl}
    algorithm: sft
  dpo:
    kind: preference
    inputs: {model: "stage:sft", dataset: data/pairs.jsonl}
    algorithm: {name: dpo, config: {beta: 0.1}}
"""


@pytest.fixture
def alignflow(monkeypatch, capsys):
    """`alignflow ARGS` -> its exit code, stdout and stderr, as `main` gives them to the script. In this
    process: a subprocess spent about 4 s of CPU importing torch and the plugins for each command."""
    monkeypatch.delenv("ALIGNFLOW_PLUGINS", raising=False)
    monkeypatch.setattr(cli, "configure_logging", lambda: None)  # its handler would keep capsys's stream
    before = set(os.environ)

    def run(*args):
        try:
            code = cli.main(list(args))
        except SystemExit as exc:  # argparse's usage errors
            code = exc.code
        out = capsys.readouterr()
        return subprocess.CompletedProcess(["alignflow", *args], code, out.out, out.err)

    yield run
    for var in set(os.environ) - before:  # the defaults `main` sets for the processes it starts
        del os.environ[var]


@pytest.fixture
def pipeline(tmp_path):
    def write(text):
        path = tmp_path / "p.yaml"
        path.write_text(text)
        return str(path)
    return write


@pytest.mark.system
def test_version():
    out = subprocess.run([ALIGNFLOW, "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("alignflow 0.")


def test_plugins_json_lists_every_builtin_with_exact_keys(alignflow):
    out = alignflow("plugins", "--json")
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    assert all(list(r) == ["kind", "name", "distribution", "version", "description", "stage", "entry_point",
                           "config_schema"] for r in rows)
    by_name = {(r["kind"], r["name"]): r for r in rows}
    assert by_name[("algorithm", "dpo")]["stage"] == "preference" and by_name[("reward", "format")]["stage"] is None
    assert by_name[("algorithm", "dpo")]["config_schema"]["properties"]["beta"]["exclusiveMinimum"] == 0.0
    names = {(r["kind"], r["name"]) for r in rows if r["distribution"] == "alignflow"}
    algorithms = {"sft", "bradley_terry", "dpo", "ipo", "kto", "orpo", "simpo", "spin", "bnf", "implicit_prm",
                  "grpo", "dapo", "dr_grpo", "lambda_grpo", "reinforce_pp", "rloo", "disco", "ppo",
                      "ngrpo", "gspo", "gmpo", "cispo", "sapo", "kimi", "offpolicy_grpo", "distill", "rto",
                      "expo"}
    rewards = {"math_accuracy", "format", "overlong", "length", "length_penalty", "code_exec", "reward_model",
               "judge", "implicit_prm"}
    assert {("algorithm", a) for a in algorithms} <= names
    assert {("reward", r) for r in rewards} <= names
    assert ("sampler", "hf") in names


def test_plugins_kind_lists_that_kind_alone(alignflow):
    rows = json.loads(alignflow("plugins", "--kind", "environment", "--json").stdout)
    assert {r["kind"] for r in rows} == {"environment"}
    assert {"math_tools", "openai_agent", "openenv", "textarena"} <= {r["name"] for r in rows}
    table = alignflow("plugins", "--kind", "environment").stdout
    assert "math_tools" in table and "grpo" not in table and "math_accuracy" not in table


def test_plugins_show_gives_each_config_field_with_type_default_and_description(alignflow):
    out = alignflow("plugins", "show", "grpo", "--json")
    assert out.returncode == 0, out.stderr
    shown = json.loads(out.stdout)
    assert (shown["kind"], shown["stage"], shown["entry_point"]) == ("algorithm", "rl", "grpo")
    fields = {f["name"]: f for f in shown["fields"]}
    assert fields["kl_loss_coef"]["default"] == 0.04 and fields["clip_low"]["type"] == "float (>= 0.0, < 1.0)"
    assert fields["dual_clip"]["description"] == "c of dual-clip PPO; None disables"  # the field's comment
    prm = {f["name"]: f["default"] for f in json.loads(alignflow("plugins", "show", "prm", "--json").stdout)["fields"]}
    assert (prm["path"], prm["aggregation"], prm["batch_size"]) == ("required", "min", 8)  # beside a required field
    table = alignflow("plugins", "show", "code_exec")
    assert table.returncode == 0 and "samples run at once" in table.stdout and "isolation" in table.stdout
    missing = alignflow("plugins", "show", "grpoo")
    assert missing.returncode == 1 and "no plugin named 'grpoo'" in missing.stderr


def test_run_refuses_a_bad_process_count_before_any_work(pipeline, alignflow):
    done = alignflow("run", pipeline(PIPELINE), "--nproc", "0")
    assert done.returncode == 2 and "--nproc='0': expected a whole number of processes" in done.stderr


def test_validate_prints_the_dag(pipeline, tmp_path, monkeypatch, alignflow):
    (tmp_path / "base").mkdir()
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "sft.jsonl").write_text('{"prompt": "a", "completion": "b"}\n')
    (tmp_path / "data" / "pairs.jsonl").write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n')
    monkeypatch.chdir(tmp_path)  # inputs are the project's, and the project is where alignflow runs
    out = alignflow("validate", pipeline(PIPELINE))
    assert out.returncode == 0, out.stderr
    assert out.stdout.index("sft") < out.stdout.index("dpo") and "model <- stage:sft" in out.stdout


def test_validate_cycle(pipeline, alignflow):
    out = alignflow("validate", pipeline(PIPELINE.replace("model: ./base", 'model: "stage:dpo"')))
    assert out.returncode == 1
    assert "p.yaml: the stages form a cycle:" in out.stderr and "sft" in out.stderr and "dpo" in out.stderr


def test_validate_dangling_reference(pipeline, alignflow):
    out = alignflow("validate", pipeline(PIPELINE.replace('"stage:sft"', '"stage:sfd"')))
    assert out.returncode == 1
    assert "stage 'dpo', inputs.model: refers to stage 'sfd', which does not exist" in out.stderr


def test_validate_bad_config_field(pipeline, alignflow):
    out = alignflow("validate", pipeline(PIPELINE.replace("beta: 0.1", "beta: -3")))
    assert out.returncode == 1
    assert "stage 'dpo', algorithm.config.beta: Input should be greater than 0" in out.stderr


def test_validate_unknown_algorithm_suggests(pipeline, alignflow):
    out = alignflow("validate", pipeline(PIPELINE.replace("name: dpo", "name: dpo2")))
    assert out.returncode == 1
    assert "unknown algorithm 'dpo2'; did you mean 'dpo'?" in out.stderr


def test_validate_reports_every_plugin_problem_of_every_stage_at_once(pipeline, tmp_path, monkeypatch,
                                                                      alignflow):
    (tmp_path / "base").mkdir()
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "sft.jsonl").write_text('{"prompt": "a", "completion": "b"}\n')
    (tmp_path / "data" / "pairs.jsonl").write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n')
    monkeypatch.chdir(tmp_path)
    text = PIPELINE.replace("algorithm: sft", "algorithm: sfd\n    rewards: [acuracy]\n"
                                              "    sampler: {name: hf, config: {nope: 1}}")
    out = alignflow("validate", pipeline(text.replace("beta: 0.1", "beta: -3")))
    assert out.returncode == 1
    err = " ".join(out.stderr.split())  # rich wraps long lines
    assert "4 problems found" in err, err
    for problem in ("stage 'sft', algorithm.name: unknown algorithm 'sfd'", "stage 'sft', rewards[0].name: unknown "
                    "reward 'acuracy'", "stage 'sft', sampler.config.nope: Extra inputs are not permitted",
                    "stage 'dpo', algorithm.config.beta: Input should be greater than 0"):
        assert problem in err, problem


def test_progress_lines_reach_stderr_off_a_terminal(capfd):
    """Off a terminal the CLI's logging shows the progress lines a bar would show."""
    import io

    from alignflow.core.progress import progress
    from alignflow.flows.cli import configure_logging

    configure_logging()
    with progress("demo", total=2, stream=io.StringIO()) as bar:
        bar.update(loss=1.5)
        bar.update(loss=1.25)
    err = capfd.readouterr().err
    assert "alignflow.progress" in err and "demo 2/2" in err and "loss=1.25" in err


SHIPPED = sorted((Path(__file__).resolve().parents[2] / "pipelines").glob("*.yaml"))


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_every_shipped_pipeline_validates_with_its_settings_and_plugin_configs(path):
    from alignflow.core.plugins import get_plugins
    from alignflow.core.spec.schema import load_spec, resolved_stages
    from alignflow.flows.digest import stage_config

    spec = load_spec(path)
    resolved = resolved_stages(spec, get_plugins())
    for name in spec.order():
        config = stage_config(spec.stages[name], resolved[name])
        assert config["kind"] == spec.stages[name].kind


def test_the_shipped_pipelines_are_found():
    # An empty glob would parametrize the test above into nothing, and pass.
    assert {"r1-tiny.yaml", "r1-full.yaml", "rm-tiny.yaml"} <= {p.name for p in SHIPPED}
