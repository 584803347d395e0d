"""The engine gives exactly the big-batch gradient under accumulation, data parallelism and ZeRO-2."""

from __future__ import annotations

import copy
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from helpers import engine_worker as worker
from alignflow.core.rl.aggregation import MODES, StepNorm, aggregate
from alignflow.core.train.engine import Engine, frozen
from alignflow.core.train.optim import lr_lambda
from alignflow.core.errors import AlignflowError
from alignflow.core.spec.settings import TrainSettings

WORKER = Path(worker.__file__)


def qwen2() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    )
    return transformers.Qwen2ForCausalLM(config).float()


def launch(world: int, out: Path, *args: str) -> list[subprocess.Popen]:
    """Start `world` worker processes forming one gloo group, as torchrun would."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(world):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                   LOCAL_RANK=str(rank), WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, str(WORKER), str(out), *args], env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    return procs


def finish(procs: list[subprocess.Popen], out: Path) -> dict:
    try:
        for p in procs:
            _, err = p.communicate(timeout=600)  # generous: a loaded machine, not a hang, is the usual cause
            assert p.returncode == 0, err[-3000:]
    finally:  # a timed-out or failed rank never outlives the test
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return torch.load(out / "result.pt", weights_only=False)


def test_lr_schedules_warm_up_then_decay():
    warm = lr_lambda("cosine", total_steps=10, warmup_ratio=0.2)  # 2 warmup steps
    assert [warm(s) for s in range(3)] == pytest.approx([1 / 3, 2 / 3, 1.0])
    assert warm(6) == pytest.approx(0.5)  # half-way through the 8 decay steps
    assert lr_lambda("linear", 10, 0.0)(5) == pytest.approx(0.5)
    assert lr_lambda("constant", 10, 0.0)(9) == 1.0


def test_batch_must_split_into_micro_batches():
    with pytest.raises(AlignflowError, match="batch_size=10"):
        Engine.create(torch.nn.Linear(2, 2), TrainSettings(batch_size=10, micro_batch_size=4), 1)


@pytest.mark.parametrize("mode", MODES)
def test_accumulated_gradient_equals_big_batch(mode):
    """Four micro-batches of uneven masks give the gradient of one batch four times as large."""
    model = qwen2().to(worker.DEVICE)
    reference = copy.deepcopy(model)
    ids, mask = worker.dataset(16)
    adv = torch.randn(16).to(worker.DEVICE)
    constant = float(mask.shape[1])  # seq-mean-token-sum-norm: the generation budget T

    big = aggregate(worker.per_token_loss(reference, ids, adv), mask, mode, StepNorm.of([mask], constant))
    big.backward()

    settings = TrainSettings(batch_size=16, micro_batch_size=4, grad_clip=0.0, lr=1e-3)
    engine = Engine.create(model, settings, total_steps=1, auto_precision="fp32")
    assert engine.grad_accum == 4
    seen = worker.grad_capture(engine)
    micros = torch.arange(16).split(4)
    norm = engine.step_norm([mask[m] for m in micros], constant)
    for m in micros:
        engine.backward(aggregate(worker.per_token_loss(engine.model, ids[m], adv[m]), mask[m], mode, norm))
    engine.step()

    for name, p in reference.named_parameters():
        torch.testing.assert_close(seen[name], p.grad, rtol=1e-5, atol=1e-7, msg=f"{mode}: {name}")
    # the check has teeth: normalising by each micro-batch's own counts gives another loss
    with torch.no_grad():
        wrong = sum(aggregate(worker.per_token_loss(reference, ids[m], adv[m]), mask[m], mode,
                              StepNorm.of([mask[m]], constant)) for m in micros)
    assert not math.isclose(wrong.item(), big.item(), rel_tol=1e-2)


def test_step_reports_lr_and_grad_norm_and_clips():
    model = torch.nn.Linear(4, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    settings = TrainSettings(batch_size=2, micro_batch_size=2, lr=0.5, lr_scheduler="linear", grad_clip=1.0)
    engine = Engine.create(model, settings, total_steps=2, auto_precision="fp32")
    x = torch.tensor([[3.0, 0, 0, 4], [3.0, 0, 0, 4]], device=engine.device)
    engine.backward(engine.model(x).sum() / 2)  # gradient (3, 0, 0, 4): norm 5, clipped to 1
    metrics = engine.step()
    assert metrics["lr"] == pytest.approx(0.5) and metrics["grad_norm"] == pytest.approx(5.0)
    assert engine.step()["lr"] == pytest.approx(0.25)  # linear decay: half-way at step 1


@pytest.mark.parametrize("zero", [0, 2])
def test_sgd_takes_the_plain_gradient_step(zero):
    """optimizer: sgd moves w by -lr * g (after clipping), under ZeRO as without it."""
    model = torch.nn.Linear(4, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    settings = TrainSettings(batch_size=2, micro_batch_size=2, lr=0.1, lr_scheduler="constant",
                             optimizer="sgd", grad_clip=10.0, zero_stage=zero)
    engine = Engine.create(model, settings, total_steps=1, auto_precision="fp32")
    x = torch.tensor([[3.0, 0, 0, 4], [3.0, 0, 0, 4]], device=engine.device)
    engine.backward(engine.model(x).sum() / 2)  # gradient (3, 0, 0, 4)
    engine.step()
    torch.testing.assert_close(engine.module.weight.detach().cpu(), torch.tensor([[-0.3, 0.0, 0.0, -0.4]]))


@pytest.mark.parametrize("zero", [0, 2])
def test_step_without_backward_only_advances_the_schedule(zero):
    settings = TrainSettings(batch_size=2, micro_batch_size=2, lr=1.0, lr_scheduler="linear", zero_stage=zero)
    engine = Engine.create(torch.nn.Linear(4, 2), settings, total_steps=4, auto_precision="fp32")
    before = engine.full_state_dict()
    assert engine.step() == {"lr": 1.0, "grad_norm": 0.0}
    assert all(torch.equal(w, before[k]) for k, w in engine.full_state_dict().items())
    engine.backward(engine.model(torch.ones(2, 4, device=engine.device)).sum())
    assert engine.step()["lr"] == pytest.approx(0.75)  # the schedule moved on by one step


def test_steps_insists_on_one_optimizer_step_each():
    engine = Engine.create(torch.nn.Linear(2, 2), TrainSettings(batch_size=1, micro_batch_size=1), 3,
                           auto_precision="fp32")
    with pytest.raises(AlignflowError, match="exactly once"):
        for _ in engine.steps():
            pass


@pytest.mark.parametrize("zero", [0, 3])
def test_frozen_reference_has_no_grad(zero):
    model = worker.tiny_model().to(worker.DEVICE)
    ids, _ = worker.dataset(2)
    expected = model(ids).to(torch.bfloat16)
    ref = frozen(model, TrainSettings(dtype="bf16", zero_stage=zero))
    assert not ref.training and all(not p.requires_grad for p in ref.parameters())
    with torch.no_grad():
        out = ref(ids)
    assert out.dtype == torch.bfloat16 and not out.requires_grad
    torch.testing.assert_close(out, expected, rtol=0.05, atol=0.05)  # bf16 weights: 3 significant digits


@pytest.mark.parametrize("zero", [0, 3])
def test_bf16_training_lowers_the_loss(zero):
    model = worker.tiny_model()
    settings = TrainSettings(batch_size=8, micro_batch_size=4, lr=1e-2, dtype="bf16", zero_stage=zero)
    engine = Engine.create(model, settings, total_steps=8)
    ids, mask = worker.dataset(8)
    losses = []
    for _ in engine.steps():
        norm = engine.step_norm([mask[:4], mask[4:]])
        for m in (slice(0, 4), slice(4, 8)):
            per_token = worker.per_token_loss(engine.model, ids[m], torch.ones(4, device=engine.device))
            loss = aggregate(per_token, mask[m], "token-mean", norm)
            engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    assert next(engine.module.parameters()).dtype == torch.bfloat16
    full = engine.full_state_dict()  # gathered from ZeRO-3 shards
    assert {k: v.shape for k, v in full.items()} == {k: v.shape for k, v in worker.tiny_model().state_dict().items()}
    assert losses[-1] < losses[0] - 0.1


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """One launch of 2 ranks runs both multi-rank trainings in turn: data parallel ("dp"), then ZeRO-2 ("zero2").

    `two_ranks(name)` waits for the ranks and gives that run's result; the tests' one-rank references run
    meanwhile, as the ranks do.
    """
    root = tmp_path_factory.mktemp("two-ranks")
    procs = launch(2, root / "dp", "--steps", "2", "--grads", "--then", str(root / "zero2"), "--steps", "4",
                   "--zero", "2")
    done: list[bool] = []

    def result(name: str) -> dict:
        if not done:
            finish(procs, root / "dp")
            done.append(True)
        return torch.load(root / name / "result.pt", weights_only=False)

    yield result
    for p in procs:  # a test that failed before waiting leaves no rank behind
        if p.poll() is None:
            p.kill()
            p.wait()


@pytest.mark.system
def test_two_ranks_equal_one_rank(tmp_path, two_ranks):
    """Data parallel over 2 processes: the gradient the optimizer sees and the weights after it."""
    one = worker.run_here(tmp_path / "one", steps=2, grads=True)  # overlaps with the two processes
    two = two_ranks("dp")
    for name, g in one["grads"].items():
        torch.testing.assert_close(two["grads"][name], g, rtol=1e-6, atol=1e-8)
    for name, w in one["weights"].items():
        torch.testing.assert_close(two["weights"][name], w, rtol=1e-6, atol=1e-8)
    assert two["grad_norms"] == pytest.approx(one["grad_norms"], rel=1e-6)


@pytest.mark.system
def test_zero2_two_ranks_follow_one_rank(tmp_path, two_ranks):
    """ZeRO-2 over 2 processes trains like 1 process on the same global batch.

    The two runs add the same fp32 micro-batch gradients, at most in another order (here they
    agree bit for bit); 1e-5 relative is ~100 ulps of fp32 round-off over 4 Adam steps.
    """
    one = worker.run_here(tmp_path / "one", steps=4, zero=2)
    two = two_ranks("zero2")
    assert len(two["losses"]) == 4
    assert two["losses"] == pytest.approx(one["losses"], rel=1e-5, abs=1e-7)
    for name, w in one["weights"].items():
        torch.testing.assert_close(two["weights"][name], w, rtol=1e-5, atol=1e-7)


COMPILES_NOTHING = """
import torch, transformers
from alignflow.core.train.engine import Engine
from alignflow.core.spec.settings import TrainSettings
torch.manual_seed(0)
model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64,
    num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2))
engine = Engine.create(model, TrainSettings(batch_size=2, micro_batch_size=2), total_steps=1)
ids = torch.randint(0, 64, (2, 8))
engine.backward(engine.model(input_ids=ids, labels=ids).loss)
engine.step()
import deepspeed.comm.comm as comm
print("shm_op", comm.cdb.shm_comm_op)
"""


@pytest.mark.system
def test_a_cpu_engine_compiles_no_deepspeed_op(tmp_path):
    """A fresh machine's first training stage starts at once: no JIT build of DeepSpeed's shared-memory
    all-reduce (46 s to 5 minutes, under a lock every environment shares) into the extensions folder."""
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"), OMP_NUM_THREADS="1")
    env.pop("RANK", None)
    out = subprocess.run([sys.executable, "-c", COMPILES_NOTHING], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "shm_op None" in out.stdout
    assert not (tmp_path / "ext").exists() or not any((tmp_path / "ext").iterdir())


@pytest.mark.system
def test_deepspeed_is_imported_without_mlflow_which_stays_importable():
    """DeepSpeed's autotuner imports MLflow when it is installed; a training process does not need it (a stage's
    child process logs through the pipeline's), so the engine imports DeepSpeed without it."""
    code = ("import sys; import alignflow.core.train.engine; print('mlflow' in sys.modules); "
            "import mlflow; print(mlflow.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.split() == ["False", "mlflow"]
