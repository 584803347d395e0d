"""Everything checkable before compute is reported at once, by `validate` and by `run` before Prefect starts."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from alignflow.core import hookimpl
from alignflow.core.environments import Environment
from alignflow.core.errors import SpecError
from alignflow.flows.preflight import check_pipeline
from helpers.plugins import registered

ALIGNFLOW = str(Path(sys.executable).parent / "alignflow")

PIPELINE = """
name: checks
stages:
  sft:
    kind: sft
    inputs: {model: ./base, dataset: sft.jsonl}
    algorithm: sft
  rl:
    kind: rl
    inputs: {model: "stage:sft", dataset: rl.jsonl}
    algorithm: grpo
    rewards: [math_accuracy]
  sample:
    kind: rejection_sampling
    inputs: {model: models/my-sft, dataset: rl.jsonl}
    rewards: [math_accuracy]
"""


@pytest.fixture
def project(tmp_path):
    (tmp_path / "base").mkdir()
    (tmp_path / "models").mkdir()  # so `models/my-sft` is a missing local folder, not a hub id
    (tmp_path / "sft.jsonl").write_text('{"prompt": "a", "completion": "b"}\n')
    rows = ['{"prompt": "1+1", "answer": "2"}', '{"prompt": "2+2"}', "not json", '{"prompt": 3, "answer": "x"}']
    (tmp_path / "rl.jsonl").write_text("\n".join(rows) + "\n")
    (tmp_path / "p.yaml").write_text(PIPELINE)
    return tmp_path


def problems(project, *sets) -> str:
    with pytest.raises(SpecError) as info:
        check_pipeline(project / "p.yaml", list(sets), project)
    return str(info.value)


def test_inputs_and_every_bad_row_are_listed_together(project):
    msg = problems(project)
    assert "4 problems found before any compute" in msg
    assert "stage 'sample', inputs.model: input 'models/my-sft': no such file or folder" in msg
    rl = project / "rl.jsonl"
    assert f"{rl}:2: field 'answer': missing" in msg
    assert f"{rl}:3: invalid JSON" in msg
    assert f"{rl}:4: field 'prompt': expected str, got int" in msg


def test_bad_lines_are_capped_per_file(project):
    (project / "rl.jsonl").write_text("x\n" * 25)
    msg = problems(project, "sample.inputs.model=./base")
    assert msg.count("invalid JSON") == 10 and "15 more bad lines" in msg


def test_settings_ranges_of_every_stage_at_once(project):
    msg = problems(project, "sft.settings.lr=0", "rl.settings.max_steps=-5",
                   "sample.settings.n=0")
    assert "7 problems found before any compute" in msg  # the three settings and the four input problems
    assert "stage 'sft', settings.lr: 0 would train nothing" in msg
    assert "stage 'rl', settings.max_steps: Input should be greater than or equal to 1" in msg
    assert "stage 'sample', settings.n" in msg
    assert "micro_batch_size=32" in problems(project, "sft.settings.batch_size=30",
                                             "sft.settings.micro_batch_size=32")
    assert "must divide the rollout, prompts_per_step x group_size = 128" in problems(
        project, "rl.settings.batch_size=30")
    assert "settings.lr: Input should be greater than or equal to 0" in problems(project, "sft.settings.lr=-2e-3")
    assert "must be a multiple of group_size=8 (each optimizer step takes whole groups)" in problems(
        project, "rl.settings.batch_size=4")


@pytest.mark.system
def test_spec_problems_are_shown_before_plugin_code_or_torch_loads(project):
    # In a fresh process: the first pass must not import torch (3+ s on a loaded machine), and the
    # plugin pass still runs after it, so a bad plugin config is reported in the same run.
    script = """
import sys
from pathlib import Path
from alignflow.core.errors import SpecError
from alignflow.flows.preflight import check_pipeline
early = []
try:
    check_pipeline(Path("p.yaml"), ["sft.settings.lr=0", "rl.algorithm.config.clip_low=7"], Path("."),
                   early=lambda p: early.append(("torch" in sys.modules, p)))
except SpecError as exc:
    print("ERROR", str(exc).replace(chr(10), " | "))
print("EARLY", early)
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=project, capture_output=True, text=True)
    early = done.stdout.split("EARLY", 1)[1]
    assert early.startswith(" [(False, [") and "settings.lr: 0 would train nothing" in early
    assert "models/my-sft" in early and "rl.jsonl:3: invalid JSON" in early  # inputs and rows: first pass
    error = done.stdout.split("ERROR", 1)[1].split("EARLY")[0]
    assert "6 problems found before any compute; 1 more" in error  # only the plugin's is repeated below
    assert "stage 'rl', algorithm.config.clip_low" in error and "would train nothing" not in error


def test_a_plugin_problem_and_a_settings_problem_are_reported_together(project):
    msg = problems(project, "sft.settings.lr=0", "rl.algorithm.config.clip_low=7", "sample.inputs.model=./base")
    assert "5 problems found before any compute" in msg
    assert "settings.lr: 0 would train nothing" in msg and "algorithm.config.clip_low" in msg


def test_a_hub_id_is_recognised_by_its_form(project):
    from alignflow.flows.digest import resolve_input

    assert resolve_input("Qwen/Qwen2.5-0.5B", project) == "Qwen/Qwen2.5-0.5B"
    assert resolve_input("gpt2", project) == "gpt2"
    for local in ["models/my-sft", "a/b/c", "./x", "data.jsonl", "bad name"]:
        with pytest.raises(SpecError, match="no such file or folder"):
            resolve_input(local, project)


@pytest.mark.system
def test_the_cli_reports_yaml_and_input_errors_before_prefect_starts(project):
    (project / "broken.yaml").write_text("name: x\nstages:\n  a: [\n")
    done = subprocess.run([ALIGNFLOW, "run", "broken.yaml"], cwd=project, capture_output=True, text=True)
    assert done.returncode == 1 and "broken.yaml:4:1: not valid YAML" in done.stderr + done.stdout
    assert "Traceback" not in done.stderr
    start = time.monotonic()
    done = subprocess.run([ALIGNFLOW, "run", "p.yaml"], cwd=project, capture_output=True, text=True)
    out = done.stdout + done.stderr
    assert done.returncode == 1 and "4 problems in the spec, its settings and inputs" in " ".join(out.split())
    assert "4 problems found before any compute (listed above)" in " ".join(out.split())
    assert "prefect" not in out.lower() and not (project / "mlflow.db").exists()  # nothing started
    print(f"four input problems reported in {time.monotonic() - start:.1f} s")
    valid = subprocess.run([ALIGNFLOW, "validate", "p.yaml"], cwd=project, capture_output=True, text=True)
    assert valid.returncode == 1 and "invalid JSON" in valid.stdout + valid.stderr


def test_a_valid_pipeline_passes(project):
    (project / "rl.jsonl").write_text(json.dumps({"prompt": "1+1", "answer": "2"}) + "\n")
    spec = check_pipeline(project / "p.yaml", ["sample.inputs.model=./base"], project)
    assert set(spec.stages) == {"sft", "rl", "sample"}


def test_bundled_datasets_that_a_run_writes_are_not_missing(tmp_path):
    (tmp_path / "p.yaml").write_text(PIPELINE.replace("sft.jsonl", "data/sft.jsonl").replace("rl.jsonl", "data/rl.jsonl")
                                     .replace("models/my-sft", "builtin:tiny").replace("./base", "builtin:tiny"))
    check_pipeline(tmp_path / "p.yaml", [], tmp_path)  # validate: taken as present, nothing written
    assert not (tmp_path / "data").exists()
    check_pipeline(tmp_path / "p.yaml", [], tmp_path, regenerate=True)  # run: written first, then checked
    assert (tmp_path / "data" / "sft.jsonl").is_file() and (tmp_path / "data" / "rl.jsonl").is_file()
    (tmp_path / "p.yaml").write_text(PIPELINE.replace("sft.jsonl", "data/mine.jsonl").replace("./base", "builtin:tiny"))
    with pytest.raises(SpecError, match="data/mine.jsonl"):  # not one of the bundled files: missing
        check_pipeline(tmp_path / "p.yaml", [], tmp_path)


def test_a_self_play_sampling_stage_reads_sft_rows(project):
    """`output: self_play` pairs the data's completion with a sample: its dataset holds prompt/completion rows."""
    (project / "ok.jsonl").write_text('{"prompt": "1+1", "answer": "2"}\n')
    sets = ["sample.inputs.model=./base", "sample.settings.output=self_play", "rl.inputs.dataset=ok.jsonl"]
    assert f"{project / 'ok.jsonl'}:1: field 'completion': missing" in problems(
        project, *sets, "sample.inputs.dataset=ok.jsonl")
    check_pipeline(project / "p.yaml", [*sets, "sample.inputs.dataset=sft.jsonl"], project)  # no error


def test_a_run_reads_and_checks_its_spec_once(project, monkeypatch):
    """The run plans the spec its check returned: the YAML read once, no stage's settings or plugin configs
    validated again, each plan holding the stage as the check resolved it."""
    from alignflow.core.plugins import get_plugins
    from alignflow.core.spec import schema, stage
    from alignflow.flows import preflight
    from alignflow.flows.plan import plan_pipeline

    (project / "rl.jsonl").write_text(json.dumps({"prompt": "1+1", "answer": "2"}) + "\n")
    reads = []
    monkeypatch.setattr(preflight, "read_yaml", lambda path, read=preflight.read_yaml: reads.append(path) or read(path))
    checked = check_pipeline(project / "p.yaml", ["sample.inputs.model=./base"], project, regenerate=True)
    assert checked.raw["stages"]["sample"]["inputs"]["model"] == "./base"
    assert checked.stages["rl"].settings.group_size == 8 and checked.stages["rl"].algorithm.name == "grpo"
    for module in (schema, stage):
        monkeypatch.setattr(module, "validate_model", lambda *args: pytest.fail("validated again"))
    plans = plan_pipeline(checked.spec, project, get_plugins(), resolved=checked.stages)
    assert all(plans[name].resolved is checked.stages[name] for name in plans) and len(reads) == 1


EPISODES = """
name: episodes
stages:
  rl:
    kind: rl
    inputs: {model: ./base, dataset: prompts.jsonl}
    algorithm: grpo
    environment: {name: guessing}
    rewards: [format]
  test:
    kind: evaluate
    inputs: {model: "stage:rl", dataset: prompts.jsonl}
    environment: {name: guessing, max_turns: 3}
"""


class Guessing:
    """A game whose `reset` needs no answer: the default one, the row's prompt."""

    @staticmethod
    @hookimpl
    def register_environments(register):
        register("guessing", Environment)


def test_a_stage_with_an_environment_needs_answer_only_where_it_is_read(project):
    """Rows of prompts alone serve episodes; a listed reward that takes `answer`, or an algorithm that shows it
    (guided samples), still needs it, and its absence is reported with the other problems."""
    prompts = project / "prompts.jsonl"
    prompts.write_text('{"prompt": "guess", "level": 2}\n')
    (project / "p.yaml").write_text(EPISODES)
    with registered(Guessing, "guessing") as plugins:
        check_pipeline(project / "p.yaml", [], project, plugins)  # no answer, and nothing reads one
        for stage, sets in (("test", ["test.rewards=[math_accuracy]"]), ("rl", ["rl.algorithm=expo"])):
            with pytest.raises(SpecError, match=rf"(?s)1 problem .*stage '{stage}', inputs.dataset: {prompts}:1: "
                                                "field 'answer': missing"):
                check_pipeline(project / "p.yaml", sets, project, plugins)
