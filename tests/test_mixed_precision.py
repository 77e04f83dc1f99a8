"""Mixed precision (``model.compute_dtype``): bf16 forwards over fp32 master weights, fp32 log-probs,
float32 exactly today's path, and where ``auto`` resolves to what."""

from __future__ import annotations

import pytest
import torch
from batching_support import random_trajectories

from agent_r1.algos import TokenFields, aggregation_weights
from agent_r1.models import precision
from agent_r1.models.tiny import build_tiny_model
from agent_r1.train.batch import batch_of
from agent_r1.train.builders import compute_dtype, critic_learner, policy_learner
from agent_r1.train.config import ConfigError, config_from_dict
from agent_r1.train.critic import ValueModel, micro_batch_values
from agent_r1.train.learner import Learner, MiniBatch, model_inputs

VOCAB, HIDDEN, LAYERS = 300, 64, 2
CPU = torch.device("cpu")


def _model(seed: int = 3):
    return build_tiny_model(
        VOCAB, hidden_size=HIDDEN, num_layers=LAYERS, intermediate_size=2 * HIDDEN, seed=seed
    ).eval()


def _mini_batch() -> MiniBatch:
    batch = batch_of(random_trajectories(0), micro_batch_tokens=32)  # several micro-batches
    n = batch.num_tokens
    mask = torch.ones(n)
    tokens = TokenFields(
        mask=mask,
        step_ids=batch.tokens.step_ids,
        traj_ids=batch.tokens.traj_ids,
        sampler_logprobs=torch.full((n,), -5.0),
        old_logprobs=torch.full((n,), -5.0),
        advantages=torch.linspace(-1, 1, n),
        returns=torch.linspace(1, -1, n),
        old_values=torch.zeros(n),
        value_mask=mask,
    )
    weights = aggregation_weights(mask, "seq-mean-token-mean", seq_ids=batch.tokens.step_ids)
    return MiniBatch(batch.micro_batches[0], weights, tokens)


def _pg_loss(logprobs_K, entropy_K, tokens):
    return -tokens.advantages * torch.exp(logprobs_K - tokens.old_logprobs), {}


def _learner(model, name: str | None) -> Learner:
    """The policy's learner as the builders make it from ``model.compute_dtype: name`` (None: the
    learner as it was before the key existed)."""
    if name is None:
        config = config_from_dict({})
        return Learner(model, config.trainer, temperature=1.0, total_optimizer_steps=10)
    config = config_from_dict({"model": {"compute_dtype": name}, "rollout": {"temperature": 1.0}})
    dtype, _ = compute_dtype(config, CPU)
    return policy_learner(config, model, dtype=dtype)


def _logprobs(learner: Learner, mini: MiniBatch) -> torch.Tensor:
    return learner.logprobs(mini.micro_batches, mini.weights.shape[0])


def test_bf16_compute_keeps_fp32_weights_and_adam_state_and_learns():
    mini = _mini_batch()
    steps = {}
    for name in ("float32", "bfloat16"):
        model = _model()
        learner = _learner(model, name)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        metrics = learner.update(mini, _pg_loss, with_entropy=True)
        assert metrics["update/skipped"] == 0.0
        for n, p in model.named_parameters():
            assert p.dtype == torch.float32, n
        state = [t for s in learner.optimizer.state.values() for t in s.values() if t.is_floating_point()]
        assert state and all(t.dtype == torch.float32 for t in state)
        steps[name] = torch.cat([(p.detach() - before[n]).flatten() for n, p in model.named_parameters()])
        assert float(steps[name].abs().max()) > 0, "the update left the weights as they were"
    # the same update direction: AdamW's first step is ~lr * sign(gradient), so a gradient whose sign
    # the bf16 rounding flips shows up, and a wrong backward under autocast would show up more
    cosine = torch.nn.functional.cosine_similarity(steps["bfloat16"], steps["float32"], dim=0)
    assert cosine > 0.9


def test_bf16_logprobs_are_fp32_and_within_the_bf16_rounding_bound():
    mini = _mini_batch()
    model = _model()
    fp32_T = _logprobs(_learner(model, "float32"), mini)
    bf16_T = _logprobs(_learner(model, "bfloat16"), mini)
    assert bf16_T.dtype == torch.float32
    assert not torch.equal(bf16_T, fp32_T), "autocast did not run"
    # computed in fp32, not bf16 values cast up at the end: most are no bf16 number
    assert (bf16_T.bfloat16().float() != bf16_T).float().mean() > 0.5

    # The bound. bf16 keeps 8 significant bits: round-to-nearest moves a value by at most
    # u = 2^-8 ~ 3.9e-3 of itself. Under autocast every matmul input (activation and weight) is
    # rounded to bf16 and every matmul output is rounded again (products accumulate in fp32:
    # H x 2^-24, negligible). A logit z_j = sum_i h_i W_ji over the H = 64 hidden units thus moves
    # by at most 3u * S_j from the head alone, S_j = sum_i |h_i| |W_ji| (h, W and z rounded). Each
    # decoder layer puts its own roundings in front of h: 8 in attention (input, q/k/v weights, q/k/v,
    # scores, probabilities, context, o weight, o output) and 6 in the MLP (input, gate/up weights,
    # gate/up, SiLU x up, down weight, down output). To first order the relative errors of a chain
    # add, and each is relative to a sublayer output no larger than the residual stream it joins
    # (RMSNorm keeps a relative error relative), so |dz_j| <= (3 + 14 L) u S with L layers and
    # S = max_j S_j <= H max|h| max|W|. log p_t = z_t - logsumexp(z) then moves by at most
    # |dz_t| + max_j |dz_j| <= 2 (3 + 14 L) u S. A worst case: round-to-nearest errors mostly cancel
    # instead of adding, and the gap measured here is ~200x smaller (1.5e-3 against 0.34), so it is
    # the check above (no bf16 numbers) that catches a log-softmax in bf16.
    u = 2.0**-8
    head_W = model.lm_head.weight.detach().abs()
    S = 0.0
    for mb in mini.micro_batches:
        with torch.no_grad():
            h_KH = model(**model_inputs(model, mb), output_hidden_states=True).hidden_states[-1]
        h_KH = h_KH.flatten(0, 1)[mb.logit_index_K]
        S = max(S, float((h_KH.abs() @ head_W.T).max()))
    bound = 2 * (3 + 14 * LAYERS) * u * S
    gap = float((bf16_T - fp32_T).abs().max())
    assert gap <= bound, (gap, bound)


def test_float32_compute_is_bitwise_the_path_without_the_key():
    mini = _mini_batch()
    results = {}
    for name in (None, "float32"):
        model = _model()
        learner = _learner(model, name)
        logprobs_T = _logprobs(learner, mini)
        learner.update(mini, _pg_loss, with_entropy=True)
        results[name] = logprobs_T, [p.detach().clone() for p in model.parameters()]
    (old_T, old_weights), (new_T, new_weights) = results[None], results["float32"]
    assert torch.equal(old_T, new_T)
    assert all(torch.equal(a, b) for a, b in zip(old_weights, new_weights, strict=True))


def test_float16_compute_is_loss_scaled_onto_fp32_weights():
    mini = _mini_batch()
    model = _model()
    learner = _learner(model, "float16")
    assert learner.grad_scaler is not None and learner.grad_scaler.get_scale() == 2.0**16
    before = [p.detach().clone() for p in model.parameters()]
    metrics = learner.update(mini, _pg_loss, with_entropy=True)
    assert metrics["update/skipped"] == 0.0
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    assert "grad_scaler" in learner.state_dict()


def test_the_critic_computes_under_autocast_with_an_fp32_value_head():
    mini = _mini_batch()
    critic = ValueModel(_model().model, HIDDEN).eval()
    torch.nn.init.normal_(critic.head.weight, std=0.1)
    config = config_from_dict({"model": {"compute_dtype": "bfloat16"}})
    learner = critic_learner(config, critic, dtype=compute_dtype(config, CPU)[0])
    values_T = learner.logprobs(mini.micro_batches, mini.weights.shape[0])
    assert values_T.dtype == torch.float32
    with torch.no_grad():
        fp32_K, _ = micro_batch_values(critic, mini.micro_batches[0])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            bf16_K, _ = micro_batch_values(critic, mini.micro_batches[0])
    assert bf16_K.dtype == torch.float32 and not torch.equal(bf16_K, fp32_K)

    def value_loss(values_K, entropy_K, tokens):
        return (values_K - tokens.returns) ** 2, {}

    before = critic.head.weight.detach().clone()
    assert learner.update(mini, value_loss)["update/skipped"] == 0.0
    assert critic.head.weight.dtype == torch.float32 and not torch.equal(critic.head.weight, before)


@pytest.mark.parametrize(
    ("flags", "expected", "why"),
    [
        (
            ("avx512_bf16", "amx_bf16", "amx_tile"),
            torch.bfloat16,
            "bfloat16: this CPU multiplies it natively (amx_bf16, avx512_bf16)",
        ),
        (("avx512_bf16",), torch.bfloat16, "bfloat16: this CPU multiplies it natively (avx512_bf16)"),
        ((), torch.float32, "float32: this CPU has neither avx512_bf16 nor AMX"),
    ],
)
def test_auto_on_a_cpu_is_bf16_with_amx_only(flags, expected, why):
    assert precision.resolve_compute_dtype("auto", CPU, flags=flags) == (expected, why)


@pytest.mark.parametrize("native", [True, False])
def test_auto_on_cuda_is_bf16_where_the_device_computes_it_natively(monkeypatch, native):
    asked = {}

    def is_bf16_supported(including_emulation=True):
        asked["emulation"] = including_emulation
        return native

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", is_bf16_supported)
    dtype, _ = precision.resolve_compute_dtype("auto", torch.device("cuda", 0), flags=())
    assert dtype == (torch.bfloat16 if native else torch.float32)
    assert asked == {"emulation": False}


def test_a_named_compute_dtype_is_taken_as_it_is_and_cpu_flags_are_known_ones():
    for name, dtype in precision.COMPUTE_DTYPES.items():
        assert precision.resolve_compute_dtype(name, CPU, flags=("amx_bf16",))[0] == dtype
    assert set(precision.cpu_flags()) <= set(precision.CPU_FLAGS)


def test_float16_needs_fp32_master_weights_and_no_fsdp2():
    with pytest.raises(ConfigError, match="model.compute_dtype.*model.dtype"):
        config_from_dict({"model": {"compute_dtype": "float16", "dtype": "bfloat16"}})
    with pytest.raises(ConfigError, match="model.compute_dtype.*FSDP2"):
        config_from_dict(
            {
                "model": {"compute_dtype": "float16"},
                "distributed": {"backend": "ray", "strategy": "fsdp2"},
            }
        )
