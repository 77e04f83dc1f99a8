"""The sampler's compute type (issue 63): the HF engine's packed linears in bf16, the sampler/learner
mismatch every step reports (``mismatch/*``), and the off-policy correction chosen when the two
compute in different types."""

from __future__ import annotations

import json

import pytest
import torch
from trainer_envs import tasks

from agent_r1.algos import mismatch_metrics
from agent_r1.models.precision import resolve_compute_dtype
from agent_r1.models.tiny import build_tiny_model, save_tiny_checkpoint
from agent_r1.rollout import packed_linear
from agent_r1.rollout.hf import HFEngine
from agent_r1.rollout.packed_linear import PackedLinears
from agent_r1.train.config import config_from_dict_with_choices
from agent_r1.train.learner import MAX_PREFIX, combine
from agent_r1.train.trainer import Trainer

BF16 = torch.bfloat16
narrow = pytest.mark.skipif(
    not packed_linear.narrow_type_available(BF16), reason="no oneDNN bf16 linear on this CPU"
)

# A bf16 product as oneDNN computes it: bf16 inputs and weights (exact in fp32 once widened), fp32
# accumulation, the sum rounded once to bf16. Emulated in fp32, only the accumulation order differs:
# a few fp32 ulps of the sum (2^-24 relative each), which can move the final rounding to the next
# bf16 value at most, one bf16 ulp: 2^-7 relative (8 significant bits) of the result.
ONE_BF16_ULP = 2.0**-7


@narrow
def test_a_bf16_packed_linear_is_the_bf16_product_to_one_ulp_and_returns_fp32():
    torch.manual_seed(0)
    weight, x = torch.randn(1024, 512) * 0.05, torch.randn(16, 512)
    with torch.no_grad():
        out = PackedLinears(None, dtype=BF16).linear(x, weight)
        emulated = torch.nn.functional.linear(x.to(BF16).float(), weight.to(BF16).float()).to(BF16).float()
    assert out.dtype == torch.float32
    assert bool(((out - emulated).abs() <= ONE_BF16_ULP * emulated.abs()).all())
    assert not torch.equal(out, torch.nn.functional.linear(x, weight))  # it did narrow


@narrow
def test_the_lm_head_stays_fp32_unless_narrowed():
    torch.manual_seed(0)
    model = build_tiny_model(1024, hidden_size=256, num_layers=1, intermediate_size=1024)
    head = model.get_output_embeddings()
    assert head.weight.numel() >= packed_linear.MIN_ELEMENTS
    x = torch.randn(3, 256)
    with torch.no_grad():
        fp32 = PackedLinears(model).linear(x, head.weight)
        for narrow_head, same in ((False, True), (True, False)):
            linears = PackedLinears(model, dtype=BF16, narrow_head=narrow_head)
            with linears.active():
                assert torch.equal(head(x), fp32) is same


@narrow
def test_the_engine_reports_the_type_it_computes_in():
    big = build_tiny_model(300, hidden_size=512, num_layers=1, intermediate_size=1024)
    assert HFEngine(big, compute_dtype=BF16).compute_dtype == BF16
    assert HFEngine(big, compute_dtype="bfloat16").compute_dtype == BF16
    assert HFEngine(big).compute_dtype == torch.float32
    # the quickstart's tiny model packs nothing: its sampler stays fp32 whatever is asked
    assert HFEngine(build_tiny_model(300), compute_dtype=BF16).compute_dtype == torch.float32
    # the KV cache and attention narrow with the linears where asked (not in the batch-invariant mode)
    assert HFEngine(big, compute_dtype=BF16, narrow_attention=True).kv_dtype == BF16
    assert HFEngine(big, compute_dtype=BF16).kv_dtype == torch.float32
    assert HFEngine(big, narrow_attention=True).kv_dtype == torch.float32
    assert (
        HFEngine(build_tiny_model(300), compute_dtype=BF16, narrow_attention=True).kv_dtype == torch.float32
    )
    with pytest.raises(ValueError, match="packed_linears is off"):
        HFEngine(big, compute_dtype=BF16, packed_linears=False)


def test_mismatch_metrics_measure_the_live_tokens_only():
    learner = torch.tensor([-1.0, -2.0, -0.5, -9.0])
    sampler = torch.tensor([-1.1, -2.0, -0.3, 0.0])
    metrics = {k: float(v) for k, v in mismatch_metrics(learner, sampler, torch.tensor([1, 1, 1, 0])).items()}
    assert metrics["mismatch/logprob_abs_mean"] == pytest.approx(0.1, abs=1e-6)
    assert metrics["mismatch/logprob_abs_max"] == pytest.approx(0.2, abs=1e-6)
    deltas = torch.tensor([0.1, 0.0, -0.2])
    assert metrics["mismatch/kl_k3"] == pytest.approx(float((deltas.exp() - 1 - deltas).mean()), abs=1e-7)
    assert mismatch_metrics(learner, sampler, torch.zeros(4)) == {}


def test_a_maximum_stays_a_maximum_across_ranks():
    ranks = [{"loss": 1.0, f"{MAX_PREFIX}ratio_max": 3.0}, {"loss": 2.0, f"{MAX_PREFIX}ratio_max": 1.5}]
    assert combine(ranks) == {"loss": 3.0, f"{MAX_PREFIX}ratio_max": 3.0}


def test_auto_narrows_the_sampler_where_the_cpu_multiplies_bf16():
    cpu = torch.device("cpu")
    assert resolve_compute_dtype("auto", cpu, flags=("avx512_bf16",))[0] == BF16
    assert resolve_compute_dtype("auto", cpu, flags=("amx_bf16", "amx_tile"))[0] == BF16
    assert resolve_compute_dtype("auto", cpu, flags=())[0] == torch.float32
    assert resolve_compute_dtype("float32", cpu, flags=("amx_bf16",))[0] == torch.float32


def _data(path, run_dir=None, **sections):
    data = {
        "model": {"path": str(path)},
        "env": {"name": "trainer_envs:LowByteEnv"},
        "rollout": {"n": 4, "max_tokens": 6, "max_steps": 2},
        "trainer": {"steps": 2, "tasks_per_step": 2, "lr": 1e-3, "run_dir": str(run_dir), "torch_threads": 1},
        "logging": {"progress": False, "tensorboard": False},
    }
    for section, values in sections.items():
        data[section] = {**data.get(section, {}), **values}
    return data


def test_a_sampler_or_learner_narrower_than_fp32_gets_the_correction_chosen(tiny_checkpoint):
    config, choices = config_from_dict_with_choices(
        _data(tiny_checkpoint, rollout={"compute_dtype": "bfloat16"})
    )
    assert config.algorithm.off_policy.name == "tis"
    assert any("tis (the sampler computes in bfloat16, the learner in float32" in c for c in choices)
    config, choices = config_from_dict_with_choices(
        _data(tiny_checkpoint, rollout={"compute_dtype": "bfloat16"}, algorithm={"off_policy": "icepop"})
    )
    assert config.algorithm.off_policy.name == "icepop" and not choices  # the user's own is kept
    config, choices = config_from_dict_with_choices(
        _data(tiny_checkpoint, rollout={"compute_dtype": "bfloat16"}, algorithm={"old_logprobs": "sampler"})
    )
    assert config.algorithm.off_policy.name == "none" and not choices
    config, choices = config_from_dict_with_choices(_data(tiny_checkpoint))
    assert config.algorithm.off_policy.name == "none" and not choices
    # one type on both sides is not one computation: the engine narrows its linears, autocast every product
    config, choices = config_from_dict_with_choices(
        _data(tiny_checkpoint, rollout={"compute_dtype": "bfloat16"}, model={"compute_dtype": "bfloat16"})
    )
    assert config.algorithm.off_policy.name == "tis"
    assert any("the sampler computes in bfloat16, the learner in bfloat16" in c for c in choices)


def _rows(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "reward/mean" in r]


def test_every_step_reports_the_mismatch_fp32_against_fp32_at_float_rounding(tiny_checkpoint, tmp_path):
    """One update per batch: the update's own forward is the learner at the sampled weights."""
    config, _ = config_from_dict_with_choices(_data(tiny_checkpoint, tmp_path))
    Trainer(config, train_tasks=tasks(8)).fit()
    for row in _rows(tmp_path):
        # the engine-vs-learner log-prob parity's bound (fp32 kernels summing in another order)
        assert 0 <= row["mismatch/logprob_abs_max"] < 1e-4
        assert row["mismatch/logprob_abs_mean"] <= row["mismatch/logprob_abs_max"]


@narrow
def test_a_bf16_sampler_is_measured_and_corrected(tmp_path):
    """A model with packed layers, sampled in bf16 and trained in fp32: the old log-probs are
    recomputed for the chosen correction, and the step measures them against the sampler's."""
    model = save_tiny_checkpoint(tmp_path / "model", hidden_size=512, num_layers=2, intermediate_size=1024)
    config, choices = config_from_dict_with_choices(
        _data(model, tmp_path / "run", rollout={"compute_dtype": "bfloat16"})
    )
    assert choices
    Trainer(config, train_tasks=tasks(8)).fit()
    for row in _rows(tmp_path / "run"):
        assert row["mismatch/logprob_abs_max"] > 1e-4  # bf16's rounding shows
        assert row["mismatch/kl_k3"] == pytest.approx(row["off_policy/kl_k3"], rel=1e-5)
        assert row["off_policy/weight_mean"] > 0
