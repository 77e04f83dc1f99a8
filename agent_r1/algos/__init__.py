"""The optimisation layer of the step-level MDP: pure functions on tensors, selected by name.

``StepTable`` (one row per step) feeds the advantage estimators; the policy/value losses, KL
estimators and aggregation modes work on per-token tensors of any shape; ``PolicyObjective`` is the
whole per-token objective the learner minimises. Each registry entry declares its ``Needs`` and each
concept's options are one frozen dataclass (``AdvantageConfig``, ``PolicyLossConfig``, ``KLConfig``,
``AggregationConfig``), which is also its section of the training config. Nothing here imports a
model. See docs/algorithms.md for every estimator and loss with its formula and paper.
"""

from agent_r1.algos.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageConfig,
    AdvantageOutput,
    compute_advantages,
    get_advantage_estimator,
    register_advantage,
)
from agent_r1.algos.aggregation import (
    LOSS_AGGREGATIONS,
    AggregationConfig,
    aggregate,
    aggregation_weights,
    get_loss_aggregation,
    register_aggregation,
)
from agent_r1.algos.distill import distill_advantages, distill_tokens, reverse_kl_per_token
from agent_r1.algos.kl import (
    KL_ESTIMATORS,
    KLConfig,
    get_kl_estimator,
    kl_penalty,
    kl_reward_penalty,
    register_kl_estimator,
)
from agent_r1.algos.objective import PolicyObjective, ValueObjective
from agent_r1.algos.off_policy import (
    OFF_POLICY_CORRECTIONS,
    OffPolicyConfig,
    correct_tokens,
    get_off_policy_correction,
    mismatch_metrics,
    off_policy_correction,
    register_off_policy_correction,
)
from agent_r1.algos.policy_losses import (
    POLICY_LOSSES,
    PolicyLossConfig,
    get_policy_loss,
    register_policy_loss,
)
from agent_r1.algos.registry import InvalidOption, Needs, Registry
from agent_r1.algos.step_table import StepTable, step_rewards
from agent_r1.algos.tokens import TokenFields
from agent_r1.algos.value_losses import clipped_value_loss

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "KL_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "OFF_POLICY_CORRECTIONS",
    "POLICY_LOSSES",
    "AdvantageConfig",
    "AdvantageOutput",
    "AggregationConfig",
    "InvalidOption",
    "KLConfig",
    "Needs",
    "OffPolicyConfig",
    "PolicyLossConfig",
    "PolicyObjective",
    "Registry",
    "StepTable",
    "TokenFields",
    "ValueObjective",
    "aggregate",
    "aggregation_weights",
    "clipped_value_loss",
    "compute_advantages",
    "correct_tokens",
    "distill_advantages",
    "distill_tokens",
    "get_advantage_estimator",
    "get_kl_estimator",
    "get_loss_aggregation",
    "get_off_policy_correction",
    "mismatch_metrics",
    "get_policy_loss",
    "kl_penalty",
    "reverse_kl_per_token",
    "kl_reward_penalty",
    "off_policy_correction",
    "register_advantage",
    "register_aggregation",
    "register_kl_estimator",
    "register_off_policy_correction",
    "register_policy_loss",
    "step_rewards",
]
