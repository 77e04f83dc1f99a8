"""The distributed config section, the example Ray configs and micro-batch sharding (no cluster)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from agent_r1.distributed.learner_group import shard_micro_batches
from agent_r1.train.batching import MicroBatch
from agent_r1.train.config import ConfigError, config_from_dict, load_config

pytestmark = pytest.mark.ray  # imports Ray (no cluster is started)
CONFIGS = Path(__file__).parent.parent / "configs"


@pytest.mark.parametrize("name", ["ray_arithmetic_grpo.yaml", "ray_multinode_vllm.yaml"])
def test_example_ray_configs_load(name):
    config = load_config(CONFIGS / name)
    assert config.distributed.backend == "ray"
    # only the distributed section (and the run dir) differs from the single-process recipe
    if name == "ray_arithmetic_grpo.yaml":
        single = load_config(CONFIGS / "arithmetic_grpo.yaml")
        for section in ("model", "data", "env", "rollout"):
            assert getattr(config, section) == getattr(single, section)


def test_async_mode_needs_an_importance_sampling_correction():
    """Chosen (tis) when neither correction key is set (tests/test_config.py); refused, naming
    trainer.mode, when the config sets them to no correction."""
    chosen = config_from_dict({"distributed": {"backend": "ray"}, "trainer": {"mode": "async"}})
    assert chosen.algorithm.off_policy.name == "tis"
    with pytest.raises(ConfigError, match="trainer.mode.*algorithm.off_policy"):
        config_from_dict(
            {
                "distributed": {"backend": "ray"},
                "trainer": {"mode": "async"},
                "algorithm": {"off_policy": "none"},
            }
        )
    config_from_dict(
        {"distributed": {"backend": "ray"}, "trainer": {"mode": "async"}, "algorithm": {"off_policy": "tis"}}
    )
    config_from_dict(
        {
            "distributed": {"backend": "ray"},
            "trainer": {"mode": "async"},
            "algorithm": {"old_logprobs": "sampler"},
        }
    )


@pytest.mark.parametrize(
    ("key", "value", "why"),
    [
        ("backend", "spark", "must be one of"),
        ("num_rollout_actors", 0, "must be > 0"),
        ("torch_backend", "mpi", "must be one of"),
        ("strategy", "zero3", "must be one of"),
        ("rollout_num_gpus", -1, "must be >= 0"),
    ],
)
def test_bad_distributed_values_name_the_key(key, value, why):
    with pytest.raises(ConfigError, match=f"distributed.{key}.*{why}"):
        config_from_dict({"distributed": {key: value}})


def test_ray_refuses_objects_built_in_the_driver_before_starting_anything():
    from agent_r1.train.trainer import Trainer

    config = config_from_dict({"distributed": {"backend": "ray"}})
    with pytest.raises(ConfigError, match=r"distributed.backend.*engine, model cannot be passed"):
        Trainer(config, model=object(), engine=object())


def test_async_in_one_process_needs_an_engine_with_its_own_weights():
    """Chosen (share_model: false) when unset (tests/test_config.py); an explicit true is refused."""
    tis = {"off_policy": "tis"}
    assert config_from_dict({"trainer": {"mode": "async"}, "algorithm": tis}).rollout.share_model is False
    with pytest.raises(ConfigError, match="rollout.share_model.*own copy.*share_model: false"):
        config_from_dict({"trainer": {"mode": "async"}, "rollout": {"share_model": True}, "algorithm": tis})
    config_from_dict({"trainer": {"mode": "async"}, "rollout": {"share_model": False}, "algorithm": tis})
    config_from_dict({"trainer": {"mode": "async"}, "rollout": {"engine": "vllm"}, "algorithm": tis})
    with pytest.raises(ConfigError, match="trainer.max_staleness.*must be > 0"):
        config_from_dict({"trainer": {"max_staleness": 0}})


@pytest.mark.parametrize("old, new", [("mode", "trainer.mode"), ("max_staleness", "trainer.max_staleness")])
def test_the_async_keys_moved_to_the_trainer_with_a_message_saying_where(old, new):
    with pytest.raises(ConfigError, match=f"distributed.{old}.*moved to '?{new}"):
        config_from_dict({"distributed": {old: 1}})


@pytest.mark.parametrize(
    "old, new", [("engine", "rollout.engine"), ("engine_kwargs", "rollout.engine_kwargs")]
)
def test_the_engine_keys_moved_to_rollout_with_a_message_saying_where(old, new, tmp_path):
    with pytest.raises(ConfigError, match=f"'distributed.{old}': moved to '{new}'"):
        config_from_dict({"distributed": {old: "vllm" if old == "engine" else {}}})
    with pytest.raises(ConfigError, match=f"'distributed.{old}': moved to '{new}'"):
        load_config(None, [f"distributed.{old}=vllm"])


def _micro_batch(length: int) -> MicroBatch:
    ids = torch.zeros(1, length, dtype=torch.long)
    empty = torch.zeros(0, dtype=torch.long)
    return MicroBatch(ids, ids, empty, empty, empty)


def test_micro_batches_are_sharded_longest_first_to_the_least_loaded_worker():
    shards = shard_micro_batches([_micro_batch(n) for n in (10, 70, 30, 40, 50)], 2)
    assert [[mb.num_tokens for mb in shard] for shard in shards] == [[70, 30], [50, 40, 10]]
    assert shard_micro_batches([_micro_batch(5)], 3)[1:] == [[], []]
