"""Where Ray puts the actors (``distributed.placement``).

``default`` leaves it to Ray (the driver's node first, while it has room). ``spread`` gives actor
``index`` of a kind (rollout slot, learner rank) a soft affinity to the ``index``-th alive node,
the driver's node first and the others in a fixed order, so that with two nodes and two actors of a
kind each node holds one. Soft: a node that is gone (or cannot take the actor) is passed over by
Ray's own placement, which is how a slot restarted after its node died lands on a surviving node.
Ray's ``SPREAD`` strategy is only a preference, and was seen to leave both actors on one node.
"""

from __future__ import annotations

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from agent_r1.train.config import TrainConfig

__all__ = ["alive_nodes", "scheduling"]


def alive_nodes() -> list[str]:
    """The ids of the cluster's alive nodes: the driver's first, then the others sorted."""
    here = ray.get_runtime_context().get_node_id()
    others = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != here)
    return [here, *others]


def scheduling(config: TrainConfig, index: int) -> dict:
    """Ray ``.options`` for actor ``index`` of a kind under ``distributed.placement``."""
    if config.distributed.placement == "default":
        return {}
    nodes = alive_nodes()
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(nodes[index % len(nodes)], soft=True)}
