"""A random Llama-architecture model, saved where vLLM and transformers load it from disk,
with (``--tokenizer``) a tokenizer of its own for vLLM's OpenAI server.

Nothing is downloaded: the weights are drawn from a seed, in float32, and the tokenizer is a
byte-level BPE trained here on text made up from a seed.
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


def save_tokenizer(path: str, seed: int = 7) -> None:
    """A byte-level BPE of the model's 1024 ids (``<unk>``, ``<s>``, ``</s>`` first, as the
    model's config expects), with a chat template, trained on made-up words."""
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 8))) for _ in range(600)]
    corpus = [" ".join(rng.choice(words) for _ in range(40)) for _ in range(400)]
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1024,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant:{% endif %}"
    )
    fast.save_pretrained(path)


if __name__ == "__main__":
    save_model(sys.argv[1])
    if "--tokenizer" in sys.argv[2:]:
        save_tokenizer(sys.argv[1])
