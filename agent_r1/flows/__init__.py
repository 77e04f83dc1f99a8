"""Flows turn (engine, task) into Trajectories: AgentFlow, SingleStepFlow, AgentEnvLoop, and
rollout_group / rollout_groups for n concurrent samples per task. See docs/environments.md."""

from agent_r1.flows.base import (
    AgentEnvLoop,
    AgentFlow,
    EngineError,
    PromptTooLongError,
    SingleStepFlow,
    rollout_group,
    rollout_groups,
    split_roles,
)

__all__ = [
    "AgentEnvLoop",
    "AgentFlow",
    "EngineError",
    "PromptTooLongError",
    "SingleStepFlow",
    "rollout_group",
    "rollout_groups",
    "split_roles",
]
