"""A random Llama-architecture model, saved where vLLM and transformers load it from disk.

Nothing is downloaded: the weights are drawn from a seed, in float32.
"""

import sys


def save_model(path: str, seed: int = 7) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=1024,
        max_position_embeddings=2048,
        torch_dtype="float32",
    )
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)


if __name__ == "__main__":
    save_model(sys.argv[1])
