"""Where Ray puts the actors (``distributed.placement``).

``default`` leaves it to Ray (the driver's node first, while it has room). ``spread`` pins actor
``index`` of a kind (rollout slot, learner rank) to the ``index``-th node alive when it is created,
the driver's node first and the others in a fixed order, so that with two nodes and two actors of a
kind each node holds one. A slot restarted after its node died is created again against the nodes
alive then, so it lands on a survivor. The pin is hard: Ray's soft node affinity was seen to put two
CPU actors on one node, and its ``SPREAD`` strategy too. Actors that need GPUs keep a soft affinity,
so that a node without the GPUs passes them on instead of leaving them pending.
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


def scheduling(config: TrainConfig, index: int, num_gpus: float = 0.0) -> dict:
    """Ray ``.options`` for actor ``index`` of a kind (needing ``num_gpus``) under ``distributed.placement``."""
    if config.distributed.placement == "default":
        return {}
    nodes = alive_nodes()
    node = nodes[index % len(nodes)]
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=num_gpus > 0)}
