"""Routing Hugging Face ``sdpa`` forwards to agent-r1's own attention paths by a keyword.

A model's attention layers look their function up by ``config._attn_implementation`` at every
forward and pass it the forward's extra keyword arguments. ``route_sdpa(keyword, forward)`` wraps the
registered ``sdpa`` function: a forward that passes ``keyword=`` (a plan that is not None) runs
``forward``, every other forward runs what was registered before, unchanged. The learner's attention
by segments and the engine's shared-prefix attention are routed this way, side by side.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["route_sdpa"]


def route_sdpa(keyword: str, forward: Callable) -> None:
    """Route ``sdpa`` forwards that carry ``keyword=`` to ``forward``. Idempotent per keyword."""
    from transformers.modeling_utils import AttentionInterface

    registered = AttentionInterface._global_mapping["sdpa"]
    routes = getattr(registered, "_agent_r1_routes", ())
    if keyword in routes:
        return

    def routed(module, query, key, value, attention_mask, *args, **kwargs):
        plan = kwargs.pop(keyword, None)
        if plan is None:
            return registered(module, query, key, value, attention_mask, *args, **kwargs)
        return forward(module, query, key, value, attention_mask, *args, **{keyword: plan}, **kwargs)

    routed._agent_r1_routes = (*routes, keyword)
    AttentionInterface.register("sdpa", routed)
