"""The pieces of the single-process trainer that actors and workers rebuild from the config.

Rather than copy them, actors bind ``Trainer``'s own construction helpers and its token loss to a
small object holding just what those methods read (``config``, ``tokenizer``, the policy loss), so
that a Ray run builds exactly the flows and computes exactly the loss that ``Trainer`` does.
"""

from __future__ import annotations

from dataclasses import replace

from agent_r1.algos import PolicyLossConfig, get_policy_loss
from agent_r1.train.config import ConfigError, TrainConfig
from agent_r1.train.trainer import Trainer
from agent_r1.types import SamplingParams

__all__ = ["TrainerParts", "load_driver_tokenizer"]


def load_driver_tokenizer(config: TrainConfig):
    from agent_r1.models.loading import load_tokenizer

    if not (config.model.tokenizer or config.model.path):
        raise ConfigError("model.path", "no model given: set model.path")
    return load_tokenizer(
        config.model.tokenizer or config.model.path,
        key="model.tokenizer" if config.model.tokenizer else "model.path",
    )


class TrainerParts:
    """``Trainer``'s env factory, agent loop and token loss, bound to a config and a tokenizer."""

    _env_factory = Trainer._env_factory
    _loop = Trainer._loop
    token_loss = Trainer._token_loss

    def __init__(self, config: TrainConfig, tokenizer=None) -> None:
        self.config = config
        self.tokenizer = tokenizer
        rollout, algo = config.rollout, config.algorithm
        self.sampling = SamplingParams(
            temperature=rollout.temperature,
            top_p=rollout.top_p,
            top_k=rollout.top_k,
            max_tokens=rollout.max_tokens,
        )
        self.eval_sampling = replace(self.sampling, temperature=rollout.eval_temperature)
        self.policy_loss = get_policy_loss(algo.policy_loss)
        self.policy_loss_config = PolicyLossConfig(
            clip_low=algo.clip_low, clip_high=algo.clip_high, tis_cap=algo.tis_cap
        )

    def env_factory(self):
        return self._env_factory()

    def loop(self, env_factory, sampling: SamplingParams):
        return self._loop(env_factory, sampling)
