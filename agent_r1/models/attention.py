"""Routing Hugging Face ``sdpa`` forwards to agent-r1's own attention paths by a keyword.

A model's attention layers look their function up by ``config._attn_implementation`` at every
forward and pass it the forward's extra keyword arguments. ``route_sdpa(keyword, forward)`` wraps the
registered ``sdpa`` function: a forward that passes ``keyword=`` (a plan that is not None) runs
``forward``, every other forward runs what was registered before, unchanged. The learner's attention
by segments and the engine's shared-prefix attention are routed this way, side by side.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["refuse_unplain", "route_sdpa"]

_NOT_PLAIN = (
    "sliding_window",
    "softcap",
    "s_aux",
)  # attention kwargs that are more than softmax over the mask


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


def refuse_unplain(path: str, kwargs: dict, remedy: str) -> None:
    """Raise if a layer's attention kwargs ask for more than plain softmax over the mask (a sliding
    window, logit soft-capping, attention sinks), which ``path`` does not compute."""
    refused = [name for name in _NOT_PLAIN if kwargs.get(name) is not None]
    if refused:
        raise ValueError(
            f"{path} computes plain softmax attention; this model's layer passes {refused} ({remedy})"
        )
