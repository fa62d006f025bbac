"""The online gradient noise scale against a brute force over per-sample gradients (issue 54, acceptance line 2).

On fixed weights, a fixed set of N words defines the noise scale exactly: with per-sample gradients g_i, the true
gradient is G = mean g_i and the per-sample covariance Σ the population one over the N samples (the online batches
are drawn from them with replacement, so a batch of b has covariance Σ/b exactly), and B_true = tr(Σ)/|G|². The
online side is what a run measures: the real ``single`` strategy, its tap on each micro-batch's gradient and its
step's global norm, read by :class:`~scale_ocr.run.noise_scale.NoiseMeter` in the order the trainer calls it. The
optimizer steps at learning rate 0, so every step sees the same weights the brute force saw.

The models are in eval mode: BatchNorm normalises with its running statistics, so a sample's loss does not depend
on the other samples of its batch, per-sample gradients are well defined, and a batch's gradient is the mean of its
samples' (checked first).
"""

from __future__ import annotations

import json

import pytest
import torch
from torch.func import functional_call, grad

from scale_ocr.config import ModelConfig, OptimConfig, StrategyConfig, TrainConfig
from scale_ocr.data.synthetic import SyntheticWords
from scale_ocr.distributed.process_group import DistInfo
from scale_ocr.optim import OptimizerSpec
from scale_ocr.run.noise_scale import NoiseMeter, NoiseScale, Pair
from scale_ocr.strategies.single import SingleDevice
from scale_ocr.tasks import create_task
from scale_ocr.tasks.recognition import Collate, WordBatch

CPU = torch.device("cpu")
WORDS = 64  # the fixed data set
MICRO, ACCUM = 8, 8  # b_small = 8 samples, b_big = 64: eight micro-batch norms a reading
STEPS = 24  # optimizer steps measured online (seeds 0-2: CRNN 1.03-1.11 of the brute force, ViTSTR 0.97-1.05)
SMOOTHING = 0.99
SEED = 0
MODELS = {
    "crnn": ModelConfig(arch="crnn_mobilenet_v3_small", input_size=(32, 64), vocab="digits"),
    "vitstr": ModelConfig(arch="vitstr_tiny", input_size=(32, 64), vocab="digits", model_width=64, model_depth=2,
                          model_heads=2),
}


def _single(micro: int, accum: int) -> SingleDevice:
    dist = DistInfo(0, 1, 0, 1, CPU, "gloo", "python")
    return SingleDevice(StrategyConfig(), dist, TrainConfig(batch_size=micro, grad_accum=accum),
                        OptimConfig(clip_grad=0.0))


def _words(task, seed: int) -> WordBatch:
    """WORDS synthetic word images of 2-4 digits, as the validation transform prepares them."""
    data = SyntheticWords(task.vocab.chars, WORDS, 2, 4, seed, task.transform(train=False))
    return Collate(task.vocab)([(*data[i], True) for i in range(WORDS)])


def _pick(batch: WordBatch, index: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return batch.images[index], batch.targets[index], batch.target_lengths[index]


def brute_force(model: torch.nn.Module, batch: WordBatch) -> tuple[float, float, torch.Tensor]:
    """|G|², tr(Σ) and G from each sample's own gradient (torch.func), summed as they come: one parameter-sized sum
    and one scalar, never all N gradients at once."""
    params = {k: p.detach() for k, p in model.named_parameters() if p.requires_grad}
    buffers = dict(model.named_buffers())

    def loss(p, images, targets, lengths):
        return functional_call(model, (p, buffers), (images, targets, lengths))["loss"]

    sample_grad = grad(loss)
    total = torch.zeros(sum(p.numel() for p in params.values()), dtype=torch.float64)
    sum_sq = 0.0
    for i in range(WORDS):
        grads = sample_grad(params, *_pick(batch, torch.tensor([i])))
        flat = torch.cat([g.reshape(-1) for g in grads.values()]).double()
        total += flat
        sum_sq += float(flat.square().sum())
    mean = total / WORDS
    grad_sq = float(mean.square().sum())
    return grad_sq, sum_sq / WORDS - grad_sq, mean.float()


def online(strategy: SingleDevice, model: torch.nn.Module, batch: WordBatch, seed: int) -> NoiseMeter:
    """STEPS optimizer steps of ACCUM micro-batches of MICRO words drawn with replacement, measured every step as the
    trainer measures: begin, forward and backward with end_micro after each, end_backward, the strategy's step, and
    record of its global norm."""
    meter = NoiseMeter(strategy, every=1, smoothing=SMOOTHING, micro_batch=MICRO, global_batch=MICRO * ACCUM,
                       device=CPU)
    draw = torch.Generator().manual_seed(seed)
    for step in range(1, STEPS + 1):
        assert meter.due(step)
        meter.begin()
        for _ in range(ACCUM):
            out = model(*_pick(batch, torch.randint(WORDS, (MICRO,), generator=draw)))
            strategy.backward(out["loss"])
            meter.end_micro()
        meter.end_backward()
        stats = strategy.step()
        meter.record(stats.grad_norm, good=not stats.skipped)
    meter.remove()
    return meter


@pytest.mark.parametrize("name", list(MODELS))
def test_the_online_noise_scale_is_within_a_quarter_of_the_per_sample_brute_force(name):
    task = create_task(MODELS[name])
    strategy = _single(MICRO, ACCUM)
    model = strategy.build_model(task.model_factory(), SEED)
    model, _ = strategy.setup(model, OptimizerSpec(torch.optim.SGD, {"lr": 0.0}))  # steps that change nothing
    model.eval()
    batch = _words(task, SEED)
    before = {k: v.clone() for k, v in model.state_dict().items()}

    grad_sq, trace, mean = brute_force(model, batch)
    model(*batch.inputs)["loss"].backward()  # the whole set's batch gradient is the mean of the samples'
    whole = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.requires_grad])
    assert torch.allclose(whole, mean, rtol=1e-3, atol=1e-3 * float(mean.abs().max()))
    model.zero_grad(set_to_none=True)

    meter = online(strategy, model, batch, SEED)
    assert meter.scale.count == STEPS
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()), "the weights moved"
    b_true, b_online = trace / grad_sq, meter.scale.b_simple
    assert b_online is not None, f"no estimate (B_true {b_true:.2f})"
    assert abs(b_online / b_true - 1) <= 0.25, f"B_simple {b_online:.2f} online, {b_true:.2f} brute force"


def test_a_run_of_one_batch_size_measures_nothing_unless_asked_and_then_refuses():
    """One process with one micro-batch a step has one batch size: left out, --noise-every is off there (the run is
    not told about what it did not ask for); asked for, it is refused in one line before any step."""
    from scale_ocr.errors import UserError

    assert not NoiseMeter(None, None, 0.9, 8, 8, CPU).measures
    assert NoiseMeter(None, 0, 0.9, 8, 8, CPU).summary() is None
    with pytest.raises(UserError, match="--noise-every 5: .* two batch sizes.*--grad-accum 2 or more"):
        NoiseMeter(None, 5, 0.9, 8, 8, CPU)


def test_a_noise_scale_that_cannot_be_measured_is_refused_before_anything_is_built(tmp_path):
    """train.py refuses it as its first words, before the model or the data: no rate line (said once the model is
    built), nothing of a run written (the directory's claim aside)."""
    from conftest import TINY, python_train

    out = tmp_path / "run"
    result = python_train([*TINY, "--noise-every", "5", "--output-dir", str(out)])
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [ln for ln in (result.stdout + result.stderr).splitlines() if ln.strip()]
    assert len(lines) == 1 and "--noise-every 5: the gradient noise scale compares" in lines[0], lines
    assert {f.name for f in out.iterdir()} <= {".scale-ocr.lock"}


def test_a_resume_that_cannot_continue_the_averages_says_so(tmp_path):
    """A run resumed with another --noise-smoothing starts the averages afresh, and its resume line says why (one
    process accumulating 2: two batch sizes)."""
    from conftest import TINY, python_train

    run, flags = str(tmp_path / "run"), [*TINY, "--grad-accum", "2", "--noise-every", "1", "--save-every", "2"]
    first = python_train([*flags, "--max-steps", "2", "--output-dir", run])
    assert first.returncode == 0, first.stderr[-2000:]
    again = python_train([*flags, "--max-steps", "4", "--noise-smoothing", "0.5", "--output-dir", run])
    assert again.returncode == 0, again.stderr[-2000:]
    assert ("the noise scale's averages started afresh (the checkpoint's were made with --noise-smoothing 0.9, this "
            "run's is 0.5)") in again.stdout, again.stdout[-2000:]


def _reading(grad_sq: float, trace: float) -> Pair:
    """The pair (b 1, B 2) whose unbiased terms are ``grad_sq`` and ``trace``."""
    return Pair(small_sq=grad_sq + trace, big_sq=grad_sq + trace / 2, small=1, big=2)


def test_a_gradient_spike_moves_the_estimate_without_holding_it():
    """One reading 50x the others (a loss spike) counts 5x the recent median size; readings like the others count
    whole; the bound's memory survives a checkpoint, and a checkpoint from before it loads."""
    plain, spiked = NoiseScale(0.9), NoiseScale(0.9)
    for k in range(21):
        plain.add(_reading(1.0, 10.0))
        spiked.add(_reading(50.0 if k == 10 else 1.0, 10.0))
    assert plain.metrics()["noise/grad_sq"] == pytest.approx(1.0) and plain.clipped == 0
    excess = 0.4 * 0.9 ** 10 / (1 - 0.9 ** 21)  # the clipped spike's 4 over the others, as the average weighs it
    assert spiked.clipped == 1 and spiked.metrics()["noise/grad_sq"] == pytest.approx(1 + excess)
    assert spiked.b_simple == pytest.approx(10 / (1 + excess))  # 8.6; counted whole the spike would leave 3.4
    again = NoiseScale(0.9)
    assert again.load_state_dict(json.loads(json.dumps(spiked.state_dict())))
    for scale in (again, spiked):
        scale.add(_reading(50.0, 10.0))
    assert again.metrics() == spiked.metrics() and again.clipped == 2
    old = {k: v for k, v in plain.state_dict().items() if k not in ("recent", "clipped")}
    assert NoiseScale(0.9).load_state_dict(old)
    # averages made with another smoothing are not continued, and the resume line says why
    other = NoiseScale(0.99)
    assert not other.load_state_dict(plain.state_dict()) and other.count == 0
    assert other.restart_note(plain.state_dict()) == ("the noise scale's averages started afresh (the checkpoint's "
                                                      "were made with --noise-smoothing 0.9, this run's is 0.99)")
