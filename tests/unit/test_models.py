import pytest
import torch

from scale_ocr.errors import UserError
from scale_ocr.models import create_model, list_models
from scale_ocr.models.recognition.crnn import BN_MOMENTUM
from scale_ocr.models.recognition.ctc import BLANK_PRIOR, ctc_greedy_decode, ctc_loss
from scale_ocr.vocab import Vocab


@pytest.mark.parametrize("name", list_models("crnn_*"))
def test_crnn_forward_backward(name):
    torch.manual_seed(0)
    model = create_model(name, num_classes=11, input_size=(32, 128))
    images = torch.randn(2, 3, 32, 128)
    targets = torch.tensor([[1, 2, 3], [4, 5, 0]])
    out = model(images, targets, torch.tensor([3, 2]))
    # W/4 CTC frames: the backbone's later strides were made (2, 1).
    assert out["logits"].shape == (2, 32, 11)
    assert torch.isfinite(out["loss"])
    out["loss"].backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("name", list_models("crnn_*"))
def test_crnn_other_input_size(name):
    model = create_model(name, num_classes=5, input_size=(48, 192))
    assert model(torch.randn(1, 3, 48, 192))["logits"].shape == (1, 48, 5)


@pytest.mark.parametrize("name", list_models("crnn_*"))
def test_crnn_starts_predicting_blank_at_its_prior(name):
    """The head's blank bias (ctc.BLANK_PRIOR) holds after the builder: a fresh CRNN gives the blank about that
    probability on every frame, where torch's default head would give it 1 in 95 (and the greedy decode reads "")."""
    torch.manual_seed(0)
    model = create_model(name, num_classes=95, input_size=(32, 128)).eval()
    with torch.no_grad():
        blank = model(torch.randn(4, 3, 32, 128))["logits"].softmax(-1)[..., 0]
    assert abs(float(blank.mean()) - BLANK_PRIOR) < 0.05, float(blank.mean())
    assert float(blank.min()) > 0.5


@pytest.mark.parametrize("name", list_models("crnn_*"))
def test_crnn_batchnorm_running_statistics_follow_within_steps(name):
    """Every BatchNorm of a CRNN's backbone has torch's momentum 0.1, also MobileNetV3's (torchvision: 0.01)."""
    norms = [m for m in create_model(name, num_classes=5).modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert norms and {m.momentum for m in norms} == {BN_MOMENTUM} == {0.1}


def test_sharding_units_cover_all_parameters():
    model = create_model("crnn_mobilenet_v3_small", num_classes=5)
    covered = {id(p) for unit in model.sharding_units() for p in unit.parameters()}
    assert covered == {id(p) for p in model.parameters()}


def test_unknown_model_lists_valid_names():
    with pytest.raises(UserError, match="crnn_mobilenet_v3_small"):
        create_model("crnn_nope")


def test_greedy_decode_merges_repeats_and_drops_blanks():
    vocab = Vocab("ab")
    # frames: a a blank a b b -> "aab"
    idx = torch.tensor([[1, 1, 0, 1, 2, 2]])
    logits = torch.nn.functional.one_hot(idx, 3).float() * 10
    words, conf = ctc_greedy_decode(logits, vocab)
    assert words == ["aab"] and 0.99 < conf[0] <= 1.0


def test_ctc_loss_is_fp32_under_autocast():
    logits = torch.randn(2, 8, 5, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = ctc_loss(logits, torch.tensor([[1, 2], [3, 0]]), torch.tensor([2, 1]))
    assert loss.dtype == torch.float32
    per = ctc_loss(logits, torch.tensor([[1, 2], [3, 0]]), torch.tensor([2, 1]), reduction="none")
    assert per.shape == (2,)


@pytest.mark.parametrize("name", list_models("vitstr_*"))
def test_vitstr_forward_backward(name):
    torch.manual_seed(0)
    model = create_model(name, num_classes=11, input_size=(32, 128), depth=1)  # one block keeps the test fast
    out = model(torch.randn(2, 3, 32, 128), torch.tensor([[1, 2, 3], [4, 5, 0]]), torch.tensor([3, 2]))
    assert out["logits"].shape == (2, 32, 11)  # one CTC frame per 4-pixel column
    assert torch.isfinite(out["loss"])
    out["loss"].backward()
    assert all(p.grad is not None for p in model.parameters())
    blocks = {id(p) for unit in model.sharding_units() for p in unit.parameters()}
    assert blocks and blocks < {id(p) for p in model.parameters()}


def test_vitstr_small_is_large_enough_to_show_sharding():
    n = sum(p.numel() for p in create_model("vitstr_small").parameters())
    assert 20e6 < n < 23e6


def test_vitstr_rejects_input_not_divisible_by_patch():
    with pytest.raises(UserError, match="not a multiple of the 8x4 patch"):
        create_model("vitstr_tiny", input_size=(30, 128))


def _vitstr_params(width: int, depth: int, mlp_ratio: float, classes: int = 95, tokens: int = 4 * 32) -> int:
    hidden = int(width * mlp_ratio)
    block = 4 * width + (4 * width * width + 4 * width) + (2 * width * hidden + hidden + width)  # norms, attn, MLP
    return (3 * 8 * 4 + 1) * width + tokens * width + depth * block + 2 * width + (width + 1) * classes


def test_vitstr_size_overrides_build_that_model_and_travel_with_it(tmp_path):
    from scale_ocr.checkpoint.export import load_any, save_export
    from scale_ocr.config import ModelConfig
    from scale_ocr.tasks import create_task

    task = create_task(ModelConfig(arch="vitstr_tiny", model_width=128, model_depth=3, mlp_ratio=2.0))
    model = task.build_model()
    assert sum(p.numel() for p in model.parameters()) == _vitstr_params(128, 3, 2.0)
    assert model.blocks[0].attn.num_heads == 2  # width / 64 when the heads are not given
    loaded = load_any(save_export(model, task, tmp_path / "m.safetensors"))  # rebuilt from the export's identity
    assert [p.shape for p in loaded.model.parameters()] == [p.shape for p in model.parameters()]
    # The billion-parameter shapes build on the meta device without memory.
    big = create_task(ModelConfig(arch="vitstr_large", model_width=2048, model_depth=15))
    with torch.device("meta"):
        n = sum(p.numel() for p in big.build_model().parameters())
    assert n == _vitstr_params(2048, 15, 4.0) and n > 0.75e9


@pytest.mark.parametrize("kw, message", [
    ({"arch": "crnn_mobilenet_v3_small", "model_width": 256}, "crnn_mobilenet_v3_small has no width to set"),
    ({"arch": "vitstr_tiny", "model_depth": 0}, "--model-depth 0 must be positive"),
    ({"arch": "vitstr_tiny", "model_heads": 5}, "does not split into 5 attention heads"),
])
def test_vitstr_size_overrides_refused_in_one_line(kw, message):
    from scale_ocr.config import ModelConfig
    from scale_ocr.tasks import create_task

    with pytest.raises(UserError, match=message):
        create_task(ModelConfig(**kw)).build_model()


@pytest.mark.parametrize("arch, size", [("vitstr_tiny", None), ("crnn_mobilenet_v3_small", None),
                                        ("db_mobilenet_v3_large", (64, 64))])
def test_activation_checkpointing_changes_memory_not_maths(arch, size):
    # Same loss, gradients, parameter names and BatchNorm buffers (recomputing a stage must not update its
    # running statistics a second time); fewer tensors kept for backward.
    from scale_ocr.config import ModelConfig
    from scale_ocr.tasks import create_task

    runs = []
    for ac in (False, True):
        task = create_task(ModelConfig(arch=arch, input_size=size, activation_checkpointing=ac))
        torch.manual_seed(0)
        model = task.build_model().train()
        torch.manual_seed(1)
        inputs = task.dummy_inputs(2)
        saved: list[int] = []

        def pack(t, saved=saved):
            saved.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(*inputs)["loss"]
        loss.backward()
        runs.append((loss.item(), {n: p.grad for n, p in model.named_parameters()}, model.state_dict(), sum(saved)))
    (loss0, grads0, state0, saved0), (loss1, grads1, state1, saved1) = runs
    assert loss0 == loss1 and list(state0) == list(state1)
    assert all(torch.equal(state0[k], state1[k]) for k in state0)
    assert all(torch.equal(g0, g1) for g0, g1 in zip(grads0.values(), grads1.values(), strict=True))
    assert saved1 < 0.7 * saved0, (saved0, saved1)  # measured: ViT 0.05, CRNN 0.64, DBNet 0.22


def test_activation_checkpointing_needs_a_model_that_names_its_units():
    from scale_ocr.models.checkpointing import apply_activation_checkpointing

    with pytest.raises(UserError, match="--activation-checkpointing: mlp does not say where to checkpoint"):
        apply_activation_checkpointing(torch.nn.Sequential(torch.nn.Linear(2, 2)), "mlp")


def test_vitstr_attention_is_multihead_attention_without_saving_slices_of_its_weight():
    """Same parameters, names and outputs as nn.MultiheadAttention; but its projection saves the whole in_proj
    weight for the backward, never a slice, which under ZeRO-3 would keep the gathered weight alive."""
    from scale_ocr.models.recognition.vitstr import SelfAttention

    torch.manual_seed(0)
    mha, attn = torch.nn.MultiheadAttention(64, 4, batch_first=True), SelfAttention(64, 4)
    attn.load_state_dict(mha.state_dict(), strict=True)
    x = torch.randn(2, 10, 64, requires_grad=True)  # as inside a model: the backward needs the weights
    torch.testing.assert_close(attn(x), mha(x, x, x, need_weights=False)[0])

    def saved_slices(out: torch.Tensor, weight: torch.Tensor) -> int:
        ptr, seen, stack, n = weight.untyped_storage().data_ptr(), set(), [out.grad_fn], 0
        while stack:
            fn = stack.pop()
            if fn is None or fn in seen:
                continue
            seen.add(fn)
            for name in dir(fn):
                t = getattr(fn, name, None) if name.startswith("_saved_") else None
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() == ptr and t.numel() < weight.numel():
                    n += 1
            stack += [f for f, _ in fn.next_functions]
        return n

    # Distinct query, key and value tensors (DeepSpeed's module hooks make them so): three slices of the weight.
    assert saved_slices(mha(x, x.view_as(x), x.view_as(x), need_weights=False)[0], mha.in_proj_weight) == 3
    assert saved_slices(attn(x), attn.in_proj_weight) == 0
