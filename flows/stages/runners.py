"""Stage kind -> runner: `RUNNERS`.

Apart from `alignflow.flows.stages` (the runner contract every runner imports) so that a runner's digest,
which follows the imports of every module it reaches, does not reach every other runner through it.
"""

from __future__ import annotations

from alignflow.flows.stages import Runner


def _runners() -> dict[str, Runner]:
    from alignflow.flows.stages.select import run_select
    from alignflow.flows.stages.evaluate import run_evaluate
    from alignflow.flows.stages.sft import run_sft
    from alignflow.flows.stages.preference import run_preference
    from alignflow.flows.stages.reward_model import run_reward_model
    from alignflow.flows.stages.prm import run_prm
    from alignflow.flows.stages.step_labels import run_step_labels
    from alignflow.flows.stages.rejection import run_rejection_sampling
    from alignflow.flows.stages.critique import run_critique_revise
    from alignflow.flows.stages.rl.stage import run_rl

    return {"select": run_select, "sft": run_sft, "evaluate": run_evaluate, "preference": run_preference,
            "reward_model": run_reward_model, "prm": run_prm, "rejection_sampling": run_rejection_sampling,
            "critique_revise": run_critique_revise, "step_labels": run_step_labels, "rl": run_rl}


# Stage kind -> runner, nothing else: what a kind is lives in its record (core/spec/kinds.py); each has one runner.
RUNNERS: dict[str, Runner] = _runners()
