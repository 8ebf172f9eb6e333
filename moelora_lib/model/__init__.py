"""moelora_lib.model: compact GPT-OSS / Qwen3-MoE / Qwen3 decoders whose projections carry multi-LoRA
adapter slots, HF checkpoint loading and random models at real dimensions.

* :class:`ModelConfig`, :data:`REAL_CONFIGS` (config.py): the architecture, read from a config.json dict.
* :class:`MultiLoRAModel` (modeling.py): the model, its KV cache and forward.
* :func:`load_hf_checkpoint`, :func:`random_model` (checkpoint.py).
* :func:`load_peft_adapter`, :func:`read_peft_adapter` (peft_adapters.py): PEFT adapter files into slots.
* :class:`Generator` (generate.py): batched multi-adapter generation, decode steps in CUDA graphs.

Importing this package imports torch but no kernel module (the LoRA/MoE modules load when a model is
built), so ``TRITON_INTERPRET=1`` can still be set afterwards on a CPU.
"""

from .checkpoint import load_hf_checkpoint, random_model
from .config import MODEL_TYPES, REAL_CONFIGS, ModelConfig
from .generate import GenerationResult, Generator
from .modeling import MultiLoRAModel, random_weights
from .peft_adapters import PeftAdapter, load_peft_adapter, read_peft_adapter

__all__ = [
    "ModelConfig",
    "REAL_CONFIGS",
    "MODEL_TYPES",
    "MultiLoRAModel",
    "random_weights",
    "load_hf_checkpoint",
    "random_model",
    "PeftAdapter",
    "read_peft_adapter",
    "load_peft_adapter",
    "Generator",
    "GenerationResult",
]
