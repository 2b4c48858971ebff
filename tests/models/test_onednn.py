"""OneDnnLinear computes what nn.Linear computes (values and gradients), and only where it should."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from teamrl.config import SamplingConfig
from teamrl.models import onednn
from teamrl.models.onednn import OneDnnLinear, onednn_available, packed_weights, use_onednn_linears
from teamrl.models.tiny import tiny_model_and_tokenizer
from teamrl.rollout.generate import generate
from teamrl.team import Agent

pytestmark = pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN (mkldnn) linear")

# float32 with the products summed in another order: ~1e-6 relative, so 1e-5 leaves room and catches any
# real error (a wrong transpose or a dropped bias is off by O(1)).
TOL = {"rtol": 1e-5, "atol": 1e-5}
# bfloat16 outputs and gradients are rounded to 8 mantissa bits (0.4% relative) wherever they are summed
BF16_TOL = {"rtol": 2e-2, "atol": 2e-2}


linear_kernel = onednn._linear


def _pair(in_features: int = 48, out_features: int = 40, bias: bool = True) -> tuple[nn.Linear, nn.Linear]:
    torch.manual_seed(0)
    plain = nn.Linear(in_features, out_features, bias=bias)
    fast = copy.deepcopy(plain)
    fast.__class__ = OneDnnLinear
    return plain, fast


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 48), (3, 7, 48), "transposed", "last position"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("trains", [True, False], ids=["onednn-trains", "mkl-trains"])
def test_forward_and_gradients_match_nn_linear(shape, bias, dtype, trains, monkeypatch):
    monkeypatch.setattr(onednn, "onednn_trains", lambda: trains)  # both paths, whatever this CPU picks
    plain, fast = _pair(bias=bias)
    plain, fast = plain.to(dtype), fast.to(dtype)
    if shape == "transposed":
        x = torch.randn(7, 3, 48).transpose(0, 1)
    elif shape == "last position":  # the slice transformers takes for logits_to_keep=1: not contiguous
        x = torch.randn(3, 7, 48)[:, -1:]
    else:
        x = torch.randn(*shape)
    x = x.to(dtype)
    kernel_calls = []
    monkeypatch.setattr(onednn, "_linear", lambda *args: kernel_calls.append(1) or linear_kernel(*args))
    outputs, grads = [], []
    for layer in (plain, fast):
        xi = x.detach().clone().requires_grad_(True)
        out = layer(xi)
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
        (out * weights).sum().backward()
        outputs.append(out.detach())
        grads.append([xi.grad, layer.weight.grad] + ([layer.bias.grad] if bias else []))
    # the oneDNN kernel ran (forward and input gradient), not nn.Linear's fallback, where passes with
    # gradients go to oneDNN; bfloat16 only where the CPU has bfloat16 instructions (oneDNN has no bfloat16
    # linear on AVX2-only CPUs)
    assert len(kernel_calls) == (2 if trains and dtype in onednn.onednn_dtypes() else 0)
    tolerance = TOL if dtype == torch.float32 else BF16_TOL
    assert outputs[1].dtype == dtype
    torch.testing.assert_close(outputs[1], outputs[0], **tolerance)
    for fast_grad, plain_grad in zip(grads[1], grads[0]):
        torch.testing.assert_close(fast_grad, plain_grad, **tolerance)


def test_onednn_trains_where_the_cpu_has_avx512(monkeypatch):
    try:
        for capability, trains in [("AVX512", True), ("AVX2", False), ("DEFAULT", False)]:
            monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda capability=capability: capability)
            onednn.onednn_trains.cache_clear()
            assert onednn.onednn_trains() is trains
    finally:  # later tests see this CPU's answer, not a pretended one
        onednn.onednn_trains.cache_clear()


def test_frozen_weight_gets_no_gradient_and_inference_needs_no_graph():
    plain, fast = _pair()
    fast.requires_grad_(False)
    x = torch.randn(4, 48, requires_grad=True)
    fast(x).sum().backward()
    assert fast.weight.grad is None and fast.bias.grad is None
    torch.testing.assert_close(x.grad, plain.weight.sum(0).expand(4, -1), **TOL)
    with torch.no_grad():
        assert fast(torch.randn(2, 48)).grad_fn is None


def test_other_dtypes_and_autocast_run_as_nn_linear(monkeypatch):
    monkeypatch.setattr(onednn, "_linear", lambda *args: pytest.fail("oneDNN kernel called"))
    plain, fast = _pair()
    x = torch.randn(4, 48)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert fast(x).dtype == plain(x).dtype == torch.bfloat16
    plain, fast = plain.to(torch.float64), fast.to(torch.float64)
    assert torch.equal(fast(x.double()), plain(x.double()))


def test_use_onednn_linears_switches_large_plain_linears_in_place():
    model, _ = tiny_model_and_tokenizer(["a", "b"], seed=0)
    linears = [m for m in model.modules() if type(m) is nn.Linear]
    sizes = sorted({m.in_features * m.out_features for m in linears})
    threshold = sizes[len(sizes) // 2]
    expected = sum(m.in_features * m.out_features >= threshold for m in linears)
    ids = torch.tensor([[3, 4, 3, 4, 3]])
    before = model(input_ids=ids).logits
    state = {k: v.clone() for k, v in model.state_dict().items()}

    assert 0 < expected < len(linears)
    assert use_onednn_linears(model, min_weights=threshold) == expected
    switched = [m for m in model.modules() if isinstance(m, OneDnnLinear)]
    assert len(switched) == expected and all(m.in_features * m.out_features >= threshold for m in switched)
    torch.testing.assert_close(model(input_ids=ids).logits, before, **TOL)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert use_onednn_linears(model, min_weights=threshold) == 0  # already switched: left as they are


@pytest.mark.parametrize("training", ["lora", "full"])
def test_a_switched_model_gets_the_gradients_of_the_plain_one(training):
    from peft import LoraConfig, get_peft_model

    model, _ = tiny_model_and_tokenizer(["a", "b"], seed=0)  # its output layer is tied to the embedding
    reference = copy.deepcopy(model)
    use_onednn_linears(model, min_weights=0)
    models = [reference, model]
    if training == "lora":
        lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        models = [get_peft_model(m, copy.deepcopy(lora)) for m in models]
        models[1].load_state_dict(models[0].state_dict())
    ids = torch.tensor([[3, 4, 3, 4, 3]])
    grads = []
    for trained in models:
        trained(input_ids=ids).logits.square().mean().backward()
        grads.append({n: p.grad for n, p in trained.named_parameters() if p.requires_grad})
    assert grads[1].keys() == grads[0].keys()
    if training == "lora":
        assert all("lora_" in n for n in grads[1])  # the base stays frozen
    else:  # the output layer's gradient reaches the embedding it is tied to
        assert model.lm_head.weight is model.get_input_embeddings().weight
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_weights_serve_gradient_free_passes_only_inside_the_block(dtype):
    model, _ = tiny_model_and_tokenizer(["a", "b"], seed=0)
    model.to(dtype)
    use_onednn_linears(model, min_weights=0)
    layers = [m for m in model.modules() if isinstance(m, OneDnnLinear)]
    ids = torch.tensor([[3, 4, 3, 4, 3]])
    with torch.no_grad():
        before = model(input_ids=ids).logits
    with packed_weights(model, rows=1):
        # packed where the layers run on oneDNN (bfloat16 only on CPUs with bfloat16 instructions)
        assert all((layer.packed_weight is not None) == (dtype in onednn.onednn_dtypes()) for layer in layers)
        with torch.no_grad():
            torch.testing.assert_close(model(input_ids=ids).logits, before,
                                       **(TOL if dtype == torch.float32 else BF16_TOL))
        model(input_ids=ids).logits.sum().backward()  # a training pass inside the block uses the live weight
        assert all(layer.weight.grad is not None for layer in layers)
    assert all(layer.packed_weight is None for layer in layers)


def test_generation_on_switched_layers_samples_what_nn_linear_samples():
    words = [str(d) for d in range(10)] + ["target", "first"]
    generations = []
    for switch in (False, True):
        model, tokenizer = tiny_model_and_tokenizer(words, seed=0)
        if switch:
            assert use_onednn_linears(model, min_weights=0) > 0
        agent = Agent(name="a", model=model, tokenizer=tokenizer, sampling=SamplingConfig(max_new_tokens=6))
        generations.append(generate(agent, ["target 9 first", "target 1 2 first"], 4, seed=5))
        assert all(m.packed_weight is None for m in model.modules() if isinstance(m, OneDnnLinear))
    plain, fast = generations
    # Same uniforms, policies within float32 rounding: the same tokens (a flip would need a uniform within
    # ~1e-6 of a cumulative-probability boundary).
    assert torch.equal(fast.completion_ids, plain.completion_ids)
    torch.testing.assert_close(fast.sampling_logprobs, plain.sampling_logprobs, **TOL)
