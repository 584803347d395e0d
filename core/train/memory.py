"""Each training stage's memory per GPU, from DeepSpeed's own ZeRO estimators, before any weights load.

`alignflow validate` prints it so that a user learns that a 7B stage will not fit before any compute.
The parameter counts come from the model's config alone: the model is built on the `meta` device
(no storage, no download), from a local folder, `builtin:tiny`, or a hub id whose config is already in
the local Hugging Face cache; anything else is "not estimated", with why.

What is counted, per GPU:
- the trained models' states (16-bit weights, gradients, fp32 master weights, Adam's two moments),
  by `estimate_zero2_model_states_mem_needs` (ZeRO 0-2: stage_1_and_2.py) or
  `estimate_zero3_model_states_mem_needs` (stage3.py), the functions behind DeepSpeed's
  `estimate_zero{2,3}_model_states_mem_needs_all_cold`, with their default 1.5 CPU buffer factor and
  `zero_init=False` (stages load with `from_pretrained`, not under `deepspeed.zero.Init`). ZeRO-0
  partitions nothing: the ZeRO-2 formula on one GPU (2 + 18 bytes a parameter). ZeRO-1 uses the same
  estimator as ZeRO-2 (DeepSpeed has none of its own); it keeps whole gradients, up to 2 bytes a
  parameter more. The estimators assume 16-bit weights with fp32 master copies (`precision: bf16`); a stage
  with fp32 weights (`fp32`, `bf16-mixed`, and `auto`, which resolves to one of them) needs more, which the line
  says rather than counts (bf16-mixed's autocast also holds bf16 copies of the weights during a forward).
- frozen models (reference, teacher): their weights in the stage's weight dtype (bf16 only for `precision: bf16`,
  fp32 otherwise, so `auto` is counted as fp32, never less than it resolves to), split over the ranks at ZeRO-3,
  none on the GPU when ZeRO-3 offloads parameters.
- not counted: activations (they depend on sequence length, micro-batch and checkpointing) and a
  colocated vLLM sampler, which takes its `gpu_memory_utilization` share of the device on top
  (unless `sleep` frees it while the trainer steps).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from alignflow.core.errors import AlignflowError, SpecError
from alignflow.core.spec.kinds import TRAINING_KINDS, VALUE_HEAD_KINDS, stage_kind
from alignflow.core.spec.stage import resolve_input

GIB = 2**30
STAGE_REF = "stage:"
BUILTIN = "builtin:"


@dataclass(frozen=True)
class Counts:
    """Parameters of one model, shared (tied) ones once, and of its largest module (ZeRO-3 gathers one at a time)."""

    total: int
    largest_layer: int


@dataclass
class StageMemory:
    """One training stage's estimate; `why` is set (and the byte counts 0) when it could not be made."""

    stage: str
    kind: str
    zero_stage: int
    offload_optimizer: str
    offload_params: str
    gpus_per_node: int
    nodes: int
    precision: str  # the setting: auto, fp32, bf16-mixed or bf16
    trained: dict[str, Counts] = field(default_factory=dict)  # policy / critic / reward model -> counts
    frozen: dict[str, Counts] = field(default_factory=dict)  # reference / teacher -> counts
    states_gpu: int = 0  # bytes per GPU of the trained models' states (DeepSpeed's estimators)
    states_cpu: int = 0  # bytes per node of CPU memory, by the same estimators
    frozen_gpu: int = 0  # bytes per GPU of the frozen models' weights
    sampler_share: float | None = None  # a colocated vLLM engine's gpu_memory_utilization
    why: str | None = None

    @property
    def gpu(self) -> int:
        """Bytes per GPU before activations and a colocated sampler."""
        return self.states_gpu + self.frozen_gpu

    def line(self) -> str:
        """One line for `alignflow validate`."""
        if self.why:
            return f"{self.stage}: not estimated: {self.why}"
        ranks = self.gpus_per_node * self.nodes
        offload = [f"{what} on {where}" for what, where in (("optimizer", self.offload_optimizer),
                                                              ("params", self.offload_params)) if where != "none"]
        models = ", ".join(f"{role} {millions(c.total)}" for role, c in self.trained.items())
        text = (f"{self.stage}: {gib(self.gpu)} per GPU = {gib(self.states_gpu)} model states ({models}; "
                f"ZeRO-{self.zero_stage}{', ' + ', '.join(offload) if offload else ''}, {ranks} GPU"
                f"{'s' if ranks > 1 else ''}; DeepSpeed's estimator)")
        if self.frozen:
            text += (f" + {gib(self.frozen_gpu)} frozen "
                     f"{', '.join(f'{role} {millions(c.total)}' for role, c in self.frozen.items())} "
                     f"({'bf16' if self.precision == 'bf16' else 'fp32'})")
        text += f"; CPU {gib(self.states_cpu)} per node; activations not counted"
        if self.precision != "bf16":
            text += f"; precision {self.precision}, fp32 weights: more than this (the estimator assumes 16-bit ones)"
        if self.sampler_share is not None:
            text += f"; plus vLLM's gpu_memory_utilization {self.sampler_share:g} of the GPU"
        return text


def gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def millions(n: int) -> str:
    return f"{n / 1e9:.2f}B params" if n >= 1e9 else f"{n / 1e6:.1f}M params"


def model_states(counts: Counts, zero_stage: int, offload_optimizer: bool, offload_params: bool,
                 gpus_per_node: int = 1, nodes: int = 1) -> tuple[int, int]:
    """(CPU bytes per node, GPU bytes per GPU) of a trained model's states, by DeepSpeed's estimators."""
    from alignflow.core.train import engine  # noqa: F401  chooses DeepSpeed's accelerator before it loads

    if zero_stage == 3:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

        cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
            counts.total, counts.largest_layer, gpus_per_node, nodes, cpu_offload=offload_optimizer,
            cpu_offload_params=offload_params, zero_init=False)
        return cpu, gpu
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    cpu, gpu = estimate_zero2_model_states_mem_needs(counts.total, gpus_per_node, nodes, cpu_offload=offload_optimizer)
    if zero_stage == 0:  # every rank holds everything: one GPU's worth on each (the CPU's per node stands)
        _, gpu = estimate_zero2_model_states_mem_needs(counts.total, 1, 1, cpu_offload=False)
    return cpu, gpu


def count_parameters(source: str | Path, value_head: bool = False, trust_remote_code: bool = False,
                     lora=None) -> Counts:
    """The parameter counts of a causal LM (or its one-output value model) from its config alone; with `lora`
    (core.settings.LoraSettings, r > 0) those of the adapters peft would add, the only ones that train.

    `source`: `builtin:tiny`, a local model folder (or adapters folder: its base), or a hub id whose config is in
    the local cache (never downloaded). Raises AlignflowError saying why when the config cannot be had.
    """
    import torch

    config = model_config(source, trust_remote_code)
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    if value_head:
        config.num_labels = 1
    auto = AutoModelForSequenceClassification if value_head else AutoModelForCausalLM
    with torch.device("meta"):  # shapes only: no storage, no initialisation
        model = auto.from_config(config, trust_remote_code=trust_remote_code)
        if lora is not None:
            from alignflow.core.train.adapters import with_lora

            model = with_lora(model, lora, str(source))

    def counted(p) -> bool:
        return lora is None or p.requires_grad

    # parameters() yields a tied weight once; a module's own (non-recursive) ones are a ZeRO-3 gather unit
    total = sum(p.numel() for p in model.parameters() if counted(p))
    largest = max(sum(p.numel() for p in m.parameters(recurse=False) if counted(p)) for m in model.modules())
    return Counts(total, largest)


def model_config(source: str | Path, trust_remote_code: bool = False):
    """The transformers config of `source`, from disk only."""
    if isinstance(source, str) and source.startswith(BUILTIN):
        return builtin_config(source[len(BUILTIN):])
    from transformers import AutoConfig

    from alignflow.core.train.adapters import ADAPTER_CONFIG, is_adapter_dir

    if is_adapter_dir(source):  # a LoRA stage's output: its base's architecture
        import json

        base = json.loads((Path(source) / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
        if not base:
            raise AlignflowError(f"{Path(source) / ADAPTER_CONFIG}: no base_model_name_or_path")
        return model_config(base, trust_remote_code)

    local = Path(source).is_dir()
    try:
        # local_files_only: a hub id resolves from the cache or fails at once, with no network wait
        return AutoConfig.from_pretrained(str(source), local_files_only=True, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        if local:
            raise AlignflowError(f"{source}: no readable config.json ({first_line(exc)})") from None
        raise AlignflowError(f"{source}: its config is not in the local Hugging Face cache and validate does not "
                             f"download (`hf download {source} config.json` fetches it)") from None


def builtin_config(name: str):
    from transformers import Qwen2Config

    from alignflow.core.train.models import TINY_CONFIG
    from alignflow.core.task.tokenizer import build_char_tokenizer

    if name != "tiny":
        raise AlignflowError(f"unknown built-in model {name!r} (known: tiny)")
    return Qwen2Config(**TINY_CONFIG, vocab_size=len(build_char_tokenizer()))


def first_line(exc: Exception) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def model_input(spec, name: str, key: str) -> str:
    """A stage's `key` input, followed through `stage:NAME` to the model it was trained from: a training
    stage's output has its input model's architecture."""
    value, seen = spec.stages[name].inputs[key], set()
    while value.startswith(STAGE_REF):
        upstream = value[len(STAGE_REF):]
        if upstream in seen or upstream not in spec.stages or "model" not in spec.stages[upstream].inputs:
            raise SpecError(f"inputs.{key}: {value!r} does not lead to a model")
        seen.add(upstream)
        value = spec.stages[upstream].inputs["model"]
    return value


def stage_memory(spec, name: str, resolved, project: Path = Path("."), gpus_per_node: int = 1,
                 nodes: int = 1) -> StageMemory:
    """The estimate for training stage `name` (`resolved`: its blocks) on `gpus_per_node` x `nodes` ranks."""
    stage, s = spec.stages[name], resolved.settings
    memory = StageMemory(spec.label(name), stage.kind, s.zero_stage, s.offload_optimizer, s.offload_params,
                         gpus_per_node, nodes, s.precision)
    algo = resolved.algorithm.obj if resolved.algorithm is not None else None
    lora = getattr(s, "lora", None)
    lora = lora if lora is not None and lora.r > 0 else None
    head = stage.kind in VALUE_HEAD_KINDS
    # role -> (input, value head, LoRA adapters only); frozen role -> input
    trained = {("reward model" if head else "LoRA adapters" if lora else "policy"): ("model", head, lora)}
    if getattr(algo, "requires_critic", False):
        trained["critic"] = ("critic" if "critic" in stage.inputs else "model", True, None)
    frozen = {"base weights": "model"} if lora else {}
    if getattr(algo, "requires_reference", False) and ("reference" in stage.inputs or not lora):
        frozen["reference"] = "reference" if "reference" in stage.inputs else "model"  # LoRA: the base, adapters off
    if getattr(algo, "requires_teacher", False) and "teacher" in stage.inputs:
        frozen["teacher"] = "teacher"
    try:
        def counts(key: str, value_head: bool = False, adapters=None) -> Counts:
            source = resolve_input(model_input(spec, name, key), project)
            return count_parameters(source, value_head, s.model.trust_remote_code, adapters)

        memory.trained = {role: counts(*how) for role, how in trained.items()}
        memory.frozen = {role: counts(key) for role, key in frozen.items()}
    except AlignflowError as exc:
        memory.why = str(exc)
        return memory
    except Exception as exc:  # noqa: BLE001  an estimate is advice: a config transformers cannot build is no crash
        memory.why = f"{type(exc).__name__}: {first_line(exc)}"
        return memory
    offload_opt, offload_params = s.offload_optimizer != "none", s.offload_params != "none"
    for c in memory.trained.values():
        cpu, gpu = model_states(c, s.zero_stage, offload_opt, offload_params, gpus_per_node, nodes)
        memory.states_cpu += cpu
        memory.states_gpu += gpu
    width = 2 if s.weight_dtype == "bf16" else 4
    split = gpus_per_node * nodes if s.zero_stage == 3 else 1  # ZeRO-3 partitions frozen weights too
    if not (s.zero_stage == 3 and offload_params):
        memory.frozen_gpu = sum(width * c.total // split for c in memory.frozen.values())
    if stage_kind(stage.kind).online_sampler and resolved.sampler is not None:  # it lives beside the trainer
        c = resolved.sampler.config
        if getattr(c, "gpu_memory_utilization", None) and not getattr(c, "sleep", False):
            memory.sampler_share = c.gpu_memory_utilization  # vLLM's share of the device
    return memory


def pipeline_memory(spec, resolved: dict, project: Path = Path("."), gpus_per_node: int = 1,
                    nodes: int = 1) -> list[StageMemory]:
    """`stage_memory` of every training stage (`resolved`: {stage: resolved}), in run order; a loop's rounds once
    (they share settings)."""
    seen, out = set(), []
    for name in spec.order():
        label = spec.label(name)
        if spec.stages[name].kind not in TRAINING_KINDS or label in seen:
            continue
        seen.add(label)
        out.append(stage_memory(spec, name, resolved[name], project, gpus_per_node, nodes))
    return out


def parse_size(text: str) -> int:
    """Bytes from `80GiB`, `80GB` (taken as GiB, as nvidia-smi and DeepSpeed print them), `81920MiB`."""
    units = {"gib": GIB, "gb": GIB, "g": GIB, "mib": 2**20, "mb": 2**20, "m": 2**20, "tib": 2**40, "tb": 2**40}
    t = text.strip().lower().replace(" ", "")
    for unit in sorted(units, key=len, reverse=True):
        if t.endswith(unit):
            number = t[: -len(unit)]
            break
    else:
        unit, number = "gib", t
    try:
        value = float(number)
    except ValueError:
        raise AlignflowError(f"--gpu-memory={text!r}: expected a size such as 80GiB or 81920MiB") from None
    if value <= 0:
        raise AlignflowError(f"--gpu-memory={text!r}: expected a size above 0")
    return int(value * units[unit])
