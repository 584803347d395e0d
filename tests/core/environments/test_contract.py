"""The environment contract's edges, on a scripted sampler: the stage's limits seen by the environment, an ending
the environment gives, success apart from a shaped reward (the guide's own example), what `reset` and `step` may
return, and a batch whose every episode fails."""

import json
import re
import sys
import types
from pathlib import Path

import pytest

from alignflow.core.environments import Environment, EpisodeError, Step
from alignflow.core.environments.contract import Limits
from alignflow.core.environments.episodes import Episodes, episode_metrics
from alignflow.core.rewards import Reward, RewardSet
from alignflow.flows.stages.evaluate import write_samples
from alignflow.flows.stages.scoring import accuracy_metrics, episode_reward, generate_and_score
from tests.core.environments.test_episodes import GEN, ROWS, TOK, Scripted

GUIDE = Path(__file__).resolve().parents[3] / "docs" / "guides" / "environments.md"


class Capped(Environment):
    """Ends each episode at its own cap, one turn before the stage's, from the limits it was given; its `reset`
    has the old signature."""

    seen: list = []

    def reset(self, row, seed):
        Capped.seen.append(self.limits)
        return row["prompt"]

    def step(self, turn):
        if turn.index + 2 == self.limits.max_turns:
            return Step(done=True, info={"ended": "max_turns"})
        return Step("go on")


@pytest.mark.parametrize("max_tokens, budget", [(200, 200), (None, 4 * GEN.max_new_tokens)])
def test_the_environment_sees_the_stages_limits_and_an_ending_it_gives_is_counted(max_tokens, budget):
    Capped.seen.clear()
    g = Episodes(Capped, None, max_turns=4, max_tokens=max_tokens).generate(
        Scripted(lambda context, turn: "x"), TOK, ROWS, 1, GEN, seed=0)
    assert Capped.seen == [Limits(max_turns=4, max_tokens=budget)] * 2
    assert g.episodes["turns"] == [3, 3] and g.episodes["ended"] == ["max_turns"] * 2 and g.truncated == [True] * 2
    metrics = episode_metrics(g.episodes)
    assert metrics["episode/ended_max_turns"] == 1.0 and metrics["episode/ended_done"] == 0.0


def guide_example(monkeypatch):
    """The `Guess` environment of the guide's worked example, run from the guide's own block."""
    block = re.search(r"^## A worked example$.*?^```python\n(.*?)^```$", GUIDE.read_text(), re.S | re.M)[1]
    module = types.ModuleType("guide_guess")
    monkeypatch.setitem(sys.modules, module.__name__, module)  # pydantic resolves the Config through it
    exec(compile(block, f"{GUIDE}:worked example", "exec"), module.__dict__)
    return module.Guess


def bisect(context, turn):
    """The bisecting player of 1..10, replaying the hints in its context."""
    low, high = 1, 10
    for hint in re.findall(r"higher|lower", context):
        guess = (low + high) // 2
        low, high = (guess + 1, high) if hint == "higher" else (low, guess - 1)
    return str((low + high) // 2)


def test_the_guides_shaped_reward_counts_the_episodes_won_as_correct(monkeypatch, tmp_path):
    """Held to 3 guesses, bisection wins on 7 of the 10 secrets, 4 of them after a wrong guess (reward 0.9 or
    0.8): accuracy is the share of episodes won, not of rewards >= 1."""
    guess = guide_example(monkeypatch)
    rows = [{"prompt": "", "level": i} for i in range(40)]  # a seed per row: the secrets vary
    rewards = RewardSet([Reward("guess", 1.0, episode_reward)])  # what a stage with `environment: guess` scores
    scored = generate_and_score(Scripted(bisect), TOK, rows, 1, GEN, 0, rewards,
                                episodes=Episodes(guess, guess.Config(), max_turns=3, name="guess"))
    g = scored.generation
    won = [e == "done" for e in g.episodes["ended"]]  # the game ends early only on a win
    assert g.episodes["success"] == [True if w else None for w in won]
    assert 0 < sum(won) < len(rows) and any(w and r < 1 for w, r in zip(won, g.episodes["reward"]))
    assert accuracy_metrics(scored)["accuracy"] == sum(won) / len(rows)
    assert scored.correct == won and sum(won) > sum(r >= 1 for r in g.episodes["reward"])

    # samples.jsonl records what each episode's model read first, not the row's (empty) prompt
    write_samples(scored, tmp_path / "samples.jsonl")
    first = json.loads((tmp_path / "samples.jsonl").read_text().splitlines()[0])
    asked = "Guess my number from 1 to 10. Answer with the number alone."
    assert first["prompt"] == asked and first["first_messages"] == [{"role": "user", "content": asked}]
    assert first["correct"] == won[0] and first["completion"] == g.texts[0]


class Gym(Environment):
    """Returns what gymnasium's `step` returns, a tuple: every episode fails."""

    def step(self, turn):
        return None, 1.0, True, {}


class Says(Environment):
    """Replies with whatever its row says: `observation` (for `step`) or `first` (for `reset`)."""

    def reset(self, row, seed):
        self.row = row
        return row.get("first", row["prompt"])

    def step(self, turn):
        return Step(observation=self.row["observation"])


def play(env, rows, n=2):
    return Episodes(env, None, name=env.__name__.lower()).generate(Scripted(lambda c, t: "x"), TOK, rows, n, GEN, 0)


def test_a_batch_whose_every_episode_fails_stops_naming_the_environment_and_the_first_failure():
    with pytest.raises(EpisodeError, match=r"^environment 'gym' failed on every episode of a batch of 4; the first: "
                                           r"environment 'gym', turn 0: step returned tuple; expected a Step$"):
        play(Gym, ROWS)
    # one episode that goes on is enough: the failing ones end as `error`, counted
    g = play(Says, [{"prompt": "a", "observation": 42}, {"prompt": "b", "observation": "fine"}], n=1)
    assert g.episodes["ended"] == ["error", "max_turns"] and g.episodes["turns"] == [1, 4]
    assert episode_metrics(g.episodes)["episode/ended_error"] == 0.5


@pytest.mark.parametrize("observation, problem", [
    (42, "got int 42; expected a string (one user message) or a list of {\"role\": str, \"content\": str} messages"),
    ({"role": "user", "content": "hi"}, "got dict {'role': 'user', 'content': 'hi'}; expected a string"),
    (["hi"], "item 0 of the list is str 'hi'; expected a {\"role\": str, \"content\": str} message"),
])
def test_a_step_observation_that_is_not_messages_names_the_method_and_what_was_expected(observation, problem):
    with pytest.raises(EpisodeError) as err:
        play(Says, [{"prompt": "a", "observation": observation}], n=1)
    assert str(err.value).startswith("environment 'says' failed on every episode of a batch of 1; the first: "
                                     "environment 'says', turn 0: step returned an observation that is not "
                                     f"messages: {problem}")


@pytest.mark.parametrize("first, problem", [
    ({"role": "user", "content": "7*8="}, "reset returned what is not a first message: got dict"),
    ([{"role": "user"}], "reset returned what is not a first message: item 0 of the list is dict"),
    ([], "reset returned no message; expected at least one"),
])
def test_a_reset_that_returns_no_messages_names_the_environment_the_row_and_what_was_expected(first, problem):
    with pytest.raises(EpisodeError, match=r"^environment 'says' failed to start an episode on row 1 \('b'\): "
                                           + re.escape(problem)):
        play(Says, [{"prompt": "a"}, {"prompt": "b", "first": first}])


def test_a_step_ending_that_is_not_one_of_the_endings_is_an_error():
    class Odd(Environment):
        def step(self, turn):
            return Step(done=True, info={"ended": "won"})

    with pytest.raises(EpisodeError, match=r"step returned info\['ended'\] = 'won'; expected one of done, max_turns"):
        play(Odd, ROWS[:1], n=1)


def test_math_tools_says_which_column_a_row_lacks():
    from alignflow.plugins.math_tools import MathTools

    with pytest.raises(EpisodeError, match=r"row 0 \('7\*8='\): KeyError: .*math_tools scores against the row's "
                                           r"`answer` column, which this row lacks"):
        Episodes(MathTools, MathTools.Config(), name="math_tools").generate(
            Scripted(lambda c, t: "x"), TOK, [{"prompt": "7*8="}], 1, GEN, seed=0)
