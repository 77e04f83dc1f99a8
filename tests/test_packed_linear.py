"""The engine's packed linears (``agent_r1.rollout.packed_linear``): oneDNN's kernel for large linear
layers inside the engine's forwards only, following every write to a weight."""

import threading

import pytest
import torch

from agent_r1.models.tiny import build_tiny_model
from agent_r1.rollout import packed_linear
from agent_r1.rollout.hf import HFEngine, _packed_linears
from agent_r1.rollout.packed_linear import MIN_ELEMENTS, PackedLinears

pytestmark = pytest.mark.skipif(not packed_linear.available(), reason="this torch build has no oneDNN linear")

# fp32 sums of 512 products in another order: a few ulps of the partial sums (|x . w| < ~60 here).
TOLERANCE = 1e-4


def model_and_input(seed: int = 0) -> tuple[torch.nn.Sequential, torch.Tensor]:
    """A large layer (packed: 512 x 512 = MIN_ELEMENTS) and a small one (left to F.linear)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 8))
    return model, torch.randn(5, 7, 512)


def test_inside_active_the_large_layer_runs_packed_and_agrees_with_f_linear():
    model, x = model_and_input()
    linears = PackedLinears(model)
    assert model[0].weight.numel() == MIN_ELEMENTS and linears.layers == 1
    with torch.no_grad():
        plain = model(x)
        with linears.active():
            assert "forward" in model[0].__dict__ and "forward" not in model[1].__dict__
            packed = model(x)
        assert "forward" not in model[0].__dict__  # the module is as it was
    assert len(linears._packs) == 1  # the large weight was packed: the oneDNN kernel ran
    torch.testing.assert_close(packed, plain, rtol=0, atol=TOLERANCE)
    assert not torch.equal(packed, plain)  # another kernel: it did not run F.linear


def test_a_written_weight_is_packed_again():
    """An in-place write (``update_weights``' ``copy_``, an optimizer step) moves the weight's version,
    a new tensor its identity: the next forward packs it again and follows the new values."""
    model, x = model_and_input()
    linears = PackedLinears(model)
    with torch.inference_mode():
        with linears.active():
            model(x)
        model[0].weight.copy_(torch.randn_like(model[0].weight))
        with linears.active():
            after = model(x)
        torch.testing.assert_close(after, model(x), rtol=0, atol=TOLERANCE)
    with torch.no_grad():
        model[0].weight = torch.nn.Parameter(torch.randn_like(model[0].weight))
        with linears.active():
            torch.testing.assert_close(model(x), model.cpu()(x), rtol=0, atol=TOLERANCE)
    assert len(linears._packs) == 1  # the replaced weight's pack went with it


def test_autograd_and_other_threads_run_f_linear_unchanged():
    """Under autograd (a learner sharing the engine's model) or from another thread, a forward inside
    ``active`` is F.linear, bitwise."""
    model, x = model_and_input()
    linears = PackedLinears(model)
    expected = model(x)
    with linears.active():
        out = model(x)
        assert torch.equal(out, expected) and out.requires_grad
        out.sum().backward()
        with torch.no_grad():
            other = []
            thread = threading.Thread(target=lambda: other.append(model(x)))
            thread.start()
            thread.join()
    assert model[0].weight.grad is not None and not linears._packs
    assert torch.equal(other[0], expected.detach())


def test_disabled_or_small_runs_f_linear():
    """Disabled, or a model whose layers are all under ``MIN_ELEMENTS`` (the tiny model's): the forward
    is F.linear, bitwise, and nothing is packed."""
    model, x = model_and_input()
    expected = model(x).detach()
    for linears in (PackedLinears(model, enabled=False), PackedLinears(model[1:])):
        assert linears.layers == 0
        with torch.no_grad(), linears.active():
            assert torch.equal(model(x), expected)
        assert not linears._packs
    tiny = build_tiny_model(300, seed=0)
    assert PackedLinears(tiny).layers == 0
    with torch.no_grad():
        weight = model[0].weight
        disabled = PackedLinears(None, enabled=False).linear(x, weight)
        assert torch.equal(disabled, torch.nn.functional.linear(x, weight))


def test_the_engine_packs_on_the_cpu_by_default_and_refuses_it_elsewhere():
    model = build_tiny_model(300, seed=0)
    assert HFEngine(model).packed_linears
    assert not HFEngine(model, packed_linears=False).packed_linears
    with pytest.raises(ValueError, match="on the CPU"):
        _packed_linears(True, torch.device("meta"))
    assert not _packed_linears(None, torch.device("meta"))
