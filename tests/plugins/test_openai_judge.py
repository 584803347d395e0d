"""openai_judge against a real server speaking the OpenAI chat completions shape (tests/helpers/scorer.py), and
once against vLLM's own OpenAI server on the tiny model."""

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
from helpers.scorer import Scorer
from pydantic import ValidationError

from alignflow.core.plugins import get_plugins
from alignflow.core.rewards import RewardError, RewardSet
from alignflow.plugins.openai_judge import OpenAIJudge

PROMPTS = ["1+1=", "2+2=", "3+3=", "4+4="]
COMPLETIONS = ["2", "5", "6", "7"]
ANSWERS = ["2", "4", "6", "8"]
QUESTION = re.compile(r"Response: (.*)\nReference: (.*)$")


def chat(content: str) -> dict:
    """An OpenAI chat completion carrying `content`."""
    return {"id": "cmpl-1", "object": "chat.completion", "model": "judge",
            "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": content}}]}


def judging(scorer, path, body):
    """A judge that compares the response with the reference in its user message, thinking aloud first."""
    response, reference = QUESTION.search(body["messages"][-1]["content"]).groups()
    verdict = "yes" if response == reference else "no"
    return 200, chat(f"Yes, I know the answer. Comparing... the verdict: {verdict}")


def judge(base_url, **config):
    config = {"base_url": base_url, "model": "judge", "template": "Q: {prompt}\nResponse: {completion}\n"
              "Reference: {answer}", "backoff_s": 0.01, **config}
    return RewardSet.from_refs([("openai_judge", 1.0, config)], get_plugins())


@pytest.mark.system
@pytest.mark.parametrize("suffix", ["", "/v1", "/v1/"])
def test_verdicts_in_order_through_chat_completions(suffix):
    with Scorer(judging) as server:
        out = judge(server.url + suffix, system="You grade answers.", max_tokens=64)(
            PROMPTS, COMPLETIONS, answer=ANSWERS)
    assert out.values["openai_judge"] == [1.0, 0.0, 1.0, 0.0]  # the last verdict word, not "Yes, I know"
    assert {r["path"] for r in server.requests} == {"/v1/chat/completions"}
    body = next(r["body"] for r in server.requests if "2+2=" in r["body"]["messages"][-1]["content"])
    assert body == {"model": "judge", "temperature": 0, "max_tokens": 64, "messages": [
        {"role": "system", "content": "You grade answers."},
        {"role": "user", "content": "Q: 2+2=\nResponse: 5\nReference: 4"}]}
    assert out.metrics["reward/openai_judge/unparsed"] == out.metrics["reward/openai_judge/failed"] == 0


@pytest.mark.system
def test_a_numeric_score_by_regex_and_an_unparsed_reply():
    def rule(scorer, path, body):
        text = body["messages"][-1]["content"]
        return 200, chat("no score here" if "4+4" in text else f"Score: {len(text) / 10}. Final SCORE: {len(text)}")

    with Scorer(rule) as server:
        out = judge(server.url, parse=r"SCORE:\s*([-+]?\d+(?:\.\d+)?)")(PROMPTS, COMPLETIONS, answer=ANSWERS)
    lengths = [len(f"Q: {p}\nResponse: {c}\nReference: {a}") for p, c, a in zip(PROMPTS, COMPLETIONS, ANSWERS)]
    assert out.values["openai_judge"] == [float(n) for n in lengths[:3]] + [None]  # the last match counts
    assert out.metrics["reward/openai_judge/unparsed"] == 1 and out.metrics["reward/openai_judge/failed"] == 0


@pytest.mark.system
def test_failures_cost_only_their_sample_and_are_counted():
    """Sample 0 gets a 503 once (retried, scored), sample 1 a reply without choices, sample 2 hangs past the
    timeout, sample 3 is judged; no more than two requests are in flight."""
    def rule(scorer, path, body):
        text = body["messages"][-1]["content"]
        scorer.count(text)
        time.sleep(0.05)
        if "1+1" in text and scorer.attempts[text] == 1:
            return 503, {"error": "busy"}
        if "2+2" in text:
            return 200, {"error": {"message": "model overloaded"}}
        if "3+3" in text:
            return scorer.hang()
        return judging(scorer, path, body)

    with Scorer(rule) as server:
        start = time.perf_counter()
        out = judge(server.url, timeout_s=0.5, max_concurrency=2)(PROMPTS, COMPLETIONS, answer=ANSWERS)
        wall = time.perf_counter() - start
    assert out.values["openai_judge"] == [1.0, None, None, 0.0]
    m = {k.rpartition("/")[2]: v for k, v in out.metrics.items() if k.startswith("reward/openai_judge/")}
    assert {k: m[k] for k in ("failed", "malformed", "timeout", "retries", "unparsed")} == {
        "failed": 2, "malformed": 1, "timeout": 1, "retries": 1, "unparsed": 0}
    assert server.peak == 2 and len(server.requests) == 5 and wall < 3.0


def test_parse_takes_the_last_whole_verdict_word():
    j = OpenAIJudge(OpenAIJudge.Config(base_url="http://127.0.0.1:9", model="m",
                                       parse={"correct": 1.0, "incorrect": 0.0, "partly": 0.5}))
    assert j.parse("Incorrect at first; on reflection CORRECT.") == 1.0
    assert j.parse("it is partly right") == 0.5
    assert j.parse("correctness unclear, incorrectly phrased") is None  # words, not parts of words
    assert j.url == "http://127.0.0.1:9/v1/chat/completions"


def test_config_checks_template_and_parse():
    base = {"base_url": "http://127.0.0.1:9", "model": "m"}
    with pytest.raises(ValidationError, match="add \\{completion\\}"):
        OpenAIJudge.Config(**base, template="Is {prompt} hard?")
    with pytest.raises(ValidationError, match="capture group"):
        OpenAIJudge.Config(**base, parse=r"SCORE: \d+")
    with pytest.raises(ValidationError, match="not a regex"):
        OpenAIJudge.Config(**base, parse=r"SCORE: (\d+")
    with pytest.raises(ValidationError, match="NAME of an environment variable"):
        OpenAIJudge.Config(**base, api_key_env="sk-abc")


def test_a_template_column_missing_from_the_batch_stops_the_stage_named():
    rewards = judge("http://127.0.0.1:9", template="{completion} vs {reference}")
    with pytest.raises(RewardError, match="\\['reference'\\] are not columns"):
        rewards(PROMPTS, COMPLETIONS, answer=ANSWERS)


# -- vLLM's own OpenAI server on the tiny model ----------------------------------------------------------------

def _free_port() -> int:
    from alignflow.core.train.engine import free_port

    return free_port()


def _wait_ready(url: str, process: subprocess.Popen, limit_s: float) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"vLLM's server exited with {process.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(1)
    raise AssertionError(f"vLLM's server was not ready within {limit_s} s")


@pytest.mark.vllm
@pytest.mark.system
def test_through_vllm_openai_server_on_the_tiny_model(tmp_path, tiny_model):
    """The tiny model's verdicts are noise: what is checked is the plumbing. Every request reaches vLLM (its
    served-requests counter), and every sample comes back a number or None, each None counted."""
    pytest.importorskip("vllm", reason="vLLM is not installed: .ci/run runs this test in an environment that has it")
    port = _free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "auto"}  # as plugins/vllm_sampler
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_model()),
               "--served-model-name", "tiny-judge", "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
               "--enforce-eager", "--max-model-len", "256", "--seed", "0"]
    log = (tmp_path / "vllm.log").open("w")
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(url, process, limit_s=300)
        rewards = judge(url, model="tiny-judge", template="{prompt}{completion}?", max_tokens=8, timeout_s=60,
                        parse={"0": 0.0, "1": 1.0, "2": 2.0, "4": 4.0})
        out = rewards(PROMPTS, COMPLETIONS, answer=ANSWERS)
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            metrics = r.read().decode()
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        log.close()
    values = out.values["openai_judge"]
    assert len(values) == 4 and all(v is None or isinstance(v, float) for v in values)
    m = out.metrics
    assert m["reward/openai_judge/failed"] == 0, (tmp_path / "vllm.log").read_text()[-3000:]
    assert m["reward/openai_judge/none"] == m["reward/openai_judge/unparsed"] == values.count(None)
    served = re.findall(r'^vllm:request_success_total\{[^}]*\} ([\d.]+)', metrics, re.MULTILINE)
    assert sum(float(n) for n in served) == 4, served
