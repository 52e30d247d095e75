"""Which SDPA kernel the installed PyTorch picks on this card (``torch._fused_sdp_choice``)
in one training step of transformers models built from bundled configs (random weights),
the ground truth for ``vramplan/trace/cuda_sdpa.py``'s selection rules::

    python -m benchmarks.gpu_harvest.sdpa_choice > sdpa_choice.txt

Each line: the model, then every distinct call as (kernel, mask shape / dtype /
requires_grad, dropout, is_causal, query dtype) with its count.
"""

from __future__ import annotations

import collections
import json
from pathlib import Path

import torch
import torch.nn.functional as F

KERNELS = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn"}
CONFIGS = Path(__file__).resolve().parents[2] / "src" / "vramplan" / "data" / "hf"
CASES = (  # name, bundled config, dtype
    ("flan-t5-small fp16", "google/flan-t5-small.json", torch.float16),
    ("flan-t5-small bf16", "google/flan-t5-small.json", torch.bfloat16),
    ("bert-base bf16", "google-bert/bert-base-uncased.json", torch.bfloat16),
    ("gpt2 bf16", "openai-community/gpt2.json", torch.bfloat16),
)


def recording(seen: collections.Counter):
    """``F.scaled_dot_product_attention`` that counts the kernel each call gets."""
    original = F.scaled_dot_product_attention

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kw):
        gqa = kw.get("enable_gqa", False)
        kernel = torch._fused_sdp_choice(
            q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=gqa
        )
        mask = None
        if attn_mask is not None:
            mask = (tuple(attn_mask.shape), str(attn_mask.dtype), attn_mask.requires_grad)
        seen[(KERNELS.get(kernel, kernel), mask, dropout_p, is_causal, str(q.dtype))] += 1
        return original(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, **kw)

    return sdpa


def main() -> None:
    import transformers
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForMaskedLM,
        T5Config,
        T5ForConditionalGeneration,
    )

    seen: collections.Counter = collections.Counter()
    F.scaled_dot_product_attention = recording(seen)
    print(
        "torch",
        torch.__version__,
        "cudnn",
        torch.backends.cudnn.version(),
        "transformers",
        transformers.__version__,
        torch.cuda.get_device_name(),
    )
    for name, path, dtype in CASES:
        config = json.loads((CONFIGS / path).read_text())
        if config["model_type"] == "t5":
            model = T5ForConditionalGeneration(T5Config(**config))
        elif config["model_type"] == "bert":
            model = AutoModelForMaskedLM.from_config(AutoConfig.for_model(**config))
        else:
            model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
        seen.clear()
        model = model.to("cuda", dtype).train()
        ids = torch.randint(0, 1000, (4, 256), device="cuda")
        model(input_ids=ids, labels=ids).loss.backward()
        print(name, json.dumps([[list(map(str, key)), n] for key, n in seen.items()]))
        del model


if __name__ == "__main__":
    main()
