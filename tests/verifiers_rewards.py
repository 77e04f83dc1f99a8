"""A reward function plugged into a verifiers taskset by its config (verifiers'
``taskset.task.rewards``), read by the verifiers worker from this file's path: a dense signal for a
random tiny model, so a short training run has reward variance to learn from."""


async def ascii_share(trace) -> float:
    """The share of ASCII characters in the harness's last reply (about 0.5 for the random tiny model)."""
    reply = trace.last_reply
    return sum(ch.isascii() for ch in reply) / max(len(reply), 1)
