"""The critic for the GAE estimators: a value head on a copy of the policy's transformer body.

``ValueModel`` = the base model (``AutoModel``, no LM head) + ``Linear(hidden, 1)``, initialised from
the policy checkpoint with a zero head (as in PPO for RLHF: Ouyang et al. 2022, arXiv 2203.02155; the
value starts at 0 and is learned). The value of the prefix before each response token is read from
the hidden state at the position whose logits predict that token, the same positions the policy's
log-probs use (``MicroBatch.logit_index_K``), so:

- ``gae_token`` reads ``token_values``: one value per response token, V(s) before the token;
- ``gae_step`` reads ``step_values``: the value before the step's first response token, i.e. of the
  step's prompt (the MDP state), and the critic is trained on that position only.

The critic has its own AdamW (``trainer.critic_lr``) and trains with PPO's clipped value loss
(``algorithm.value_clip``) on the estimator's returns, mini-batch by mini-batch after the policy.
Deviation from shared-body actor-critics: no parameters are shared with the policy, so
``algorithm.value_coef`` scales the critic's own loss only.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from agent_r1.train.batching import MicroBatch
from agent_r1.train.config import ModelConfig

if TYPE_CHECKING:
    from agent_r1.train.batch import TrainBatch
    from agent_r1.train.step_context import StepContext

__all__ = ["ValueModel", "load_critic", "micro_batch_values", "values"]


class ValueModel(nn.Module):
    def __init__(self, body: nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.body = body
        self.head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, **inputs: Tensor) -> Tensor:
        """Values (B, T) at every position; ``inputs`` as for the body (``learner.model_inputs``). The
        head runs in its own dtype (fp32) even under autocast (``model.compute_dtype``): a bf16 product
        would round every value to 8 significant bits (0.4%)."""
        hidden_BTH = self.body(**inputs).last_hidden_state
        with torch.autocast(hidden_BTH.device.type, enabled=False):
            return self.head(hidden_BTH.to(self.head.weight.dtype))[..., 0]

    def save(self, path: str | Path) -> None:
        torch.save(self.state_dict(), path)


def load_critic(config: ModelConfig) -> ValueModel:
    """A value model initialised from ``config.path`` (fp32 head; body in ``config.dtype``): from the
    policy's starting weights, i.e. with ``config.adapter`` merged in when the policy starts from a
    saved adapter."""
    from transformers import AutoModel

    from agent_r1.models.loading import enable_checkpointing, load_frozen_model, quiet_progress_bars
    from agent_r1.train.learner import DTYPES

    kernel = {"attn_implementation": config.attn_implementation} if config.attn_implementation else {}
    if config.adapter is None:
        with quiet_progress_bars():
            body = AutoModel.from_pretrained(config.path, dtype=DTYPES[config.dtype], **kernel)
    else:
        merged = load_frozen_model(
            config.path,
            dtype=config.dtype,
            attn_implementation=config.attn_implementation,
            adapter=config.adapter,
        )
        body = merged.base_model.train(False).requires_grad_(True)  # the decoder under the LM head
    if config.gradient_checkpointing:
        enable_checkpointing(body)
    return ValueModel(body, body.config.hidden_size).eval()


def micro_batch_values(
    model: ValueModel, micro_batch: MicroBatch, temperature: float = 1.0, *, with_entropy: bool = False
) -> tuple[Tensor, None]:
    """Values (K,) of the prefix before each scored token (``Learner`` forward signature)."""
    from agent_r1.train.learner import model_inputs

    body = getattr(model, "module", model).body  # through a DDP wrapper
    inputs = model_inputs(body, micro_batch)
    values_BT = model(**inputs)
    return values_BT.flatten(0, 1)[micro_batch.logit_index_K.to(inputs["input_ids"].device)].float(), None


def values(batch: TrainBatch, context: StepContext) -> tuple[TrainBatch, dict[str, float]]:
    """The learning phase ``values`` (``agent_r1.train.phases``): the critic's values before the
    update, and the tokens its loss reads: each step's first token with a step-level critic
    (``gae_step``), every trained token with a token-level one."""
    if not context.learner.has_critic:
        return batch, {}
    values_T = context.learner.values(batch.all_micro_batches, batch.num_tokens)
    value_mask_T = batch.first_token_mask() if context.needs.critic == "step" else batch.tokens.mask
    return batch.with_tokens(old_values=values_T, value_mask=value_mask_T), {}
