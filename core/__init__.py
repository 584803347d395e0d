"""alignflow.core: contracts and machinery; no algorithm lives here. A plugin imports all it implements and uses
from here: the hooks, each plugin kind's contracts and their shared parts. The torch-based ones load on first use
(`_EXPORTS`), so that `import alignflow.core` stays light for the quick commands and a plugin's registration."""

import importlib
import types

from alignflow.core.contracts import Algorithm, PluginConfig, RewardFn, Sampler, Selector, operational
from alignflow.core.environments import (Environment, EpisodeError, Limits, McpServer, Message, Step, ToolCall,
                                         ToolError, Turn, call_tools, python, tool_schema)
from alignflow.core.errors import AlignflowError, DataError, PluginError, SpecError
from alignflow.core.hookspecs import hookimpl, hookspec
from alignflow.core.plugins import Plugins, get_plugins, reset_plugins
from alignflow.core.rewards import RewardError, RewardSet, Scores
from alignflow.core.spec.settings import GenerationSettings

_EXPORTS = {name: module for module, names in {
    "alignflow.core.rl.algorithm": "KLLossConfig PolicyBatch PolicyGradient PolicyGradientConfig RLAlgorithm "
                                   "Rollout broadcast policy_weighted sampler_corrected with_kl_loss",
    "alignflow.core.rl.aggregation": "AggMode aggregate",
    "alignflow.core.rl.capabilities": "CostConstrained EpisodeTurns ExtraParameters GuidedSamples Regenerate Replay "
                                      "RewardComponents Stateful TeacherDistributions has",
    "alignflow.core.rl.parts": "clipped_surrogate discounted_returns gae group_ids group_normalize group_sum "
                               "kl_estimate last_token_rewards leave_one_out masked_mean masked_whiten",
    "alignflow.core.train.offline": "Mean PairBatch PreferenceAlgorithm TokenLogps per_token",
    "alignflow.core.sampling": "Generation",
    "alignflow.core.environments.agents": "AgentEnvironment",
}.items() for name in names.split()}
# the names imported above (not the modules), and the lazy ones
__all__ = [*(n for n, v in globals().items() if not (n.startswith("_") or isinstance(v, types.ModuleType))), *_EXPORTS]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'alignflow.core' has no attribute {name!r}")
