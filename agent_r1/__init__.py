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

__all__ = [
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
