"""Stage-level settings (optimisation, batching, generation), one pydantic model per stage kind."""

from __future__ import annotations

import string
from typing import Literal

from pydantic import AliasChoices, Field, field_validator, model_validator

from alignflow.core.contracts import PluginConfig


class GenerationSettings(PluginConfig):
    max_new_tokens: int = Field(64, ge=1)  # the most tokens generated per completion
    temperature: float = Field(1.0, ge=0.0)  # 0: greedy
    # nucleus sampling: draw from the fewest tokens whose probability reaches top_p; 1: off
    top_p: float = Field(1.0, gt=0.0, le=1.0)


class ModelOptions(PluginConfig):
    """How a stage loads its models and tokenizer (any transformers checkpoint or hub id)."""

    attn_implementation: str | None = None  # e.g. "sdpa", "eager", "flash_attention_2"; None: transformers' choice
    chat_template: str | None = None  # Jinja text or a file path; None: the tokenizer's own
    trust_remote_code: bool = False  # run a checkpoint's own modelling code (transformers' flag of that name)


def greedy() -> GenerationSettings:
    return GenerationSettings(temperature=0.0)


def greedy_unless_said(value):
    """A partial block of a greedy-by-default field stays greedy: `{max_new_tokens: 128}` must not
    fall back to GenerationSettings' temperature 1.0."""
    if isinstance(value, dict) and "temperature" not in value:
        return {**value, "temperature": 0.0}
    return value


class TrainSettings(PluginConfig):
    """What every training stage shares: the optimiser, schedule, batching and engine."""

    seed: int | None = None  # None: the pipeline's seed
    # how the stage loads its models and tokenizer (`ModelOptions`)
    model: ModelOptions = Field(default_factory=ModelOptions)
    epochs: float = Field(1.0, gt=0.0)  # passes over the training rows; a fraction stops part-way
    max_steps: int | None = Field(None, ge=1)  # optimizer steps; overrides epochs when set
    lr: float = Field(1e-4, ge=0.0)  # a pipeline spec also refuses 0 (it trains nothing); tests freeze with it
    # after the warmup: constant, or linear or cosine decay to 0 at the last step
    lr_scheduler: Literal["constant", "linear", "cosine"] = "cosine"
    warmup_ratio: float = Field(0.0, ge=0.0, le=1.0)  # share of the steps over which the lr rises linearly to `lr`
    weight_decay: float = 0.0  # decoupled (AdamW) or L2 (sgd) weight decay
    optimizer: Literal["adamw", "sgd"] = "adamw"  # torch's AdamW (fused where the device has it) or SGD with `momentum`
    momentum: float = Field(0.0, ge=0.0, lt=1.0)  # sgd only
    batch_size: int = Field(16, ge=1)  # sequences per optimizer step, all ranks together
    micro_batch_size: int = Field(16, ge=1)  # sequences per forward pass on one rank
    # tokens of prompt and completion; the completion is cut, a row whose prompt fills it dropped
    max_length: int = Field(512, ge=8)
    grad_clip: float = 1.0  # the gradients' global norm is clipped to this; 0: no clipping
    # DeepSpeed ZeRO: 1 partitions optimizer states over ranks, 2 also gradients, 3 also weights
    zero_stage: Literal[0, 1, 2, 3] = 0
    # ZeRO-Offload (arXiv 2101.06840) / ZeRO-Infinity (arXiv 2104.07857): keep the fp32 master weights,
    # gradients and Adam moments (16 of the 18 bytes a parameter's states cost under bf16) in CPU memory and
    # step them there; `offload_params` also keeps the 16-bit weights on the CPU between uses (ZeRO-3 only,
    # and with the optimizer offloaded). DeepSpeed's `device: none|cpu` values.
    offload_optimizer: Literal["none", "cpu"] = "none"  # cpu: optimizer states on the CPU (zero_stage 1-3)
    offload_params: Literal["none", "cpu"] = "none"  # cpu: weights on the CPU too (zero_stage 3, optimizer offloaded)
    # fp32; bf16-mixed: fp32 weights and optimizer, forwards under bf16 autocast; bf16: DeepSpeed's bf16 mode
    # (bf16 weights); auto: bf16-mixed where the hardware multiplies bf16 and it pays, else fp32
    # (core/train/precision.py). `dtype: fp32|bf16` is the old spelling of `precision: fp32|bf16`.
    precision: Literal["auto", "fp32", "bf16-mixed", "bf16"] = "auto"
    save_every: int = Field(50, ge=1)  # optimizer steps between resumable checkpoints
    log_every: int = Field(10, ge=1)  # optimizer steps between metric logs
    eval_fraction: float = Field(0.0, ge=0.0, lt=1.0)  # training rows held out for the held-out loss
    eval_limit: int | None = Field(None, ge=1)  # eval_dataset prompts scored at the end (None: all)
    # how `eval_dataset` prompts are sampled at the end; greedy unless given a temperature
    eval_generation: GenerationSettings = Field(default_factory=greedy)

    _greedy_eval = field_validator("eval_generation", mode="before")(greedy_unless_said)

    @model_validator(mode="before")
    @classmethod
    def _dtype_is_precision(cls, data):
        """`dtype` (fp32 or bf16), the old spelling, becomes `precision`; both given and different is an error."""
        if not isinstance(data, dict) or "dtype" not in data:
            return data
        data = dict(data)
        dtype = data.pop("dtype")
        if dtype not in ("fp32", "bf16"):
            raise ValueError(f"dtype: {dtype!r} is not fp32 or bf16 (`dtype` is the old spelling of `precision`, "
                             "which also takes auto and bf16-mixed)")
        if data.get("precision", dtype) != dtype:
            raise ValueError(f"dtype: {dtype} and precision: {data['precision']} disagree (`dtype` is the old "
                             "spelling of `precision`): give only precision")
        data["precision"] = dtype
        return data

    @property
    def weight_dtype(self) -> Literal["fp32", "bf16"]:
        """The dtype models load in: bf16 for `precision: bf16`, else fp32 (bf16-mixed keeps fp32 weights)."""
        return "bf16" if self.precision == "bf16" else "fp32"

    @field_validator("offload_optimizer")
    @classmethod
    def _offload_needs_zero(cls, value: str, info) -> str:
        if value != "none" and info.data.get("zero_stage") == 0:
            raise ValueError(f"offload_optimizer: {value} needs zero_stage 1, 2 or 3 (ZeRO-0 keeps the optimizer "
                             "on the GPU); got zero_stage 0")
        return value

    @field_validator("offload_params")
    @classmethod
    def _offload_params_needs_zero3(cls, value: str, info) -> str:
        if value == "none":
            return value
        stage = info.data.get("zero_stage")
        if stage is not None and stage != 3:
            raise ValueError(f"offload_params: {value} needs zero_stage 3 (only ZeRO-3 partitions the weights); "
                             f"got zero_stage {stage}")
        if info.data.get("offload_optimizer", "none") == "none":
            raise ValueError(f"offload_params: {value} needs offload_optimizer: {value} too (the optimizer's "
                             "16 bytes a parameter would stay on the GPU to save its 2)")
        return value

    def batch_problem(self) -> str | None:
        """What keeps an optimizer step's `batch_size` from splitting into whole micro-batches; None if nothing."""
        return self.micro_problem(self.batch_size)

    def micro_problem(self, size: int) -> str | None:
        if size % self.micro_batch_size:
            return f"{size} must be a multiple of micro_batch_size={self.micro_batch_size}"
        return None


class LoraSettings(PluginConfig):
    """LoRA adapters (Hu et al. 2021, arXiv 2106.09685) on the policy, through `peft`: each targeted weight W
    becomes W + (alpha / r) B A with B [out, r] (zero at start) and A [r, in] the only trained tensors, so the
    stage starts from the base model's outputs exactly. The reference of preference and rl stages is then the
    base itself (the adapters switched off), not a second copy of the weights."""

    r: int = Field(0, ge=0)  # adapter rank; 0: no adapters, every weight trains
    alpha: float | None = Field(None, gt=0.0)  # None: alpha = r, scale 1 (Hu et al. set alpha to the first r tried)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)  # on the adapter's input; peft's default 0
    # peft's "all-linear": every linear layer but the output head (QLoRA, arXiv 2305.14314: adapters on all
    # linear layers are needed to match full fine-tuning), or a list of module names (q_proj, v_proj, ...)
    target_modules: str | list[str] = "all-linear"
    # true: the `model` output is the merged full checkpoint (the adapters in its adapter/ folder); false: the
    # adapters themselves, which load as their base (adapter_config.json's base_model_name_or_path) plus them
    merge: bool = False


class PolicySettings(TrainSettings):
    """Training stages of a causal-LM policy (`sft`, `preference`, `rl`), which may train LoRA adapters only."""

    lora: LoraSettings = Field(default_factory=LoraSettings)  # adapters instead of every weight; off (r 0)


class RLSettings(PolicySettings):
    """Online RL: `max_steps` counts rollouts; `batch_size`/`micro_batch_size` count sequences."""

    prompts_per_step: int = Field(16, ge=1)  # prompts drawn for each rollout, each sampled `group_size` times
    group_size: int = Field(8, ge=1)  # G completions per prompt
    ppo_epochs: int = Field(1, ge=1)  # mu: update passes over each rollout batch
    batch_size: int | None = Field(None, ge=1)  # sequences per optimizer step; None: the whole rollout
    lr: float = Field(1e-6, ge=0.0)  # lower than the training stages' default: RL moves a trained policy
    # RL's default keeps the lr flat after the warmup
    lr_scheduler: Literal["constant", "linear", "cosine"] = "constant"
    # how the rollouts are sampled (temperature 1 by default)
    generation: GenerationSettings = Field(default_factory=GenerationSettings)
    max_steps: int | None = Field(None, ge=1)  # rollouts (generate, score, update); overrides epochs when set
    save_every: int = Field(50, ge=1)  # rollouts between resumable checkpoints
    log_every: int = Field(1, ge=1)  # rollouts between metric logs
    eval_every: int = Field(0, ge=0)  # rollouts between held-out evaluations (0: only at the end)
    critic_lr: float | None = None  # None: lr
    # A no-grad forward for pi_old instead of the sampler's log-probs: for samplers whose numerics
    # differ from the trainer's (vLLM, bf16); on CPU in fp32 the sampler's are the same distribution.
    # Rows replayed from earlier steps (offpolicy_grpo) keep the pi_old they had when fresh.
    recompute_old_logprobs: bool = False
    # Truncated importance sampling (Yao et al. 2025, "Your efficient RL framework secretly brings you
    # off-policy RL training"): each token's policy loss is weighted by min(pi_old / mu, tis_cap), mu the
    # sampler's probability and pi_old the trainer's (recomputed), which corrects the rollout/trainer
    # mismatch; a KL-to-reference term is not weighted (as TRL, verl); None: no correction. The paper (and TRL,
    # verl) use 2.
    tis_cap: float | None = Field(None, gt=0.0)
    # IcePop (inclusionAI's Ring team, 2025; the Ring-1T report, arXiv 2510.18855): each token's policy loss is
    # weighted by k = pi_old / mu where alpha <= k <= beta and by 0 outside: the tokens on which trainer and
    # sampler disagree that much are dropped rather than capped as `tis_cap` does (they still count in the
    # loss's token count, as in verl, OpenRLHF and AReaL); a KL-to-reference term is not weighted. [alpha, beta];
    # [0.5, 5] in the report and all three. None: off. Not with `tis_cap`.
    icepop: tuple[float, float] | None = None

    @field_validator("icepop")
    @classmethod
    def _band(cls, band):
        if band is not None and not 0 <= band[0] <= 1 <= band[1]:
            raise ValueError(f"icepop: expected [alpha, beta] with 0 <= alpha <= 1 <= beta, got {list(band)}")
        return band

    @model_validator(mode="after")
    def _one_correction(self):
        if self.icepop is not None and self.tis_cap is not None:
            raise ValueError("icepop and tis_cap both correct the sampler/trainer mismatch: set one of them")
        return self
    # The trainer's forwards (policy, pi_old, reference) pack each micro-batch's sequences end to end
    # into as few rows as hold them, instead of padding every row to the longest: same log-probs, less
    # compute. Models whose attention cannot separate packed sequences fall back to padding.
    pack_sequences: bool = True
    # Asynchronous rollouts: a worker process (`async_threads` torch threads) generates the first round of the
    # next `max_staleness` steps while this one scores and trains, so no step's rollout was generated more than
    # `max_staleness` updates before the update that uses it (docs: Asynchronous RL). 0: synchronous. auto: on
    # where the worker gets cores of its own beside the stage's torch threads (on a CPU, one process, an
    # in-process sampler such as `hf`, ZeRO 0-2); the manifest records what ran. `overlap_rollouts` and
    # `overlap_threads` are the same settings' earlier names.
    async_rollouts: bool | Literal["auto"] = Field("auto", validation_alias=AliasChoices("async_rollouts",
                                                                                          "overlap_rollouts"))
    async_threads: int = Field(1, ge=1,  # the rollout worker's torch threads
                               validation_alias=AliasChoices("async_threads", "overlap_threads"))
    max_staleness: int = Field(1, ge=0)  # k: updates between a rollout's weights and the update using it, at most
    # Which weights the worker generates a step's round on. pinned: those of the update k before it (exactly k
    # stale; runs are reproducible bit for bit). latest: the newest when the round starts (at most k; depends on
    # timing). partial: the newest, and a generation in flight when the trainer publishes new weights stops and
    # continues on them (partial rollouts), every token keeping the version that sampled it.
    async_weights: Literal["pinned", "latest", "partial"] = "pinned"
    # The decoupled PPO objective (Hilton et al. 2022; AReaL, Fu et al. 2025): the ratio is taken against a
    # proximal policy, pi_old recomputed on the weights before the update, and each token's policy term is
    # weighted by pi_old / mu (mu: the behaviour policy that sampled the token, its sampler log-prob). `tis_cap`
    # caps that weight and `icepop` zeroes it outside a band; both imply the decoupled objective.
    decoupled: bool = False

    # How each step's prompts are drawn. "epochs": a seeded permutation per pass over the data, every prompt
    # once per pass. "prioritized": with probability proportional to 1 - s_i, s_i the success rate of prompt i
    # so far in the stage (Kimi k1.5, arXiv 2501.12599, section 2.3.4): prompts always solved are drawn rarely.
    prompt_sampling: Literal["epochs", "prioritized"] = "epochs"

    def batch_problem(self) -> str | None:
        """An optimizer step takes whole groups of a rollout, in whole micro-batches."""
        rollout = self.prompts_per_step * self.group_size
        size = self.batch_size or rollout
        if rollout % size:
            return f"{size} must divide the rollout, prompts_per_step x group_size = {rollout}"
        if size % self.group_size:  # else some of a step's groups are empty
            return f"{size} must be a multiple of group_size={self.group_size} (each optimizer step takes whole groups)"
        return self.micro_problem(size)


class PRMSettings(TrainSettings):
    # Steps are joined with (and each followed by) this text; the step's score is read at its end.
    step_separator: str = Field("\n", min_length=1)


class SelectSettings(PluginConfig):
    seed: int | None = None  # None: the pipeline's seed
    allow_empty: bool = False  # a dataset output of no rows fails the stage unless this is set


class SamplingSettings(PluginConfig):
    """What every stage that samples without training takes."""

    seed: int | None = None  # None: the pipeline's seed
    model: ModelOptions = Field(default_factory=ModelOptions)  # how the stage loads its model and tokenizer
    n: int = Field(4, ge=1)  # completions per prompt
    generation: GenerationSettings = Field(default_factory=GenerationSettings)  # how completions are sampled


def sampled_rows(output: str) -> str:
    """The row schema a `rejection_sampling` stage's dataset holds for its `output`: SPIN's self_play pairs the
    data's own completion with a sample (prompt/completion rows); the others need the answer to judge by."""
    return "sft" if output == "self_play" else "prompt_answer"


class SampleSettings(SamplingSettings):
    # rejection sampling writes the best correct completion per prompt (sft), a (correct, incorrect) pair,
    # (the data's completion, the model's own sample) for SPIN (self_play, from prompt/completion rows), or a
    # ranked list (lists: the best correct sample, then list_size - 1 distinct lower-scoring ones, best first)
    output: Literal["sft", "pairs", "self_play", "lists"] = "sft"
    pairs_per_prompt: int = Field(1, ge=1)  # pairs: the best correct against up to this many distinct incorrect
    list_size: int = Field(4, ge=2)  # lists: completions in each list; prompts with fewer distinct ones are skipped
    allow_empty: bool = False  # no row kept fails the stage unless this is set


def critique_rows(rewards: bool) -> str:
    """The row schema a `critique_revise` stage's dataset holds: prompts, and the answer a verifier judges
    by when the stage lists rewards (as `rejection_sampling` reads them)."""
    return "prompt_answer" if rewards else "prompt"


# Constitutional AI's critique and revision requests (Bai et al. 2022, arXiv 2212.08073, SL-CAI: "CritiqueRequest:
# Identify specific ways in which the assistant's last response is ...", "RevisionRequest: Please rewrite the
# assistant response to ..."), in its Human/Assistant format, with the drawn principle in place of the paper's
# fixed harmlessness wording.
CRITIQUE_TEMPLATE = (
    "Human: {prompt}\n\nAssistant: {completion}\n\nCritiqueRequest: Identify specific ways in which the "
    "assistant's last response does not follow this principle: {principle}\n\nCritique:")
REVISION_TEMPLATE = CRITIQUE_TEMPLATE + (
    " {critique}\n\nRevisionRequest: Please rewrite the assistant response so that it follows this principle: "
    "{principle}\n\nRevision:")
TEMPLATE_FIELDS = {"critique_template": ("prompt", "completion", "principle"),
                   "revision_template": ("prompt", "completion", "principle", "critique")}


class CritiqueSettings(SamplingSettings):
    """Constitutional AI's critique -> revision loop (SL-CAI, Bai et al. 2022, arXiv 2212.08073)."""

    n: int = Field(1, ge=1)  # answers per prompt, each critiqued and revised on its own
    revisions: int = Field(1, ge=1)  # critique/revision rounds, each under a principle drawn anew
    critique_template: str = CRITIQUE_TEMPLATE  # fields {prompt} {completion} {principle}
    revision_template: str = REVISION_TEMPLATE  # fields {prompt} {completion} {principle} {critique}
    # pairs: (prompt, chosen = final revision, rejected = original) for DPO, equal ones dropped; sft: the revision
    output: Literal["pairs", "sft"] = "pairs"
    keep: Literal["all", "improved"] = "all"  # improved: only rows whose revision the rewards score higher
    allow_empty: bool = False  # no row kept fails the stage unless this is set

    @field_validator("critique_template", "revision_template")
    @classmethod
    def _known_fields(cls, value: str, info) -> str:
        allowed = TEMPLATE_FIELDS[info.field_name]
        try:
            names = [name for _, name, _, _ in string.Formatter().parse(value) if name is not None]
        except ValueError as exc:
            raise ValueError(f"not a format string: {exc} (write a literal brace as {{{{ or }}}})") from None
        for name in names:
            if name not in allowed:
                raise ValueError(f"unknown field {{{name}}}; expected {', '.join('{%s}' % a for a in allowed)} "
                                 "(write a literal brace as {{ or }})")
        return value


class StepLabelSettings(SamplingSettings):
    """Math-Shepherd step labels: each step prefix of a sampled solution is completed `rollouts` times."""

    n: int = Field(4, ge=1)  # solutions sampled per prompt; each distinct one is labelled
    rollouts: int = Field(8, ge=1)  # completions of each step prefix (Math-Shepherd's N)
    label: Literal["hard", "soft"] = "hard"  # any rollout correct, or the share that is
    step_separator: str = Field("\n", min_length=1)  # the text between a solution's steps: each step prefix ends at one
    allow_empty: bool = False  # no row written fails the stage unless this is set


class EvaluateSettings(SamplingSettings):
    k: list[int] = Field(default_factory=lambda: [1])  # pass@k for each k <= n
    n: int = Field(1, ge=1)  # completions per prompt; pass@k needs k <= n
    generation: GenerationSettings = Field(default_factory=greedy)  # greedy unless the block gives a temperature
    _greedy = field_validator("generation", mode="before")(greedy_unless_said)
    limit: int | None = Field(None, ge=1)  # score only the first `limit` prompts
    group_by: str | None = "level"  # a column to report accuracy per value of, when rows have it
    # best-of-n: for each reward named here, the accuracy of the completion it scores highest per prompt
    best_of: list[str] = Field(default_factory=list)
