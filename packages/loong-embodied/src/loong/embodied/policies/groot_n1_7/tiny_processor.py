"""A tiny Qwen3-VL-style processor (BPE tokenizer + Qwen2-VL image processor), built offline from shipped text.

The ``tiny`` preset cannot download Cosmos-Reason2-2B's processor, so it uses this one: the same special tokens,
the same chat-template shape (``<|vision_start|><|image_pad|><|vision_end|>`` per image inside one user turn) and
the published image patching (16-pixel patches, 2x2 merge, 2 frames per temporal patch), with a ~300-token
vocabulary trained on a few sentences and images capped at 64x64 pixels (``longest_edge=4096`` pixels: 4 tokens
per image), which keeps CPU tests fast.
"""

from __future__ import annotations

from pathlib import Path

#: Qwen's special tokens, in Qwen's order (ids 0..6 of the tiny vocabulary)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                  "<|image_pad|>", "<|video_pad|>"]

#: the chat template: one turn per message; images as vision-start / image-pad / vision-end, text as is
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif item['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CORPUS = [
    "pick up the red cube and place it in the box",
    "reach the coloured target in the scene",
    "push the blue block to the left",
    "open the drawer and close it again",
    "move the arm to the green marker",
    "put the spoon next to the bowl",
    "stack the yellow cup on the plate",
    "perform the task",
    "user assistant system robot camera image video state action",
]


def build_tokenizer():
    """A ``PreTrainedTokenizerFast`` with a byte-level BPE trained on :data:`CORPUS` and Qwen's special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(CORPUS, trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<|endoftext|>", eos_token="<|im_end|>",
                                  additional_special_tokens=SPECIAL_TOKENS[1:])
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_tiny_processor():
    """The tiny ``Qwen3VLProcessor`` (left padding, as GR00T sets it)."""
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor

    tok = build_tokenizer()
    patching = dict(patch_size=16, merge_size=2, temporal_patch_size=2)
    image = Qwen2VLImageProcessor(**patching, size={"shortest_edge": 1024, "longest_edge": 4096})
    video = Qwen3VLVideoProcessor(**patching, size={"shortest_edge": 1024, "longest_edge": 4096})
    proc = Qwen3VLProcessor(image_processor=image, tokenizer=tok, video_processor=video,
                            chat_template=CHAT_TEMPLATE)
    proc.tokenizer.padding_side = "left"
    return proc


def save_tiny_processor(directory: str | Path) -> Path:
    """Write the tiny processor's files (tokenizer, chat template, image/video processor configs) to
    ``directory``; the same files also load piecewise (``AutoTokenizer`` + ``Qwen2VLImageProcessor`` +
    ``Qwen3VLVideoProcessor``) as lerobot's GR00T processor loads them."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    proc = build_tiny_processor()
    proc.save_pretrained(str(directory))
    proc.tokenizer.save_pretrained(str(directory))
    proc.image_processor.save_pretrained(str(directory))
    proc.video_processor.save_pretrained(str(directory))
    return directory


__all__ = ["CHAT_TEMPLATE", "SPECIAL_TOKENS", "build_tiny_processor", "build_tokenizer", "save_tiny_processor"]
