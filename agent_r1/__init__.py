"""agent-r1: reinforcement learning for LLM agents as a step-level MDP (arXiv 2511.14460)."""

from agent_r1.types import (
    Action,
    Completion,
    Observation,
    SamplingParams,
    Step,
    StepResult,
    StopReason,
    Trajectory,
    TrajectoryGroup,
    TrajectoryStatus,
    read_jsonl,
    write_jsonl,
)

__version__ = "0.1.0"

# Imported on first use, so that `import agent_r1.types` stays free of torch and transformers.
_LAZY_EXPORTS = {
    "AgentEnv": "agent_r1.envs",
    "ToolEnv": "agent_r1.envs",
    "check_env": "agent_r1.envs",
    "make_env": "agent_r1.envs",
    "register_env": "agent_r1.envs",
    "AgentFlow": "agent_r1.flows",
    "AgentEnvLoop": "agent_r1.flows",
    "SingleStepFlow": "agent_r1.flows",
    "rollout_group": "agent_r1.flows",
    "rollout_groups": "agent_r1.flows",
}


def __getattr__(name: str):
    if name in _LAZY_EXPORTS:
        import importlib

        return getattr(importlib.import_module(_LAZY_EXPORTS[name]), name)
    raise AttributeError(f"module 'agent_r1' has no attribute {name!r}")


__all__ = [
    *_LAZY_EXPORTS,
    "Action",
    "Completion",
    "Observation",
    "SamplingParams",
    "Step",
    "StepResult",
    "StopReason",
    "Trajectory",
    "TrajectoryGroup",
    "TrajectoryStatus",
    "read_jsonl",
    "write_jsonl",
]
