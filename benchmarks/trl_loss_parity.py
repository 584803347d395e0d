"""TRL 1.16's own loss code against ours on the same tensors: GRPO with a KL term (and with IcePop or TIS),
GSPO, CISPO, SAPO, GMPO.

    ../venv-trl/bin/python benchmarks/trl_loss_parity.py [--seeds 5] [--batch 8] [--width 16] [--out F.json]

Needs an environment with both TRL 1.16 and alignflow (benchmarks/README.md says how to make one).

How it works. For each seed and dtype (float32, float64) the script draws shared tensors: B responses of
random lengths 1..T (the rest padding, which holds junk log-probs both sides must ignore), old log-probs,
current log-probs = old + noise (its scale per case puts some tokens or responses past the clip and
some inside), and one advantage per response (one of them exactly 0). TRL's side runs TRL's code itself:
`GRPOTrainer._compute_loss` (for GMPO `trl.experimental.gmpo.GMPOTrainer._compute_loss`) on an instance made
with `__new__`, holding the attributes `__init__` would derive from a real `GRPOConfig` (epsilons, beta,
loss_type, importance_sampling_level, ...), a CPU `Accelerator`, and a stand-in for
`_get_per_token_logps_and_entropies` that returns the shared log-probs as a leaf tensor, so everything from
the log-probs to the scalar loss, aggregation included, is TRL's. It runs in train mode with one
accumulation step, `num_items_in_batch` = the batch's tokens (token-mean losses). Our side: the plugin's
`loss` on a `PolicyBatch` of the same tensors (the advantage broadcast over each response), reduced by
`alignflow.core.rl.aggregation.aggregate` with the plugin's `loss_agg_mode`, as the `rl` stage does for a step
of one micro-batch. Reported per case: max |loss_trl - loss_ours| and max |dloss/dlogprobs| difference over
seeds, per dtype, with the scale of each, how much the clip touched, and the same distances for a control
(our algorithm with one setting changed on purpose), which shows the size of mismatch the check would see.

Settings matched (TRL -> ours):
- gspo: importance_sampling_level="sequence", loss_type="grpo" (per-response token mean, then mean over
  responses), epsilon=3e-4, epsilon_high=4e-4, beta=0 -> `gspo` defaults (`seq-mean-token-mean`).
- gspo_kl: the same with beta=0.04 and use_bias_correction_kl=False -> `gspo` with kl_loss_coef=0.04.
- gspo_kl_default: beta=0.04 and TRL's default use_bias_correction_kl=True (k3 times the sequence ratio s_i,
  differentiable) -> `gspo` with kl_loss_coef=0.04, kl_loss_bias_correction=True.
- grpo_kl / grpo_kl_unweighted: importance_sampling_level="token", loss_type="grpo", epsilon=0.2, beta=0.04,
  use_bias_correction_kl True (TRL's default) / False -> `grpo` with kl_loss_bias_correction true / false.
- grpo_kl_icepop / grpo_kl_tis: the same with use_bias_correction_kl=False and TRL's vLLM importance-sampling
  correction, vllm_importance_sampling_mode="token_mask" with clip_min 0.5, clip_max 5 / "token_truncate" with
  clip_max 2 (the ratio pi_old / mu computed as TRL's `_generate_and_score_completions` does, from shared sampler
  log-probs; `_compute_loss` applies it) -> `grpo` with the stage's `icepop: [0.5, 5]` / `tis_cap: 2`
  (`mismatch_weights`, `sampler_corrected`). Both weight the clipped surrogate and add beta k3 unweighted; the
  control weights the KL term too (as the stage did before).
- *_extreme: the draws get tokens past our clamps (log-ratios +-25, log pi_ref/pi_theta = 3, 2.8, -12: k3 over
  10), and our side sets log_ratio_clamp=None (and kl_clamp=None for grpo), as TRL clamps neither; the control
  is our default clamps.
- cispo: loss_type="cispo" (token-mean over the step), epsilon_high=5.0 (TRL's cap on the weight itself, no
  floor) -> `cispo` defaults (clip_high=4.0: cap 1 + 4; clip_low=None: no floor; `token-mean`).
- sapo: loss_type="sapo" (per-response token mean, then mean), sapo_temperature_pos=1.0,
  sapo_temperature_neg=1.05 -> `sapo` defaults (tau_pos 1.0, tau_neg 1.05, `seq-mean-token-mean`).
- gmpo: trl.experimental GMPOConfig(epsilon=0.4, beta=0) (log-space clip, mean over responses) -> `gmpo`
  defaults (log_clip_low = log_clip_high = 0.4).
Not covered: the advantages (TRL computes them inside generation; both use the group mean and std).

Result (TRL 1.16.0, torch 2.13.0+cpu, 5 seeds, B = 8, T = 16, 5 s on a 2-core AMD EPYC with AVX-512 for all
eleven cases; grpo_kl_icepop and grpo_kl_tis on one with AVX2, 14 s for all thirteen; benchmarks/README.md has
all): with matched settings every case agrees.
Max |loss difference| / max |gradient difference|, float32 and float64 (loss ~0.7-1.9, gradients up to 0.3):

    case      float32            float64              control (one setting changed), float64: loss / grad
    gspo      0      / 3.7e-09   0       / 3.5e-18    token-mean aggregation: 4.3e-01 / 7.3e-02
    gspo_kl   0      / 3.7e-09   1.1e-16 / 3.5e-18    kl_loss_coef 0.05:      1.6e-04 / 2.9e-04
    cispo     0      / 0         0       / 0          cap 4 instead of 5:     7.2e-02 / 4.5e-02
    sapo      0      / 0         0       / 0          tau_neg 1.0:            4.5e-02 / 2.0e-03
    gmpo      7.5e-08 / 3.7e-09  1.1e-16 / 3.5e-18    log clip 0.3:           4.1e-02 / 5.1e-02

    grpo_kl            0 / 3.0e-08      0 / 1.4e-17        no bias correction:     8.9e-04 / 2.2e-03
    grpo_kl_icepop     0 / 0            1.1e-16 / 0        the KL term weighted:   1.7e-03 / 2.6e-03
    grpo_kl_tis        0 / 0            5.6e-17 / 0        the KL term weighted:   8.2e-04 / 2.0e-03
    grpo_kl_extreme    0 / 2.0e+03      0 / 4.8e-07        default clamps:         8.6e+09 / 9.0e+09  (scale 9e9)
    gmpo_extreme       3.0e-08 / 1.9e-09  4.4e-16 / 2.2e-16  log-ratio clamp 20:   3.0e+01 / 1.0e+01

The draws did reach the clips: GSPO clipped 17% of tokens low and 6% high (whole responses), CISPO capped 5%
of the weights, GMPO clipped 7% low and 8% high; IcePop dropped 22% of the tokens and TIS capped 24%. What
differs is rounding: our GSPO computes the same value in its stop-gradient (GSPO-token) form, which gives the
sequence ratio's gradient.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import warnings
from collections import defaultdict

import torch


def shared_tensors(seed: int, batch: int, width: int, scale: float, dtype: torch.dtype, extreme: bool = False) -> dict:
    """Random log-probs with padding, and one advantage per response; `extreme` adds tokens past our clamps."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width + 1, (batch,), generator=g)
    lengths[0], lengths[1] = width, 1  # a full row and a one-token row in every draw
    mask = (torch.arange(width)[None, :] < lengths[:, None]).to(dtype)
    old = -3.0 * torch.rand(batch, width, generator=g, dtype=dtype) - 0.05
    logprobs = old + scale * torch.randn(batch, width, generator=g, dtype=dtype)
    junk = -5.0 * torch.rand(batch, width, generator=g, dtype=dtype)  # padding: neither side may read it
    logprobs, old = torch.where(mask.bool(), logprobs, junk), torch.where(mask.bool(), old, junk.flip(0))
    advantages = torch.randn(batch, generator=g, dtype=dtype)
    advantages[2] = 0.0
    ref = old - 0.3 * torch.rand(batch, width, generator=g, dtype=dtype)
    # the sampler's (mu): log pi_old / mu ~ N(0, 0.8), so about a fifth of the tokens fall outside IcePop's
    # [0.5, 5], and as many past a TIS cap of 2
    sampled = torch.where(mask.bool(), old - 0.8 * torch.randn(batch, width, generator=g, dtype=dtype), junk)
    if extreme and batch >= 7:
        # first tokens (always inside the response): log r = +25 and -25 (past the +-20 log-ratio clamp; k3 of
        # about 24 too), log rho = ref - logp = 3 and 2.8 (k3 = 16.1 and 12.7, past the KL clamp 10), and -12
        logprobs[3, 0], logprobs[4, 0] = old[3, 0] + 25.0, old[4, 0] - 25.0
        logprobs[1, 0] = old[1, 0] - 25.0  # row 1 has one token: GSPO's sequence log-ratio -25 too
        ref[3, 0], ref[4, 0], ref[1, 0] = old[3, 0], old[4, 0], old[1, 0]
        for row, log_rho in ((5, 3.0), (6, 2.8), (0, -12.0)):
            ref[row, 0] = logprobs[row, 0] + log_rho
    return dict(logprobs=logprobs, old=old, ref=ref, mask=mask, advantages=advantages, sampled=sampled)


def trl_sampler_ratio(t: dict, mode: str, clip_min: float | None, clip_max: float | None) -> torch.Tensor:
    """The vLLM importance-sampling ratio pi_old / mu as TRL 1.16's `_generate_and_score_completions` computes it
    in its token modes (the lines from `per_token_logps_diff` to `masked_fill`), which `_compute_loss` then reads
    from `inputs["importance_sampling_ratio"]`."""
    import math

    ratio = torch.exp(torch.nan_to_num((t["old"] - t["sampled"]) * t["mask"], nan=0.0))
    if mode == "token_truncate":
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    low, high = -math.inf if clip_min is None else clip_min, math.inf if clip_max is None else clip_max
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


def trl_loss(trainer_cls, args, t: dict, sampler: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL's `_compute_loss` on the shared tensors: (loss, d loss / d logprobs). `sampler`: TRL's vLLM
    importance-sampling correction (`trl_sampler_ratio` keyword arguments), as with `use_vllm=True`."""
    from accelerate import Accelerator

    trainer = trainer_cls.__new__(trainer_cls)
    # What GRPOTrainer.__init__ sets from `args` and `_compute_loss` reads.
    trainer.args = args
    trainer.loss_type = args.loss_type
    trainer.importance_sampling_level = args.importance_sampling_level
    trainer.epsilon_low = args.epsilon
    trainer.epsilon_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
    trainer.beta = args.beta
    trainer.top_entropy_quantile = args.top_entropy_quantile
    trainer.off_policy_mask_threshold = args.off_policy_mask_threshold
    # set here, not in the config: GRPOConfig(use_vllm=True) would need vLLM installed
    trainer.use_vllm = args.use_vllm or sampler is not None
    trainer.vllm_importance_sampling_correction = args.vllm_importance_sampling_correction and sampler is not None
    trainer.max_completion_length = args.max_completion_length
    trainer.entropy_coef, trainer.use_adaptive_entropy = args.entropy_coef, args.use_adaptive_entropy
    trainer._entropy_bonus_enabled = args.entropy_coef != 0.0 or args.use_adaptive_entropy
    trainer.aux_loss_enabled = False
    trainer._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    trainer.accelerator = Accelerator(cpu=True)
    trainer.model = torch.nn.Module()  # train mode; only `.training` is read
    trainer.current_gradient_accumulation_steps = 1
    leaf = t["logprobs"].clone().requires_grad_(True)
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: (leaf, torch.zeros_like(leaf), None)
    b, w = leaf.shape
    inputs = {
        "prompt_ids": torch.zeros(b, 1, dtype=torch.long), "prompt_mask": torch.ones(b, 1, dtype=torch.long),
        "completion_ids": torch.zeros(b, w, dtype=torch.long), "completion_mask": t["mask"].long(),
        "advantages": t["advantages"], "old_per_token_logps": t["old"], "ref_per_token_logps": t["ref"],
        "num_items_in_batch": t["mask"].sum(),
    }
    if sampler is not None:
        inputs["importance_sampling_ratio"] = trl_sampler_ratio(t, **sampler)
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    return loss.detach(), leaf.grad


def our_loss(algo, t: dict, correction: dict | None = None) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """The plugin's per-token loss reduced as the `rl` stage reduces one micro-batch that is a whole step;
    `correction`: the stage's `tis_cap` / `icepop` setting, its weights computed and applied as the stage does."""
    from alignflow.core.rl.aggregation import aggregate
    from alignflow.core.rl.algorithm import PolicyBatch, broadcast, sampler_corrected
    from alignflow.flows.stages.rl.update import mismatch_weights

    leaf = t["logprobs"].clone().requires_grad_(True)
    mask = t["mask"]
    weights, counted = (None, {}) if correction is None else mismatch_weights(t["old"], t["sampled"], mask,
                                                                               **correction)
    batch = PolicyBatch(logprobs=leaf, old_logprobs=t["old"], advantages=broadcast(t["advantages"], mask),
                        response_mask=mask, group=torch.zeros(len(mask), dtype=torch.long), ref_logprobs=t["ref"],
                        policy_weights=weights)
    per_token, metrics = sampler_corrected(algo, batch)
    metrics.update(counted)  # the share of tokens IcePop dropped or TIS capped
    loss = aggregate(per_token, mask, algo.loss_agg_mode)
    loss.backward()
    return loss.detach(), leaf.grad, {k: float(v) for k, v in metrics.items()}


def cases():
    """name -> (TRL trainer class, TRL config kwargs, our algorithm, log-prob noise scale, a control[, options]).

    The control is our algorithm with one thing changed on purpose: its distance from TRL shows the check
    would see a real mismatch of that size. Options: `extreme` (draws past our clamps), `sampler` (TRL's vLLM
    importance-sampling ratio, `trl_sampler_ratio`) with `correction` (the stage's matching setting)."""
    from trl import GRPOTrainer

    def ours(module: str, cls: str, **kw):
        def make():
            algo = getattr(importlib.import_module(f"alignflow.plugins.{module}"), cls)
            return algo(algo.Config(**kw))
        return make

    def gmpo_trainer():
        from trl.experimental.gmpo import GMPOTrainer
        return GMPOTrainer

    def whole_loss_weighted(**kw):  # the stage before the fix: the sampler weights on the KL term too
        def make():
            from alignflow.plugins.grpo import GRPO

            algo = type("GRPOWholeLoss", (GRPO,), {"applies_policy_weights": False})
            return algo(algo.Config(**kw))
        return make

    seq = dict(importance_sampling_level="sequence", loss_type="grpo", epsilon=3e-4, epsilon_high=4e-4)
    tok = dict(importance_sampling_level="token", loss_type="grpo", epsilon=0.2, beta=0.04)  # grpo's defaults
    no_clamps = dict(log_ratio_clamp=None, kl_clamp=None)
    return {
        # TRL's default KL (use_bias_correction_kl=True): k3 x the differentiable token ratio
        "grpo_kl": (lambda: GRPOTrainer, dict(tok, use_bias_correction_kl=True),
                    ours("grpo", "GRPO", kl_loss_bias_correction=True), 0.3,
                    ("no bias correction (our default)", ours("grpo", "GRPO"))),
        "grpo_kl_unweighted": (lambda: GRPOTrainer, dict(tok, use_bias_correction_kl=False), ours("grpo", "GRPO"),
                               0.3, ("bias correction on", ours("grpo", "GRPO", kl_loss_bias_correction=True))),
        # the sampler correction with a KL term: TRL's vLLM ratio against the stage's `icepop` / `tis_cap` weights;
        # both weight the clipped surrogate and add beta k3 unweighted
        "grpo_kl_icepop": (lambda: GRPOTrainer, dict(tok, use_bias_correction_kl=False), ours("grpo", "GRPO"), 0.3,
                           ("the KL term weighted too", whole_loss_weighted()),
                           dict(sampler=dict(mode="token_mask", clip_min=0.5, clip_max=5.0),
                                correction=dict(icepop=(0.5, 5.0)))),
        "grpo_kl_tis": (lambda: GRPOTrainer, dict(tok, use_bias_correction_kl=False), ours("grpo", "GRPO"), 0.3,
                        ("the KL term weighted too", whole_loss_weighted()),
                        dict(sampler=dict(mode="token_truncate", clip_min=None, clip_max=2.0),
                             correction=dict(tis_cap=2.0))),
        # tokens past both clamps: TRL clamps neither, so ours matches it with both set to None
        "grpo_kl_extreme": (lambda: GRPOTrainer, dict(tok, use_bias_correction_kl=True),
                            ours("grpo", "GRPO", kl_loss_bias_correction=True, **no_clamps), 0.3,
                            ("our default clamps", ours("grpo", "GRPO", kl_loss_bias_correction=True)),
                            dict(extreme=True)),
        "gspo_kl_default": (lambda: GRPOTrainer, dict(seq, beta=0.04, use_bias_correction_kl=True),
                            ours("gspo", "GSPO", kl_loss_coef=0.04, kl_loss_bias_correction=True), 2e-3,
                            ("no bias correction", ours("gspo", "GSPO", kl_loss_coef=0.04))),
        "gmpo_extreme": (gmpo_trainer, dict(epsilon=0.4, beta=0.0), ours("gmpo", "GMPO", log_ratio_clamp=None), 0.5,
                         ("our default log-ratio clamp 20", ours("gmpo", "GMPO")), dict(extreme=True)),
        "gspo_extreme": (lambda: GRPOTrainer, dict(seq, beta=0.0), ours("gspo", "GSPO", log_ratio_clamp=None), 2e-3,
                         ("our default log-ratio clamp 20", ours("gspo", "GSPO")), dict(extreme=True)),
        # noise 2e-3 per token: mean log-ratios of ~1e-3, around the 3e-4 / 4e-4 bounds
        "gspo": (lambda: GRPOTrainer, dict(seq, beta=0.0), ours("gspo", "GSPO"), 2e-3,
                 ("token-mean aggregation", ours("gspo", "GSPO", loss_agg_mode="token-mean"))),
        "gspo_kl": (lambda: GRPOTrainer, dict(seq, beta=0.04, use_bias_correction_kl=False),
                    ours("gspo", "GSPO", kl_loss_coef=0.04), 2e-3,
                    ("kl_loss_coef 0.05", ours("gspo", "GSPO", kl_loss_coef=0.05))),
        # noise 1: some ratios above the cap 5 (log 5 = 1.61)
        "cispo": (lambda: GRPOTrainer, dict(loss_type="cispo", epsilon_high=5.0, beta=0.0), ours("cispo", "CISPO"),
                  1.0, ("cap 4 (clip_high 3)", ours("cispo", "CISPO", clip_high=3.0))),
        "sapo": (lambda: GRPOTrainer, dict(loss_type="sapo", sapo_temperature_pos=1.0, sapo_temperature_neg=1.05,
                                           beta=0.0), ours("sapo", "SAPO"), 0.5,
                 ("tau_neg 1.0", ours("sapo", "SAPO", tau_neg=1.0))),
        # noise 0.5: some token log-ratios past +-0.4
        "gmpo": (gmpo_trainer, dict(epsilon=0.4, beta=0.0), ours("gmpo", "GMPO"), 0.5,
                 ("log clip 0.3", ours("gmpo", "GMPO", log_clip_low=0.3, log_clip_high=0.3))),
    }


def trl_config(name: str, kwargs: dict):
    import tempfile

    from trl import GRPOConfig
    from trl.experimental.gmpo import GMPOConfig

    cls = GMPOConfig if name.startswith("gmpo") else GRPOConfig
    return cls(output_dir=tempfile.mkdtemp(), use_cpu=True, bf16=False, report_to=[], **kwargs)


def run_case(name: str, spec, args) -> dict:
    trainer_factory, kwargs, algo_factory, scale, (control_name, control_factory), *rest = spec
    options = rest[0] if rest else {}
    try:
        algo, control, trainer_cls = algo_factory(), control_factory(), trainer_factory()
    except ImportError as e:  # a plugin not written yet
        return {"error": f"{type(e).__name__}: {e}"}
    config = trl_config(name, kwargs)
    out = {"trl": kwargs, "ours": {"algorithm": type(algo).__name__, **algo.config.model_dump()}}
    for dtype in (torch.float32, torch.float64):
        worst = defaultdict(float)
        metrics = []
        for seed in range(args.seeds):
            t = shared_tensors(seed, args.batch, args.width, scale, dtype, options.get("extreme", False))
            trl_value, trl_grad = trl_loss(trainer_cls, config, t, options.get("sampler"))
            our_value, our_grad, m = our_loss(algo, t, options.get("correction"))
            control_value, control_grad, _ = our_loss(control, t, options.get("correction"))
            for key, value in {
                "loss_abs_diff": (trl_value - our_value).abs(), "grad_abs_diff": (trl_grad - our_grad).abs().max(),
                "loss_abs": trl_value.abs(), "grad_abs_max": trl_grad.abs().max(),
                "control_loss_abs_diff": (trl_value - control_value).abs(),
                "control_grad_abs_diff": (trl_grad - control_grad).abs().max(),
            }.items():
                worst[key] = max(worst[key], value.item())
            metrics.append(m)
        out[str(dtype).removeprefix("torch.")] = dict(worst)
    out["control"] = control_name
    # how much the clip touched (ours, float64 draws): mean over seeds of each metric
    out["our_metrics_mean"] = {k: sum(m[k] for m in metrics) / len(metrics) for k in metrics[0]}
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--width", type=int, default=16)
    p.add_argument("--cases", nargs="*", default=None, help="names from cases(); default all")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' deprecations in TrainingArguments
    import trl

    all_cases = cases()
    result = {"trl": trl.__version__, "torch": torch.__version__, "seeds": args.seeds, "batch": args.batch,
              "width": args.width, "cases": {}}
    for name in args.cases or all_cases:
        result["cases"][name] = run_case(name, all_cases[name], args)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    failed = [n for n, c in result["cases"].items() if "error" in c]
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
