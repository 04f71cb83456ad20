"""What the paper-size backbones (``flava:full``, ``vilt:B32``, ``llava:<language model>``) need offline: the
published configuration values of the HF models the papers fine-tune, and tokenizers and processors built in
code with those models' vocabulary sizes and special-token ids (docs/offline_models.md, "Paper-size
backbones"). The models themselves are assembled, randomly initialised, by :func:`rayfed.models.paper_backbone`.

A real vocabulary's content cannot be had offline. A :func:`tokenizer` here is word-level: the special tokens at
their real ids, the synthetic data's words (:func:`rayfed.data.multimodal.vocabulary`) at the lowest free ids,
and placeholders ``<unused_ID>`` for every other id, so that its length is the model's vocabulary size and every
id a model can emit decodes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rayfed.data.multimodal import vocabulary
from rayfed.lazy import DeferredModule

transformers = DeferredModule("transformers")

# The image normalization of OpenAI's CLIP, which FLAVA's image processor and LLaVA-1.5's (CLIP's) use.
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
BERT_ENCODER = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
                    hidden_act="gelu", layer_norm_eps=1e-12, qkv_bias=True)

# facebook/flava-full (config.json): a ViT-B/16 image encoder, a BERT-base text encoder and a 6-block
# multimodal encoder, all d = 768, with 768-d contrastive projections.
FLAVA_SIZES: dict[str, dict[str, Any]] = {
    "full": dict(
        image_config=dict(**BERT_ENCODER, image_size=224, patch_size=16, num_channels=3, mask_token=True,
                          vocab_size=8192),
        text_config=dict(**BERT_ENCODER, vocab_size=30522, type_vocab_size=2, max_position_embeddings=512,
                         pad_token_id=0),
        multimodal_config=dict(**{**BERT_ENCODER, "num_hidden_layers": 6}, use_cls_token=True),
        hidden_size=768, projection_dim=768, logit_scale_init_value=2.6592,
    ),
}
# dandelin/vilt-b32-mlm (config.json): ViT-B/32 patches of a 384 px image and 40 text positions in one BERT-base.
VILT_SIZES: dict[str, dict[str, Any]] = {
    "B32": dict(**BERT_ENCODER, vocab_size=30522, type_vocab_size=2, modality_type_vocab_size=2,
                max_position_embeddings=40, image_size=384, patch_size=32, num_channels=3, max_image_length=-1,
                num_images=-1, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
}
VILT_SIZE_DIVISOR = 32  # its image processor: shortest edge 384, both sides rounded down to a multiple of 32

# LLaVA-1.5 (llava-hf/llava-1.5-7b-hf): CLIP ViT-L/14 at 336 px (openai/clip-vit-large-patch14-336's vision
# tower), the second-to-last layer's patch features (CLS dropped), a 2-layer GELU MLP into the language model.
CLIP_VIT_L_14_336 = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                         image_size=336, patch_size=14, num_channels=3, projection_dim=768, hidden_act="quick_gelu",
                         layer_norm_eps=1e-5)
LLAVA_1_5 = dict(vision_feature_layer=-2, vision_feature_select_strategy="default", projector_hidden_act="gelu",
                 multimodal_projector_bias=True)

# Qwen2.5's base language models (config.json of Qwen/Qwen2.5-0.5B, -1.5B, -3B); qkv bias is Qwen2's own.
QWEN_2_5_SIZES: dict[str, dict[str, Any]] = {
    "0.5B": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, max_position_embeddings=32768),
    "1.5B": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, max_position_embeddings=131072),
    "3B": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
               num_key_value_heads=2, max_position_embeddings=32768),
}
QWEN_2_5 = dict(vocab_size=151936, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
                use_sliding_window=False, hidden_act="silu")


@dataclass(frozen=True)
class Vocabulary:
    """A model's vocabulary as far as it is known offline: its size, its special tokens (``bos_token``,
    ``eos_token``, ``pad_token``, ...: the token and its id; the unknown token may lack an id: the first free
    one), the template around one text, and LLaVA's image token (token, id) where the model reads images."""

    size: int
    special: Mapping[str, tuple[str, int | None]]
    template: str
    image: tuple[str, int] | None = None


# bert-base-uncased's, which ViLT and FLAVA read text with.
BERT_UNCASED = Vocabulary(30522, {
    "pad_token": ("[PAD]", 0), "unk_token": ("[UNK]", 100), "cls_token": ("[CLS]", 101), "sep_token": ("[SEP]", 102),
    "mask_token": ("[MASK]", 103),
}, "[CLS] $A [SEP]")
# Llama 3's (byte-level BPE: no unknown token; a prompt starts with <|begin_of_text|>); LLaVA's <image> takes the
# id of the first reserved special token.
LLAMA_3 = Vocabulary(128256, {
    "bos_token": ("<|begin_of_text|>", 128000), "eos_token": ("<|end_of_text|>", 128001),
    "pad_token": ("<|finetune_right_pad_id|>", 128004), "unk_token": ("<unk>", None),
}, "<|begin_of_text|> $A", image=("<image>", 128002))
# Qwen2.5's (byte-level BPE, no bos token: <|endoftext|> ends and pads texts); images: Qwen's <|image_pad|>.
QWEN_2_5_VOCABULARY = Vocabulary(151936, {
    "eos_token": ("<|endoftext|>", 151643), "pad_token": ("<|endoftext|>", 151643), "unk_token": ("<unk>", None),
}, "$A", image=("<|image_pad|>", 151655))


def token_ids(vocab: Vocabulary) -> dict[str, int]:
    """Every token of :func:`tokenizer` ``(vocab)`` and its id."""
    tokens: list[str | None] = [None] * vocab.size
    fixed = [*vocab.special.values(), *([vocab.image] if vocab.image else [])]
    for token, index in fixed:
        if index is not None:
            tokens[index] = token
    placed = set(tokens)
    unplaced = [token for token, index in fixed if index is None and token not in placed]
    free = (index for index, token in enumerate(tokens) if token is None)
    for token in [*unplaced, *(w for w in vocabulary() if w not in placed)]:
        tokens[next(free)] = token
    return {token or f"<unused_{index}>": index for index, token in enumerate(tokens)}


def tokenizer(vocab: Vocabulary, model_max_length: int) -> transformers.PreTrainedTokenizerFast:
    """A word-level tokenizer of ``vocab.size`` ids (see the module's docstring), split on whitespace and
    punctuation, its special tokens (and image token) never split."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    ids = token_ids(vocab)
    special = {role: token for role, (token, _) in vocab.special.items()}
    backend = Tokenizer(models.WordLevel(ids, unk_token=special["unk_token"]))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens(sorted({*special.values(), *([vocab.image[0]] if vocab.image else [])}))
    template_tokens = [token for token in vocab.template.split() if token != "$A"]
    backend.post_processor = processors.TemplateProcessing(
        single=vocab.template, special_tokens=[(token, ids[token]) for token in template_tokens]
    )
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, model_max_length=model_max_length, **special
    )


def vilt_processor(text: transformers.PreTrainedTokenizerFast, image_size: int) -> transformers.ViltProcessor:
    """dandelin/vilt-b32-mlm's: images to ``image_size`` on the shortest edge, normalized with 0.5 / 0.5."""
    images = transformers.ViltImageProcessor(
        size={"shortest_edge": image_size}, size_divisor=VILT_SIZE_DIVISOR, image_mean=[0.5] * 3, image_std=[0.5] * 3,
    )
    return transformers.ViltProcessor(image_processor=images, tokenizer=text)


def flava_processor(text: transformers.PreTrainedTokenizerFast, image_size: int) -> transformers.FlavaProcessor:
    """facebook/flava-full's: images resized and center-cropped to ``image_size``, normalized as OpenAI's CLIP."""
    images = transformers.FlavaImageProcessor(
        size={"height": image_size, "width": image_size}, crop_size={"height": image_size, "width": image_size},
        image_mean=list(OPENAI_CLIP_MEAN), image_std=list(OPENAI_CLIP_STD),
    )
    return transformers.FlavaProcessor(image_processor=images, tokenizer=text)


def llava_processor(text: transformers.PreTrainedTokenizerFast, image_token: str, image_size: int,
                    patch_size: int) -> transformers.LlavaProcessor:
    """LLaVA-1.5's: CLIP's image processor at ``image_size``; ``<image>`` in a text expands to one token per patch."""
    images = transformers.CLIPImageProcessor(
        size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size},
        image_mean=list(OPENAI_CLIP_MEAN), image_std=list(OPENAI_CLIP_STD),
    )
    return transformers.LlavaProcessor(
        image_processor=images, tokenizer=text, patch_size=patch_size, vision_feature_select_strategy="default",
        image_token=image_token, num_additional_image_tokens=1,
    )
