"""openai_agent: agent programs (a command per episode, or a function) written against the `openai` SDK drive
episodes through the policy endpoint; their result is the reward; a failing, silent or hanging program ends its
own episode only, and leaves no process behind."""

import os
import sys
import textwrap
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

from alignflow.core.environments.episodes import Episodes, episode_metrics
from alignflow.core.spec.settings import GenerationSettings
from alignflow.plugins.hf import HFSampler
from alignflow.plugins.openai_agent import OpenAIAgent

sys.path.insert(0, str(Path(__file__).parents[1] / "core" / "environments"))
from test_policy_endpoint import policy  # noqa: E402

pytestmark = pytest.mark.system  # agent programs run as processes, the endpoint as a server
EXAMPLE = Path(__file__).parents[2] / "examples" / "agents" / "arithmetic_retry.py"
GEN = GenerationSettings(max_new_tokens=12, temperature=1.0)

# the reward is a function of what the program was answered: the trainer's row must hold that very answer
LENGTH_AGENT = """
import json, os
from openai import OpenAI
row = json.loads(os.environ["ALIGNFLOW_ROW"])
with OpenAI(max_retries=0) as client:
    r = client.chat.completions.create(model=os.environ["OPENAI_MODEL"], messages=[{"role": "user", "content": row["prompt"]}])
print("thinking...")
print(json.dumps({"reward": len(r.choices[0].message.content), "seed": os.environ["ALIGNFLOW_SEED"]}))
"""


@pytest.fixture(scope="module")
def tiny():
    model, tok = policy()
    sampler = HFSampler(HFSampler.Config())
    sampler.load(model, tok)
    return tok, sampler


def run(tok, sampler, rows, max_turns=2, **config):
    spec = Episodes(OpenAIAgent, OpenAIAgent.Config(**config), max_turns=max_turns, max_tokens=200,
                    name="openai_agent")
    return spec.generate(sampler, tok, rows, 1, GEN, seed=0)


def test_a_command_per_episode_reports_the_reward_of_what_it_was_answered(tiny, tmp_path):
    tok, sampler = tiny
    script = tmp_path / "agent.py"
    script.write_text(LENGTH_AGENT)
    g = run(tok, sampler, [{"prompt": "1+1="}, {"prompt": "2+2="}], command=[sys.executable, str(script)])
    assert g.episodes["ended"] == ["done", "done"]
    for i in range(2):
        assert g.episodes["reward"][i] == len(g.texts[i])
        assert g.episodes["info"][i] == {"seed": g.episodes["info"][i]["seed"]}  # the result's other keys
        assert g.prompt_ids[i] == tok(["1+1=", "2+2="][i], add_special_tokens=False).input_ids


def test_the_example_agent_runs_two_turns_as_a_command_and_as_a_function(tiny):
    tok, sampler = tiny
    rows = [{"prompt": "12+34=", "answer": "46"}]
    for config in ({"command": [sys.executable, str(EXAMPLE)]}, {"function": f"{EXAMPLE}:agent"}):
        g = run(tok, sampler, rows, **config)
        assert g.episodes["ended"] == ["done"] and g.episodes["turns"] == [2], config  # a random policy is wrong
        assert g.episodes["reward"] == [0.0]
        assert episode_metrics(g.episodes)["episode/info/turns"] == 2.0  # the agent's own count, logged
        hint = [t for t, m in zip(g.completion_ids[0], g.loss_mask[0]) if not m]
        assert tok.decode(hint) == "\nno. again:\n"  # the agent's second message, merged into one sample


def test_failing_silent_and_hanging_programs_end_their_own_episode(tiny, tmp_path):
    tok, sampler = tiny
    pids = tmp_path / "pids"
    script = tmp_path / "agent.py"
    script.write_text(textwrap.dedent(f"""
        import json, os, sys, time
        row = json.loads(sys.stdin.read())
        open({str(pids)!r}, "a").write(f"{{os.getpid()}}\\n")
        if row["prompt"] == "fail":
            sys.exit("no luck")
        if row["prompt"] == "hang":
            time.sleep(300)
        if row["prompt"] == "silent":
            sys.exit(0)
        print(json.dumps({{"reward": 2.5}}))
    """))
    start = time.perf_counter()
    rows = [{"prompt": p} for p in ("fail", "hang", "silent", "ok")]
    g = run(tok, sampler, rows, command=[sys.executable, str(script)], timeout_s=3.0)
    assert time.perf_counter() - start < 60
    assert g.episodes["ended"] == ["error", "timeout", "error", "done"]
    assert g.episodes["reward"] == [0.0, 0.0, 0.0, 2.5]
    for pid in map(int, pids.read_text().split()):  # the hanging program was killed with its episode
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_config_names_one_program_and_hashes_its_source(tmp_path):
    with pytest.raises(ValidationError, match="exactly one of"):
        OpenAIAgent.Config()
    with pytest.raises(ValidationError, match="module:function"):
        OpenAIAgent.Config(function="agent.py")
    script = tmp_path / "a.py"
    script.write_text("def agent(client, row, seed):\n    return 1.0\n")
    before = OpenAIAgent.Config(function=f"{script}:agent").model_dump()["sources"]
    script.write_text("def agent(client, row, seed):\n    return 2.0\n")
    after = OpenAIAgent.Config(function=f"{script}:agent").model_dump()["sources"]
    assert list(before) == [str(script)] and before != after  # an edit to the agent reruns its stages


class Failing(HFSampler):
    """The hf sampler, failing at its second call."""

    def generate(self, prompt_ids, n, gen, seed):
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls == 2:
            raise RuntimeError("the sampler broke")
        return super().generate(prompt_ids, n, gen, seed)


def test_a_failing_sampler_fails_the_batch_and_stops_every_agent_program(tmp_path):
    model, tok = policy()
    sampler = Failing(HFSampler.Config())
    sampler.load(model, tok)
    pids = tmp_path / "pids"
    script = tmp_path / "agent.py"
    script.write_text(textwrap.dedent(f"""
        import json, os, time
        from openai import OpenAI
        open({str(pids)!r}, "a").write(f"{{os.getpid()}}\\n")
        row = json.loads(os.environ["ALIGNFLOW_ROW"])
        with OpenAI(max_retries=0) as client:
            if row["prompt"] == "slow":
                time.sleep(2)  # its call comes after the first batch: the one that fails
            client.chat.completions.create(model="m", messages=[{{"role": "user", "content": "1"}}])
            time.sleep(300)  # a program that would outlive the stage unless it is stopped
    """))
    start = time.perf_counter()
    with pytest.raises(RuntimeError, match="the sampler broke"):
        run(tok, sampler, [{"prompt": "fast"}, {"prompt": "slow"}], command=[sys.executable, str(script)],
            batch_wait_s=0.0)
    assert time.perf_counter() - start < 60
    for pid in map(int, pids.read_text().split()):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
