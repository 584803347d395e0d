import random
import sys

import pytest

pytest.importorskip("textarena")

from alignflow.core import AlignflowError, Sampler
from alignflow.core.environments import Turn
from alignflow.core.environments.episodes import Episodes
from alignflow.core.plugins import Plugins
from alignflow.plugins import textarena_env
from alignflow.core.sampling import Generation
from alignflow.core.spec.settings import GenerationSettings
from alignflow.core.task.tokenizer import build_char_tokenizer
from alignflow.plugins.textarena_env import TextArena

TOK = build_char_tokenizer(1024)

HANOI = ["[A C]", "[A B]", "[C B]", "[A C]", "[B A]", "[B C]", "[A C]"]  # the 7-move solution for 3 disks


def env(env_id="TowerOfHanoi-v0", **config) -> TextArena:
    return TextArena(TextArena.Config(env_id=env_id, **config))


def play(e: TextArena, moves: list[str]):
    return [e.step(Turn(move, tool_calls=[], index=i)) for i, move in enumerate(moves)]


def test_solving_tower_of_hanoi_gets_the_games_reward():
    e = env()
    first = e.reset({"prompt": "unused"}, seed=0)
    assert "Tower of Hanoi with 3 disks" in first and "A: [3, 2, 1]" in first
    steps = play(e, HANOI)
    assert [s.done for s in steps] == [False] * 6 + [True]
    assert all(s.reward == 0.0 for s in steps[:-1])
    assert steps[-1].reward == 1.0 and steps[-1].observation is None
    assert "solved" in steps[-1].info["reason"] and steps[-1].info["invalid_move"] is False
    # only what is new comes back: the move's result and the board, not the history or the move itself
    assert steps[0].observation.startswith("You moved disk 1 from A to C.")
    assert "Tower of Hanoi" not in steps[0].observation and "[A C]" not in steps[0].observation


def test_guess_the_number_by_its_hints():
    e = env("GuessTheNumber-v0")
    e.reset({}, seed=3)
    lo, hi = 1, 20
    for i in range(10):
        guess = (lo + hi) // 2
        step = e.step(Turn(f"My guess is [{guess}].", [], i))
        if step.done:
            break
        lo, hi = (guess + 1, hi) if "higher" in step.observation else (lo, guess - 1)
    assert step.done and step.reward == 1.0 and i < 5


def test_an_invalid_move_gets_the_games_warning_then_its_penalty():
    e = env()
    e.reset({}, seed=0)
    play(e, HANOI[:4])  # A: [], B: [2, 1], C: [3]
    warned = e.step(Turn("[A B]", [], 4))  # tower A is empty
    assert not warned.done and warned.reward == 0.0
    assert "invalid move" in warned.observation and "empty tower" in warned.observation
    ended = e.step(Turn("I give up", [], 5))  # a second invalid move in a row ends the game
    assert ended.done and ended.info["invalid_move"] is True
    assert ended.reward == pytest.approx(1 / 3)  # TowerOfHanoi's penalty: the share of disks already in place


def test_same_seed_same_game_other_seed_other_game():
    firsts = [env("LightsOut-v0").reset({}, seed=s) for s in (5, 5, 6)]
    assert firsts[0] == firsts[1]
    assert firsts[0] != firsts[2]


def test_interleaved_episodes_keep_their_own_random_stream():
    """2048 places a random tile each move: episodes of one seed stay alike however their calls interleave,
    and the process's own `random` stream is left as it was."""
    random.seed(123)
    expected = random.random()
    random.seed(123)
    a, b = env("2048-v0"), env("2048-v0")
    assert a.reset({}, 9) == b.reset({}, 9)
    random.random(), random.random()  # other code drawing between the games' calls
    moves = ["[up]", "[left]", "[down]", "[right]"] * 2
    seen_a = [s.observation for s in play(a, moves)]
    seen_b = [s.observation for s in play(b, moves)]
    assert seen_a == seen_b
    random.seed(123)
    a.reset({}, 9)
    assert random.random() == expected


def test_row_env_id_wins_and_system_prompt_leads():
    e = env("TowerOfHanoi-v0", system_prompt="Play well.")
    first = e.reset({"env_id": "GuessTheNumber-v0"}, seed=0)
    assert first[0] == {"role": "system", "content": "Play well."}
    assert first[1]["role"] == "user" and "Guess The Number" in first[1]["content"]


def test_game_arguments_from_config():
    first = env(kwargs={"num_disks": 4}).reset({}, seed=0)
    assert "4 disks" in first


def test_close_releases_the_game():
    e = env()
    e.reset({}, seed=0)
    e.close()
    assert e.game is None and e.base is None
    with pytest.raises(AlignflowError, match="not running"):
        e.step(Turn("[A C]", [], 0))


def test_clear_errors_for_no_game_unknown_game_and_multiplayer_game():
    with pytest.raises(AlignflowError, match="env_id"):
        TextArena().reset({}, seed=0)
    with pytest.raises(AlignflowError, match="no game 'Nope-v0'"):
        env("Nope-v0").reset({}, seed=0)
    with pytest.raises(AlignflowError, match="single-player"):
        env("TicTacToe-v0").reset({}, seed=0)


def test_missing_library_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "textarena", None)
    with pytest.raises(AlignflowError, match="pip install textarena"):
        env().reset({}, seed=0)


def test_registered_as_textarena_with_its_library():
    plugins = Plugins()
    plugins.add(textarena_env, "textarena_env")
    assert plugins.environments.get("textarena") is TextArena
    assert TextArena.libraries == ("textarena",)


class Solver(Sampler):
    """Writes the next Tower of Hanoi move (the turn's index in the solution) for every episode."""

    def generate(self, prompt_ids, n, gen, seed):
        turn = TOK.decode(prompt_ids[0]).count("Current Board") - 1
        rows = [TOK(HANOI[turn], add_special_tokens=False).input_ids + [TOK.eos_token_id] for _ in prompt_ids]
        return Generation(list(range(len(rows))), rows, [HANOI[turn]] * len(rows), [False] * len(rows), None)


def test_episodes_of_a_stage_play_the_game_to_its_reward():
    """The stage's episode runner: 4 games at once (2 rows, 2 each), the game's reward on each, the game's
    messages in the transcript as context only."""
    runner = Episodes(TextArena, TextArena.Config(env_id="TowerOfHanoi-v0"), max_turns=8, max_tokens=4000)
    gen = GenerationSettings(max_new_tokens=10)
    g = runner.generate(Solver(), TOK, [{"prompt": ""}, {"prompt": ""}], 2, gen, seed=1)
    assert g.episodes["reward"] == [1.0] * 4 and g.episodes["turns"] == [7] * 4
    assert g.episodes["ended"] == ["done"] * 4
    model = TOK.decode([t for t, m in zip(g.completion_ids[0], g.loss_mask[0]) if m], skip_special_tokens=True)
    assert model == "".join(HANOI)
