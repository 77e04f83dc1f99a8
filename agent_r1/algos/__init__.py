"""The optimisation layer of the step-level MDP: pure functions on tensors, selected by name.

``StepTable`` (one row per step) feeds the advantage estimators; the policy/value losses, KL
estimators and aggregation modes work on per-token tensors of any shape. Nothing here imports a
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
    aggregate,
    aggregation_weights,
    get_loss_aggregation,
    microbatch_weights,
    register_aggregation,
)
from agent_r1.algos.entropy import entropy_from_logits
from agent_r1.algos.kl import (
    KL_ESTIMATORS,
    get_kl_estimator,
    kl_penalty,
    kl_reward_penalty,
    register_kl_estimator,
)
from agent_r1.algos.objective import PolicyObjective, ValueObjective
from agent_r1.algos.policy_losses import (
    POLICY_LOSSES,
    PolicyLossConfig,
    get_policy_loss,
    register_policy_loss,
)
from agent_r1.algos.step_table import StepTable, step_rewards
from agent_r1.algos.value_losses import clipped_value_loss

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "KL_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "POLICY_LOSSES",
    "AdvantageConfig",
    "AdvantageOutput",
    "PolicyLossConfig",
    "PolicyObjective",
    "StepTable",
    "ValueObjective",
    "aggregate",
    "aggregation_weights",
    "clipped_value_loss",
    "compute_advantages",
    "entropy_from_logits",
    "get_advantage_estimator",
    "get_kl_estimator",
    "get_loss_aggregation",
    "get_policy_loss",
    "kl_penalty",
    "kl_reward_penalty",
    "microbatch_weights",
    "register_advantage",
    "register_aggregation",
    "register_kl_estimator",
    "register_policy_loss",
    "step_rewards",
]
