"""The plugin manager: entry-point loading, registries, and the errors that name the culprit."""

import importlib
import textwrap

import pytest

from alignflow.core import Algorithm, PluginError, hookimpl
from alignflow.core.plugins import Plugins, get_plugins, load_entry_points, reset_plugins

BUILTIN_ALGORITHMS = {"sft", "bradley_terry", "dpo", "ipo", "kto", "orpo", "simpo", "spin", "bnf", "implicit_prm",
                      "grpo", "dapo", "dr_grpo", "lambda_grpo", "reinforce_pp", "rloo", "disco", "ppo",
                      "ngrpo", "gspo", "gmpo", "cispo", "sapo", "kimi", "offpolicy_grpo", "distill", "rto",
                      "expo"}


def make_dist(site, dist, module, source, ep_name=None):
    """Write a real installed distribution (dist-info with an `alignflow` entry point) into `site`."""
    info = site / f"{dist.replace('-', '_')}-1.2.3.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.2.3\n")
    (info / "entry_points.txt").write_text(f"[alignflow]\n{ep_name or module} = {module}\n")
    (site / f"{module}.py").write_text(textwrap.dedent(source))


@pytest.fixture
def site(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    monkeypatch.setenv("ALIGNFLOW_PLUGINS", "")  # start from nothing; each test opts in
    return tmp_path


def loaded(monkeypatch, only):
    monkeypatch.setenv("ALIGNFLOW_PLUGINS", only)
    plugins = Plugins()
    load_entry_points(plugins)
    return plugins


ALGO_SOURCE = """
    from alignflow.core import Algorithm, hookimpl
    class Shiny(Algorithm):
        '''A shiny test algorithm.'''
        stage = "preference"
    @hookimpl
    def register_algorithms(register):
        register("shiny", Shiny)
"""


def test_builtins_come_from_the_entry_point_group():
    reset_plugins()
    plugins = get_plugins()
    assert BUILTIN_ALGORITHMS <= set(plugins.algorithms.names())
    for entry in plugins.entries():
        assert entry.distribution == "alignflow"
        assert entry.description, f"{entry.kind} {entry.name} has no one-line description"
    for entry in plugins.algorithms:
        assert entry.obj.stage in {"sft", "reward_model", "prm", "preference", "rl"}


def test_third_party_plugin_is_registered_with_its_distribution(site, monkeypatch):
    make_dist(site, "shiny-plugin", "shiny_mod", ALGO_SOURCE)
    plugins = loaded(monkeypatch, "shiny_mod")
    entry = plugins.algorithms.entry("shiny")
    assert (entry.distribution, entry.version, entry.description) == ("shiny-plugin", "1.2.3", "A shiny test algorithm.")
    assert issubclass(entry.obj, Algorithm)


def test_import_failure_names_distribution_entry_point_and_exception(site, monkeypatch):
    make_dist(site, "broken-plugin", "broken_mod", "import does_not_exist_anywhere\n")
    with pytest.raises(PluginError) as info:
        loaded(monkeypatch, "broken-plugin")
    msg = str(info.value)
    assert "broken-plugin" in msg and "'broken_mod'" in msg
    assert "failed to import" in msg and "ModuleNotFoundError" in msg and "does_not_exist_anywhere" in msg


def test_duplicate_name_names_both_distributions(site, monkeypatch):
    make_dist(site, "shiny-plugin", "shiny_mod", ALGO_SOURCE)
    make_dist(site, "copycat-plugin", "copycat_mod", ALGO_SOURCE)
    with pytest.raises(PluginError) as info:
        loaded(monkeypatch, "shiny_mod,copycat_mod")
    msg = str(info.value)
    assert "duplicate algorithm name 'shiny'" in msg
    assert "copycat-plugin" in msg and "shiny-plugin" in msg


def test_duplicate_of_a_builtin_is_an_error(site, monkeypatch):
    make_dist(site, "evil-plugin", "evil_mod", ALGO_SOURCE.replace('"shiny"', '"format"').replace(
        "register_algorithms", "register_rewards"))
    with pytest.raises(PluginError, match=r"duplicate reward name 'format'.*alignflow.*evil-plugin"):
        loaded(monkeypatch, "alignflow,evil_mod")


def test_misspelled_hookimpl_is_caught(site, monkeypatch):
    make_dist(site, "typo-plugin", "typo_mod", """
        from alignflow.core import hookimpl
        @hookimpl
        def register_algorithm(register):
            pass
    """)
    with pytest.raises(PluginError) as info:
        loaded(monkeypatch, "typo_mod")
    msg = str(info.value)
    assert "typo-plugin" in msg and "'typo_mod'" in msg and "register_algorithm" in msg


def test_wrong_hook_argument_is_caught(site, monkeypatch):
    make_dist(site, "args-plugin", "args_mod", """
        from alignflow.core import hookimpl
        @hookimpl
        def register_rewards(registry):
            pass
    """)
    with pytest.raises(PluginError, match=r"args-plugin.*invalid hook implementation.*registry"):
        loaded(monkeypatch, "args_mod")


def test_unknown_name_lists_known_names_and_closest_match():
    reset_plugins()
    plugins = get_plugins()
    with pytest.raises(PluginError) as info:
        plugins.rewards.get("math_acuracy")
    msg = str(info.value)
    assert "unknown reward 'math_acuracy'" in msg
    assert "did you mean 'math_accuracy'?" in msg
    assert "format" in msg  # the known names are listed


def test_alignflow_plugins_restricts_loading(site, monkeypatch):
    make_dist(site, "shiny-plugin", "shiny_mod", ALGO_SOURCE)
    only_third_party = loaded(monkeypatch, "shiny-plugin")
    assert only_third_party.algorithms.names() == ["shiny"]
    assert len(only_third_party.rewards) == 0
    only_builtins = loaded(monkeypatch, "alignflow")
    assert "shiny" not in only_builtins.algorithms
    assert BUILTIN_ALGORITHMS <= set(only_builtins.algorithms.names())


def test_in_process_plugin_registers_and_unregisters():
    class LocalPlugin:
        @staticmethod
        @hookimpl
        def register_algorithms(register):
            register("local_algo", type("Local", (Algorithm,), {"__doc__": "Local.", "stage": "sft"}))

    plugins = Plugins()
    plugins.add(LocalPlugin, "local")
    assert plugins.algorithms.entry("local_algo").distribution == "__main__"
    plugins.remove("local")
    assert "local_algo" not in plugins.algorithms
