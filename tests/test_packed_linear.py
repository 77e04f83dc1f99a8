"""The engine's packed linears (``agent_r1.rollout.packed_linear``): oneDNN's kernel inside the engine's
forwards only, following every write to a weight."""

import pytest
import torch

from agent_r1.models.tiny import build_tiny_model
from agent_r1.rollout import packed_linear
from agent_r1.rollout.hf import HFEngine, _packed_linears
from agent_r1.rollout.packed_linear import PackedLinears

pytestmark = pytest.mark.skipif(not packed_linear.available(), reason="this torch build has no oneDNN linear")

# fp32 sums of 64 products in another order: each output differs from F.linear's by a few ulps of the
# partial sums (|x . w| <= ~30 here), far below 1e-4.
TOLERANCE = 1e-4


def layer_and_input(seed: int = 0) -> tuple[torch.nn.Linear, torch.Tensor]:
    torch.manual_seed(seed)
    return torch.nn.Linear(64, 96), torch.randn(5, 7, 64)


def test_inside_active_the_packed_kernel_runs_and_agrees_with_f_linear():
    layer, x = layer_and_input()
    linears = PackedLinears(True)
    with torch.no_grad():
        plain = layer(x)
        with linears.active():
            packed = layer(x)
    assert len(linears._packs) == 1  # the weight was packed: the oneDNN kernel ran
    torch.testing.assert_close(packed, plain, rtol=0, atol=TOLERANCE)


def test_a_written_weight_is_packed_again():
    """An in-place write (``update_weights``' ``copy_``, an optimizer step) moves the weight's version:
    the next forward packs it again and follows the new values."""
    layer, x = layer_and_input()
    linears = PackedLinears(True)
    with torch.inference_mode():
        with linears.active():
            layer(x)
        layer.weight.copy_(torch.randn_like(layer.weight))
        with linears.active():
            after = layer(x)
        torch.testing.assert_close(after, layer(x), rtol=0, atol=TOLERANCE)
    with torch.no_grad():
        layer.weight = torch.nn.Parameter(torch.randn_like(layer.weight))  # a new tensor, same module
        with linears.active():
            torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))


def test_autograd_and_other_threads_run_f_linear_unchanged():
    """A forward under autograd inside ``active`` (a learner sharing the engine's model) is F.linear,
    bitwise, with its gradients; outside ``active`` nothing changes."""
    layer, x = layer_and_input()
    linears = PackedLinears(True)
    expected = torch.nn.functional.linear(x, layer.weight, layer.bias)
    with linears.active():
        out = layer(x)
    assert torch.equal(out, expected) and out.requires_grad
    out.sum().backward()
    assert layer.weight.grad is not None and not linears._packs
    with torch.no_grad():
        assert torch.equal(layer(x), expected)


def test_a_freed_weight_leaves_no_pack():
    linears = PackedLinears(True)
    with torch.no_grad(), linears.active():
        layer, x = layer_and_input()
        layer(x)
        assert len(linears._packs) == 1
        del layer
    assert not linears._packs


def test_disabled_runs_f_linear():
    layer, x = layer_and_input()
    linears = PackedLinears(False)
    with torch.no_grad(), linears.active():
        assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
    assert not linears._packs


def test_the_engine_packs_on_the_cpu_by_default_and_refuses_it_elsewhere():
    model = build_tiny_model(300, seed=0)
    assert HFEngine(model).packed_linears
    assert not HFEngine(model, packed_linears=False).packed_linears
    with pytest.raises(ValueError, match="on the CPU"):
        _packed_linears(True, torch.device("meta"))
    assert not _packed_linears(None, torch.device("meta"))
