"""Builds a tiny Qwen2-VL model with random weights, its tokenizer and its processor, in a
directory vLLM can serve: the whole of ``vllm serve``'s multimodal path (the processor
making ``pixel_values`` and ``image_grid_thw``, the multimodal cache, the engine's RPC,
the vision tower and the language model on the worker) without downloading anything.

    python tiny_model.py DIR

The weights are random (seeded), so the text it generates means nothing; what it shows is
whether the image a worker reads is the image the front-end processed: the model's
log-probabilities depend on every pixel value through the vision tower.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    Qwen2TokenizerFast,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen2VLImageProcessor,
    Qwen2VLProcessor,
    Qwen2VLVideoProcessor,
)

SPECIAL = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]

# The chat template: Qwen2-VL's shape (system-less), images as a vision_start /
# image_pad / vision_end triple the processor expands to one pad per merged patch.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tokenizer() -> Qwen2TokenizerFast:
    """A byte-level tokenizer: one token per byte, then the special tokens."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL)
    return Qwen2TokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        bos_token=None,
    )


def build(out: Path) -> None:
    torch.manual_seed(0)
    tok = tokenizer()
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL}
    vocab = len(tok)
    config = Qwen2VLConfig(
        text_config=dict(
            vocab_size=vocab,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=32768,
            rope_scaling={"type": "mrope", "mrope_section": [8, 12, 12]},
            tie_word_embeddings=False,
            bos_token_id=ids["<|endoftext|>"],
            eos_token_id=ids["<|im_end|>"],
        ),
        vision_config=dict(
            depth=2,
            embed_dim=32,
            hidden_size=128,
            num_heads=2,
            mlp_ratio=2,
            in_channels=3,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
        ),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        torch_dtype="float32",
    )
    model = Qwen2VLForConditionalGeneration(config)
    # Random weights large enough that the vision tower moves the logits.
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model.save_pretrained(out, safe_serialization=True)
    # Up to 1344 x 1344 pixels (2304 tokens), so that `check_serve.py --scale` can send
    # images of realistic size (a 1344 x 1008 image is 24 MiB of float32 patches).
    image_processor = Qwen2VLImageProcessor(min_pixels=28 * 28, max_pixels=1344 * 1344)
    processor = Qwen2VLProcessor(
        image_processor=image_processor,
        tokenizer=tok,
        video_processor=Qwen2VLVideoProcessor(),
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(out)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(out)


if __name__ == "__main__":
    build(Path(sys.argv[1]))
