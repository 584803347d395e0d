"""The training engine: DeepSpeed (ZeRO 0-3; fp32, bf16-mixed or bf16) with step-level loss normalisation and resume.

Every stage trains through `Engine`; its loop reads

    engine = Engine.create(model, settings, total_steps, out_dir)
    for step in engine.steps():                       # starts after the last good checkpoint
        norm = engine.step_norm([b["mask"] for b in micro_batches])
        for micro in micro_batches:                   # engine.grad_accum of them on each rank
            engine.backward(aggregate(loss_mat, mask, mode, norm))
        metrics = engine.step()                       # clip, AdamW, schedule: {"lr", "grad_norm"}
        engine.maybe_save(data_state)                 # every settings.save_every steps

Losses arrive already divided by the token/sequence counts of the whole optimizer step on all
ranks, so the engine must neither divide by the accumulation steps nor average over ranks:
`backward` passes `scale_wrt_gas=False` and multiplies by the world size, which cancels
DeepSpeed's mean all-reduce (a power of two in practice, so exactly). The gradient is then the
big-batch gradient, bit for bit up to the reduction order.

DeepSpeed runs everywhere here, CPU included (its CPU accelerator, gloo, torch's AdamW), so
there is no plain-PyTorch path. With bf16, gradients accumulate in bf16 (DeepSpeed's default
`grad_accum_dtype`; its fp32 option is refused at ZeRO-0), so prefer few micro-batches per step.

`Engine.create` resolves `settings.precision` once (core/train/precision.py; `auto` may time a probe step)
into `engine.precision`; under `bf16-mixed` DeepSpeed sees an fp32 model and every forward of the stage runs
in `engine.autocast()`, the frozen models' too.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

if not torch.cuda.is_available():  # choose DeepSpeed's CPU accelerator before it is imported (DeepSpeed reads it)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")


def _import_deepspeed():
    """DeepSpeed without MLflow: its autotuner (never run here) imports MLflow when installed, ~125 MB and 0.7 s in
    every process that trains, while a stage's child process and its ranks log through the pipeline's process."""
    hidden = "mlflow" not in sys.modules
    if hidden:
        sys.modules["mlflow"] = None  # `import mlflow` raises ImportError: DeepSpeed reads that as not installed
    try:
        import deepspeed
    finally:
        if hidden:
            del sys.modules["mlflow"]
    return deepspeed


deepspeed = _import_deepspeed()
from deepspeed.accelerator import get_accelerator  # noqa: E402

from alignflow.core.train import checkpoint, own_group, precision  # noqa: E402
from alignflow.core.train.allocator import keep_freed_memory  # noqa: E402
from alignflow.core.rl.aggregation import StepNorm  # noqa: E402
from alignflow.core.errors import AlignflowError  # noqa: E402
from alignflow.core.servers import free_port  # noqa: E402
from alignflow.core.spec.settings import TrainSettings  # noqa: E402
from alignflow.core.train.optim import ds_config, lr_lambda, optimizer_for  # noqa: E402

log = logging.getLogger(__name__)
logging.getLogger("DeepSpeed").setLevel(logging.WARNING)  # it logs its whole config at INFO


def init_distributed() -> None:
    """Join the launcher's process group, or form a one-process group when run without a launcher."""
    if dist.is_initialized():
        return
    own_group.drop()  # variables a parent set for its own group are not a launcher's
    if "RANK" not in os.environ:
        # torch.distributed's env:// rendezvous reads these (this process is its own launcher); the mark tells
        # the processes started from here that they are not a launcher's (core/train/own_group.py)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                          LOCAL_RANK="0")
        own_group.mark()
    if torch.cuda.is_available():  # one GPU per rank, before NCCL picks device 0 for every rank
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))  # the launcher's (or ours, above)
    else:
        # On the CPU DeepSpeed JIT-compiles its shared-memory all-reduce (deepspeed_shm_comm) as a group forms:
        # 46 s to 5 minutes on a fresh machine, under a lock in ~/.cache/torch_extensions that every environment
        # shares (a build that died left it held, and every later run waited forever). Only its inference
        # all-reduce uses that op; training's all-reduces are torch.distributed's (gloo).
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    # destroyed at exit, as torch asks: gloo threads left to the teardown once aborted a finished rank (exit -6)
    atexit.register(lambda: dist.is_initialized() and dist.destroy_process_group())


class Engine:
    """One trainable model: optimizer, schedule, accumulation, data parallelism and checkpoints."""

    def __init__(self, ds, settings: TrainSettings, total_steps: int, out_dir: Path | None,
                 resolved: precision.Resolved | None = None):
        self.ds = ds
        self.settings = settings
        resolved = resolved or precision.Resolved(settings.weight_dtype, None, "")
        self.precision = resolved.precision  # fp32, bf16-mixed or bf16: settings.precision resolved
        self.precision_probe_s = resolved.probe_s  # the auto probe's median step seconds, None without one
        self.total_steps = total_steps
        self.out_dir = out_dir
        self.step_count = 0  # completed optimizer steps
        self.data_state: dict | None = None  # the caller's data position at the resumed step
        self._grad_norm = math.nan
        self._backwards = 0  # since the last step

    @classmethod
    def create(
        cls,
        model: torch.nn.Module,
        settings: TrainSettings,
        total_steps: int,
        out_dir: str | Path | None = None,
        *,
        resume: bool | int = True,
        auto_precision: str | None = None,
    ) -> "Engine":
        """Wrap `model` in DeepSpeed and resume from `out_dir`'s latest good checkpoint.

        `resume=True` takes the newest valid checkpoint, an int takes exactly that step (e.g. a critic
        follows its policy's step), False or 0 starts fresh. `auto_precision`: what `precision: auto` becomes
        (the run's `RunOptions.auto_precision`), None to decide from the hardware.
        """
        init_distributed()
        if get_accelerator().device_name() == "cpu":
            keep_freed_memory()  # no page faults for the activations each micro-batch frees and allocates again
        resolved = resolve_precision(settings, model, auto_precision)
        config = ds_config(settings, dist.get_world_size(), sum(p.numel() for p in model.parameters()))
        # ZeRO-0 fp32 (bf16-mixed too: fp32 weights) steps our torch AdamW directly and DeepSpeed drops the norm
        # it clips by: clip in the optimizer's pre-step hook instead, after DeepSpeed's all-reduce
        clip_here = settings.zero_stage == 0 and settings.precision != "bf16"
        if clip_here:
            config["gradient_clipping"] = 0.0
        optimizer = optimizer_for(model, settings)
        schedule = lr_lambda(settings.lr_scheduler, total_steps, settings.warmup_ratio)
        ds, *_ = deepspeed.initialize(
            model=model,
            optimizer=optimizer,
            config=config,
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, schedule),
        )
        engine = cls(ds, settings, total_steps, Path(out_dir) if out_dir is not None else None, resolved)
        if clip_here:
            optimizer.register_step_pre_hook(engine._clip)
            if dist.get_world_size() == 1:  # else DeepSpeed flattens, "all-reduces" and copies back every gradient
                ds.enable_backward_allreduce = False
        if engine.out_dir is not None and resume is not False:
            engine.resume(None if resume is True else int(resume))
        return engine

    # -- the loop ------------------------------------------------------------------------------

    @property
    def model(self):
        """The wrapped model: call it for the forward pass."""
        return self.ds

    def autocast(self):
        """The context every forward of the stage runs in: bf16 autocast under bf16-mixed, else nothing."""
        return precision.autocast(self.precision, self.device)

    def match(self, model):
        """A frozen model (reference, teacher) made to attend as the policy does (see `fit_attention`)."""
        return precision.match_attention(model, self.module)

    def fingerprint(self) -> dict:
        """The precision entries of the stage's manifest fingerprint: resolved, as set, the probe's seconds."""
        return {"precision": self.precision, "precision_setting": self.settings.precision,
                "precision_probe_s": self.precision_probe_s}

    @property
    def module(self) -> torch.nn.Module:
        return self.ds.module

    @property
    def device(self) -> torch.device:
        return self.ds.device

    @property
    def world_size(self) -> int:
        return dist.get_world_size()

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def grad_accum(self) -> int:
        """Micro-batches per optimizer step on each rank."""
        return self.ds.gradient_accumulation_steps()

    def steps(self) -> Iterator[int]:
        """Yield the 0-based indices of the steps left to train, from the resumed one on."""
        for s in range(self.step_count, self.total_steps):
            yield s
            if self.step_count != s + 1:
                raise AlignflowError(f"step {s}: call engine.step() exactly once per step")

    def step_norm(self, masks: list[torch.Tensor], constant: float | None = None) -> StepNorm:
        """Token and sequence counts of this step's micro-batches, summed over all ranks."""
        local = StepNorm.of(masks, constant)
        # on the engine's device: NCCL reduces only CUDA tensors (gloo takes CPU ones)
        counts = torch.tensor([local.num_tokens, local.num_seqs], dtype=torch.float64, device=self.device)
        if self.world_size > 1:
            dist.all_reduce(counts)
        return StepNorm(counts[0].item(), counts[1].item(), constant)

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate the gradient of a loss already normalised for the whole step on all ranks."""
        self.ds.backward(loss * self.world_size, scale_wrt_gas=False)
        self._backwards += 1

    def step(self) -> dict[str, float]:
        """Clip, update and advance the schedule; returns the lr used and the pre-clip grad norm.

        A step without any backward (e.g. an RL batch filtered to nothing, alike on every rank)
        only advances the schedule: ZeRO 1-3 cannot step without gradients.
        """
        lr = self.ds.get_lr()[0]
        self.step_count += 1
        if self._backwards == 0:
            with warnings.catch_warnings():  # torch warns of a schedule step before any optimizer step
                warnings.simplefilter("ignore", UserWarning)
                self.ds.lr_scheduler.step()
            return {"lr": lr, "grad_norm": 0.0}
        self._backwards = 0
        self.ds.step()
        norm = self.ds.get_global_grad_norm()  # None at ZeRO-0 fp32, where _clip measured it
        return {"lr": lr, "grad_norm": float(norm) if norm is not None else self._grad_norm}

    def _clip(self, optimizer, args, kwargs) -> None:
        """Clip the (already all-reduced, so global) gradients by norm and remember the norm."""
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        max_norm = self.settings.grad_clip if self.settings.grad_clip > 0 else math.inf
        self._grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm).item()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's weights on CPU, gathered from ZeRO-3 shards; all ranks call it."""
        params = list(self.module.parameters())
        with deepspeed.zero.GatheredParameters(params, enabled=self.settings.zero_stage == 3):
            return {k: v.detach().cpu().clone() for k, v in self.module.state_dict().items()}

    # -- checkpoints ---------------------------------------------------------------------------

    @property
    def checkpoint_dir(self) -> Path:
        if self.out_dir is None:
            raise AlignflowError("this engine has no out_dir to keep checkpoints in")
        return self.out_dir / "checkpoints"

    def maybe_save(self, data_state: dict | None = None) -> Path | None:
        """Save every `settings.save_every` steps and after the last one; returns the folder saved."""
        if self.out_dir is None:
            return None
        if self.step_count % self.settings.save_every and self.step_count != self.total_steps:
            return None
        return self.save(data_state)

    def save(self, data_state: dict | None = None) -> Path:
        """Checkpoint weights, optimizer, schedule, RNG, step and the caller's data position now."""
        return checkpoint.save(self.ds, self.checkpoint_dir, self.step_count, data_state)

    def resume(self, step: int | None = None) -> bool:
        """Load the newest good checkpoint (or exactly `step`); False when there is none."""
        if step == 0:
            return False
        path = checkpoint.find(self.checkpoint_dir, step)
        if path is None:
            return False
        state = checkpoint.load(self.ds, path)
        self.step_count, self.data_state = state["step"], state["data"]
        log.info("resumed %s at step %d", path, self.step_count)
        return True


def resolve_precision(settings: TrainSettings, model: torch.nn.Module, auto: str | None = None) -> precision.Resolved:
    """`settings.precision` resolved for `model` (core/train/precision.py), alike on every rank (rank 0's choice
    where `auto` probed), and logged."""
    resolved = precision.resolve(settings, model, auto)
    if settings.precision == "auto" and dist.get_world_size() > 1:
        shared = [resolved]
        dist.broadcast_object_list(shared, src=0)
        resolved = shared[0]
    attention = precision.fit_attention(model, resolved.precision, settings)
    log.info("precision %s (%s)%s", resolved.precision, resolved.reason,
             f", {attention} attention" if attention else "")
    return resolved


def frozen(model: torch.nn.Module, settings: TrainSettings) -> torch.nn.Module:
    """A reference model: eval mode, no grad, no optimizer, in the training weights' dtype (fp32 under
    bf16-mixed: the caller runs it in the policy engine's `autocast()`, so that both score alike).

    Under ZeRO-3 it is sharded like the policy by a DeepSpeed engine without optimizer; below
    stage 3 DeepSpeed refuses an engine without optimizer and a plain module on the device is
    what ZeRO would hold anyway (every rank keeps full weights).
    """
    init_distributed()
    model.requires_grad_(False).eval()
    if settings.zero_stage == 3:
        config = ds_config(settings, dist.get_world_size(), sum(p.numel() for p in model.parameters()))
        ds, *_ = deepspeed.initialize(model=model, config=config)
        # DeepSpeedEngine.train/eval only reach the inner module and return None; Module.train sets both
        return torch.nn.Module.train(ds, False)
    device = get_accelerator().current_device_name()
    return model.to(device=device, dtype=precision.weight_dtype(settings.precision))
