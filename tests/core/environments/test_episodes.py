"""Multi-turn episodes on a scripted sampler: turns, replies, masks, limits, failures, concurrency."""

import asyncio
import contextlib
import threading

import pytest

from alignflow.core import Sampler
from alignflow.core.environments import Environment, Step
from alignflow.core.environments.episodes import (EpisodeError, Episodes, concurrently, episode_metrics,
                                                 state_hash)
from alignflow.core.sampling import Generation
from alignflow.core.spec.settings import GenerationSettings
from alignflow.core.task.tokenizer import build_char_tokenizer
from alignflow.plugins.math_tools import MathTools

TOK = build_char_tokenizer(1024)
GEN = GenerationSettings(max_new_tokens=40, temperature=1.0)
ROWS = [{"prompt": "7*8=", "answer": "56"}, {"prompt": "6*7=", "answer": "42"}]


class Scripted(Sampler):
    """Writes `script(context_text, turn)` for every context, with log-prob -1 per token; the stop token after
    it unless `max_new_tokens` cuts it first."""

    def __init__(self, script):
        super().__init__()
        self.script, self.calls = script, []

    def generate(self, prompt_ids, n, gen, seed):
        self.calls.append((len(prompt_ids), n, gen.max_new_tokens, seed))
        rows, texts, cut = [], [], []
        for ids in prompt_ids:
            for _ in range(n):
                full = TOK(self.script(TOK.decode(ids), len(self.calls) - 1), add_special_tokens=False).input_ids
                full += [TOK.eos_token_id]
                rows.append(full[: gen.max_new_tokens])
                cut.append(len(full) > gen.max_new_tokens)
                texts.append(TOK.decode(rows[-1], skip_special_tokens=True))
        index = [i for i in range(len(prompt_ids)) for _ in range(n)]
        return Generation(index, rows, texts, cut, [[-1.0] * len(r) for r in rows])


def solve(context, turn):
    """Calls the calculator on the prompt's product, then answers with the result it was given."""
    if "<result>" not in context:
        return f"<call>calculator {context.rstrip('=')}</call>"
    return f"<answer>{context.rsplit('<result>', 1)[1].split('</result>')[0]}</answer>"


def episodes(env=MathTools, **kw):
    return Episodes(env, env.Config(), **kw)


def test_a_tool_call_then_an_answer():
    sampler = Scripted(solve)
    g = episodes().generate(sampler, TOK, ROWS, 2, GEN, seed=5)
    assert g.texts == ["<call>calculator 7*8</call><result>56</result><answer>56</answer>"] * 2 + \
        ["<call>calculator 6*7</call><result>42</result><answer>42</answer>"] * 2
    messages = g.episodes.pop("messages")
    starts, history, observation = (g.episodes.pop(k) for k in ("turn_starts", "turn_history", "turn_observation"))
    assert [t["function"]["name"] for t in g.tools] == ["calculator"]  # once for the batch, not per episode
    assert g.episodes == {"reward": [1.0] * 4, "turns": [2] * 4, "tool_calls": [1] * 4, "tool_errors": [0] * 4,
                          "ended": ["done"] * 4, "success": [None] * 4}  # math_tools leaves success to its reward
    # the conversation as played, tool results as the tool returned them (an sft row of it learns both turns)
    assert messages[0] == [{"role": "user", "content": "7*8="},
                           {"role": "assistant", "content": "<call>calculator 7*8</call>"},
                           {"role": "tool", "name": "calculator", "content": "56"},
                           {"role": "assistant", "content": "<answer>56</answer>"}]
    assert g.prompt_ids == [TOK("7*8=").input_ids] * 2 + [TOK("6*7=").input_ids] * 2
    assert g.truncated == [False] * 4
    # the environment's reply is the only context: no loss and no sampler log-prob on it
    ids, mask, lp = g.completion_ids[0], g.loss_mask[0], g.logprobs[0]
    assert TOK.decode([t for t, m in zip(ids, mask) if not m]) == "<result>56</result>"
    assert [x for x, m in zip(lp, mask) if not m] == [0.0] * mask.count(0)
    assert [x for x, m in zip(lp, mask) if m] == [-1.0] * mask.count(1)
    # each turn's first token, and the states it started from: the second turn after the reply to the first
    assert starts == [[0, mask.index(1, mask.index(0))]] * 4  # the first model token after the first reply
    assert history[0] == history[1] != history[2] and len(set(history[0])) == 2  # each prompt's own episodes alike
    assert history[0][0] == state_hash(g.prompt_ids[0]) and history[0][1] == state_hash(g.prompt_ids[0] + ids[
        : starts[0][1]])
    assert observation[0] == [state_hash([{"role": "user", "content": "7*8="}]),
                              state_hash([{"role": "tool", "name": "calculator", "content": "56"}])]
    # one sampler call per turn for every running episode, each turn seeded apart
    assert [c[:2] for c in sampler.calls] == [(4, 1), (4, 1)] and sampler.calls[0][3] != sampler.calls[1][3]
    assert episode_metrics(g.episodes)["episode/tool_calls"] == 1.0


def test_tools_travel_once_per_batch_and_rewards_see_no_per_row_copy():
    from alignflow.flows.stages.scoring import columns_for

    g = episodes().generate(Scripted(solve), TOK, ROWS, 2, GEN, seed=5)
    cols = columns_for(ROWS, g)
    assert "episode_tools" not in cols and cols["episode_turns"] == [2] * 4
    joined = Generation.concat([(0, g), (2, g)])  # chunks of one batch: the schemas once, not repeated
    assert joined.tools == g.tools and len(joined.tools) == 1 and len(joined) == 8


def always_call(context, turn):
    return "<call>calculator 1+1</call>"


@pytest.mark.parametrize("limits, ended, turns", [
    ({"max_turns": 3}, "max_turns", 3),  # the third turn still calls a tool: no turn is left to answer
    # a call is 28 tokens, a reply 18: the second call is cut at 60
    ({"max_turns": 9, "max_tokens": 60}, "max_tokens", 2),
])
def test_limits_end_episodes_and_say_which(limits, ended, turns):
    g = episodes(**limits).generate(Scripted(always_call), TOK, ROWS[:1], 1, GEN, seed=0)
    assert g.episodes["ended"] == [ended] and g.episodes["turns"] == [turns] and g.truncated == [True]
    assert g.episodes["reward"] == [0.0]
    if "max_tokens" in limits:
        assert len(g.completion_ids[0]) == limits["max_tokens"]


def test_a_turn_without_a_stop_token_ends_its_episode():
    g = episodes().generate(Scripted(solve), TOK, ROWS[:1], 1, GEN.model_copy(update={"max_new_tokens": 10}), 0)
    assert g.episodes["ended"] == ["turn_tokens"] and g.episodes["turns"] == [1] and g.texts == ["<call>calc"]


def test_tool_errors_are_observations_and_counted():
    script = lambda c, t: "<call>abacus 1</call>" if t == 0 else "<answer>56</answer>"  # noqa: E731
    g = episodes().generate(Scripted(script), TOK, ROWS[:1], 1, GEN, seed=0)
    assert g.texts == ["<call>abacus 1</call><result>error: unknown tool 'abacus' (tools: calculator)</result>"
                       "<answer>56</answer>"]
    assert g.episodes["tool_errors"] == [1] and g.episodes["reward"] == [1.0]


class Flaky(MathTools):
    closed = []

    def reset(self, row, seed):
        if row["prompt"] == "boom":
            raise KeyError("seed_column")
        return super().reset(row, seed)

    def step(self, turn):
        if self.answer == "42":
            raise RuntimeError("the game crashed")
        return super().step(turn)

    def close(self):
        Flaky.closed.append(self.answer)


def test_a_failing_step_ends_that_episode_only_and_every_episode_is_closed():
    Flaky.closed.clear()
    g = episodes(Flaky).generate(Scripted(solve), TOK, ROWS, 1, GEN, seed=0)
    assert g.episodes["ended"] == ["done", "error"] and g.episodes["reward"] == [1.0, 0.0]
    assert sorted(Flaky.closed) == ["42", "56"]


def test_a_failing_reset_names_the_row():
    with pytest.raises(EpisodeError, match=r"failed to start an episode on row 1 \('boom'\): KeyError"):
        episodes(Flaky, name="flaky").generate(Scripted(solve), TOK, [ROWS[0], {"prompt": "boom"}], 1, GEN, 0)


class AsyncTools(MathTools):
    """Every step of a turn waits until all 4 episodes are inside that turn's step: only concurrent steps
    finish, on every turn (an Event per turn, made by the loop that runs that turn's steps)."""

    inside: dict[int, int] = {}
    everyone: dict[int, asyncio.Event] = {}

    async def step(self, turn):
        everyone = AsyncTools.everyone.setdefault(turn.index, asyncio.Event())
        AsyncTools.inside[turn.index] = AsyncTools.inside.get(turn.index, 0) + 1
        if AsyncTools.inside[turn.index] == 4:
            everyone.set()
        await asyncio.wait_for(everyone.wait(), timeout=20)
        return super().step(turn)


class ThreadedTools(MathTools):
    barrier = threading.Barrier(4, timeout=20)

    def step(self, turn):
        ThreadedTools.barrier.wait()  # raises BrokenBarrierError unless 4 steps run at once
        return super().step(turn)


@pytest.mark.parametrize("env", [AsyncTools, ThreadedTools])
def test_the_episodes_of_a_batch_step_concurrently(env):
    g = episodes(env).generate(Scripted(solve), TOK, ROWS, 2, GEN, seed=0)
    assert g.episodes["ended"] == ["done"] * 4 and g.episodes["reward"] == [1.0] * 4
    assert env is ThreadedTools or AsyncTools.inside == {0: 4, 1: 4}  # two turns of four episodes, each together


def test_concurrently_works_inside_a_running_event_loop():
    async def main():
        return concurrently([(lambda x: x * 2, 3), (asyncio.sleep, 0, "done")])

    assert asyncio.run(main()) == [6, "done"]


class Connected(MathTools):
    """Holds what an async `reset` opens, as a connection does: a queue bound to the loop that made it."""

    loops: list = []

    async def reset(self, row, seed):
        self.inbox = asyncio.Queue()
        Connected.loops.append(asyncio.get_running_loop())
        return super().reset(row, seed)

    async def step(self, turn):
        await self.inbox.put(turn.text)  # a queue used from another loop than its own fails
        Connected.loops.append(asyncio.get_running_loop())
        return super().step(turn)

    async def close(self):
        assert await self.inbox.get()
        Connected.loops.append(asyncio.get_running_loop())


def test_reset_step_and_close_of_a_batch_run_on_one_event_loop():
    Connected.loops.clear()
    g = episodes(Connected).generate(Scripted(solve), TOK, ROWS, 2, GEN, seed=0)
    assert g.episodes["ended"] == ["done"] * 4 and g.episodes["reward"] == [1.0] * 4
    assert len(Connected.loops) == 4 * 4 and len(set(map(id, Connected.loops))) == 1  # reset, 2 steps, close
    again = episodes(Connected).generate(Scripted(solve), TOK, ROWS, 1, GEN, seed=0)  # a loop per batch
    assert again.episodes["ended"] == ["done"] * 2 and Connected.loops[-1] is not Connected.loops[0]


class Shared(Flaky):
    """Counts what its batch holds: the instances made inside it, and whether it was left."""

    events: list = []

    @classmethod
    @contextlib.contextmanager
    def batch(cls, config):
        Shared.events.append("enter")
        try:
            yield lambda: Shared.events.append("make") or cls(config)
        finally:
            Shared.events.append("exit")

    def close(self):
        Shared.events.append("close")


@pytest.mark.parametrize("rows, ok", [(ROWS[:1], True), ([ROWS[0], {"prompt": "boom"}], False)])
def test_a_batch_is_held_from_before_the_first_episode_to_after_the_last_close(rows, ok):
    Shared.events.clear()
    with contextlib.nullcontext() if ok else pytest.raises(EpisodeError):
        episodes(Shared).generate(Scripted(solve), TOK, rows, 2, GEN, seed=0)
    n = 2 * len(rows)
    assert Shared.events == ["enter"] + ["make"] * n + ["close"] * n + ["exit"]  # also when a reset fails


def test_hold_keeps_one_batch_for_every_generate_and_a_copy_for_another_process_holds_none():
    import pickle

    Shared.events.clear()
    held = episodes(Shared)
    with held.hold():
        for _ in range(2):
            held.generate(Scripted(solve), TOK, ROWS[:1], 2, GEN, seed=0)
        copy = pickle.loads(pickle.dumps(held))  # as a rollout worker gets it
        assert copy == held and copy._held is None and held._held is not None
    assert Shared.events == ["enter"] + (["make"] * 2 + ["close"] * 2) * 2 + ["exit"] and held._held is None


class Game(Environment):
    """Guess a number: each wrong guess gets a hint and -0.1; the right one ends it with 1."""

    def reset(self, row, seed):
        self.secret = seed % 10
        return "guess 0-9:"

    def step(self, turn):
        guess = int(turn.text.strip() or -1)
        if guess == self.secret:
            return Step(reward=1.0, done=True)
        return Step("higher" if guess < self.secret else "lower", reward=-0.1)


def test_per_turn_rewards_add_up_and_a_group_starts_alike():
    script = lambda c, t: str(t)  # noqa: E731  guesses 0, 1, 2, ...
    g = Episodes(Game, None, max_turns=10).generate(Scripted(script), TOK, [{"prompt": ""}], 2, GEN, seed=0)
    secret = (0 * 104_723 + 0) % 10  # seeds.episode(seed, row) for row 0
    assert g.episodes["turns"] == [secret + 1] * 2
    assert g.episodes["reward"] == [pytest.approx(1.0 - 0.1 * secret)] * 2


def test_an_sft_row_of_an_episode_trains_on_the_ids_the_episode_was_played_with(tmp_path):
    """The cold start learns the tokens the model then reads and writes in its episodes: an episode's conversation
    (a calculator call, its result, the answer; or an answer at once), tokenised by the sft stage, gives the
    episode's prompt and completion ids, labelled exactly on the model's turns."""
    import json

    from alignflow.core.train.datasets import IGNORE_INDEX, load_rows, tokenize

    def teacher(context, turn):  # the sloppy teacher: calls the calculator on 7*8, answers 6*7 at once
        return solve(context, turn) if context.startswith("7*8=") else "<answer>41</answer>"

    g = episodes().generate(Scripted(teacher), TOK, ROWS, 1, GEN, seed=0)
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in g.episodes["messages"]))
    out, _ = tokenize(load_rows(path, "sft_messages", cache_dir=str(tmp_path / "cache")), TOK, max_length=128)
    assert g.episodes["tool_calls"] == [1, 0]
    for row, prompt, completion, mask in zip(out, g.prompt_ids, g.completion_ids, g.loss_mask):
        assert row["input_ids"] == prompt + completion
        assert row["labels"] == [IGNORE_INDEX] * len(prompt) + [t if m else IGNORE_INDEX
                                                                for t, m in zip(completion, mask)]
