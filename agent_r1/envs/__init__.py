"""Environments of the step-level MDP: the AgentEnv contract, a registry by name, a conformance
checker, the built-in ToolEnv and the context policies that build its prompts, and agent programs
served through an OpenAI-compatible gateway (``gateway``, ``agent_program``: docs/gateway.md). See
docs/environments.md.
"""

from agent_r1.envs.base import AgentEnv
from agent_r1.envs.check import EnvCheckError, check_env
from agent_r1.envs.context import (
    CONTEXT_POLICIES,
    ContextError,
    ContextPolicy,
    ContextPrompt,
    ContextRequest,
    PreviousTurn,
    get_context_policy,
    register_context_policy,
)
from agent_r1.envs.registry import available_envs, get_env_factory, make_env, register_env
from agent_r1.envs.tool_env import ToolEnv, exact_match

__all__ = [
    "CONTEXT_POLICIES",
    "AgentEnv",
    "ContextError",
    "ContextPolicy",
    "ContextPrompt",
    "ContextRequest",
    "EnvCheckError",
    "PreviousTurn",
    "ToolEnv",
    "available_envs",
    "check_env",
    "exact_match",
    "get_context_policy",
    "get_env_factory",
    "make_env",
    "register_context_policy",
    "register_env",
]
