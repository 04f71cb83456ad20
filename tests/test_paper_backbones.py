"""Paper-size backbones offline (``flava:full``, ``vilt:B32``, ``llava:<language model>``): the published shapes on
the meta device, offline tokenizers and processors of the real vocabulary sizes, one CPU forward at one block."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from rayfed.config import LoraConfig, ModelConfig, load_config
from rayfed.errors import ConfigError
from rayfed.method import build_method
from rayfed.models import build_backbone, build_client_model, paper_backbone, paper_model

from conftest import CountedOps

ROOT = Path(__file__).resolve().parents[1]

# The published sizes (config.json of meta-llama/Llama-3.2-1B, -3B and Qwen/Qwen2.5-0.5B, -1.5B, -3B): hidden,
# blocks, heads, kv heads, MLP width; and each model card's parameter count (tied input and output embeddings).
LANGUAGE_MODELS = {
    "llama-1B": (transformers.LlamaConfig, 2048, 16, 32, 8, 8192, 128256, 1_235_814_400),
    "llama-3B": (transformers.LlamaConfig, 3072, 28, 24, 8, 8192, 128256, 3_212_749_824),
    "qwen-0.5B": (transformers.Qwen2Config, 896, 24, 14, 2, 4864, 151936, 494_032_768),
    "qwen-1.5B": (transformers.Qwen2Config, 1536, 28, 12, 2, 8960, 151936, 1_543_714_304),
    "qwen-3B": (transformers.Qwen2Config, 2048, 36, 16, 2, 11008, 151936, 3_085_938_688),
}
# CLIP ViT-L/14's vision tower (303,179,776 parameters at 224 px) at 336 px: 577 positions instead of 257.
CLIP_L_14_336 = dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096,
                     image_size=336, patch_size=14)
CLIP_L_14_336_PARAMETERS = 303_179_776 + (577 - 257) * 1024


def _meta(name: str) -> torch.nn.Module:
    with torch.device("meta"):
        return build_backbone(ModelConfig(backbone=name), seed=0).encoder


def _shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {name: tuple(param.shape) for name, param in model.named_parameters()}


def _count(model: torch.nn.Module, skip: tuple[str, ...] = ()) -> int:
    return sum(param.numel() for name, param in model.named_parameters() if not name.startswith(skip))


@pytest.mark.parametrize("language", LANGUAGE_MODELS)
def test_llava_backbones_have_llava_1_5s_shapes_and_the_language_models_published_sizes(language):
    encoder = _meta(f"llava:{language}")
    config_class, hidden, layers, heads, kv_heads, mlp, vocab, published = LANGUAGE_MODELS[language]
    head_dim = hidden // heads
    text = config_class(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                        num_key_value_heads=kv_heads, intermediate_size=mlp, vocab_size=vocab, head_dim=head_dim,
                        tie_word_embeddings=True)
    reference_config = transformers.LlavaConfig(
        vision_config=transformers.CLIPVisionConfig(**CLIP_L_14_336), text_config=text, projector_hidden_act="gelu",
    )
    with torch.device("meta"):
        reference = transformers.LlavaForConditionalGeneration(reference_config)
    assert _shapes(encoder) == _shapes(reference)
    assert _count(encoder, skip=("model.vision_tower", "model.multi_modal_projector")) == published
    assert _count(encoder.model.vision_tower) == CLIP_L_14_336_PARAMETERS
    projector = encoder.model.multi_modal_projector
    assert (projector.linear_1.weight.shape, projector.linear_2.weight.shape) == ((hidden, 1024), (hidden, hidden))
    assert isinstance(projector.act, transformers.activations.GELUActivation)
    config = encoder.config
    assert (config.vision_feature_layer, config.vision_feature_select_strategy, config.image_seq_length) == (
        -2, "default", 576)
    assert encoder.lm_head.weight is encoder.model.language_model.embed_tokens.weight  # tied
    assert config.text_config.rope_parameters["rope_theta"] == (500000.0 if language.startswith("llama") else 1e6)


@pytest.mark.parametrize("name, reference", [
    ("flava:full", lambda: transformers.FlavaModel(transformers.FlavaConfig())),
    ("vilt:B32", lambda: transformers.ViltModel(transformers.ViltConfig())),
])
def test_flava_and_vilt_have_the_shapes_of_the_models_transformers_defaults_describe(name, reference):
    """transformers documents FlavaConfig() as facebook/flava-full's and ViltConfig() as dandelin/vilt-b32-mlm's
    architecture."""
    with torch.device("meta"):
        expected = reference()
    encoder = _meta(name)
    assert _shapes(encoder) == _shapes(expected)
    assert _count(encoder) == {"flava:full": 241_356_289, "vilt:B32": 111_595_008}[name]


@pytest.mark.parametrize("name, image_size", [("flava:full", 224), ("vilt:B32", 384), ("llava:llama-1B", 336),
                                              ("llava:qwen-0.5B", 336)])
def test_offline_processors_make_ids_within_the_vocabulary_and_images_of_the_models_size(name, image_size):
    model = paper_model(name)
    processor, tokenizer = model.processor, model.processor.tokenizer
    text_config = model.config.text_config if hasattr(model.config, "text_config") else model.config
    assert len(tokenizer) == text_config.vocab_size
    image = np.random.default_rng(0).integers(0, 256, size=(48, 48, 3), dtype=np.uint8)
    text = "Question : what color is the circle ?"
    prompt = f"{processor.image_token} {text}" if name.startswith("llava") else text
    inputs = processor(text=[prompt], images=[image], return_tensors="pt")
    ids = inputs["input_ids"][0]
    assert inputs["pixel_values"].shape == (1, 3, image_size, image_size)
    assert 0 <= int(ids.min()) and int(ids.max()) < text_config.vocab_size
    assert tokenizer.unk_token_id not in ids.tolist()  # the synthetic data's words are in the vocabulary
    assert tokenizer.decode(ids, skip_special_tokens=True).split() == text.split()
    if name.startswith("llava"):
        assert int((ids == model.config.image_token_id).sum()) == 576  # one per 14 px patch of 336 px
    if name == "llava:llama-1B":
        assert ids[0] == 128000  # <|begin_of_text|>
    if name in ("flava:full", "vilt:B32"):
        assert (ids[0], ids[-1]) == (101, 102)  # [CLS] ... [SEP] of bert-base-uncased


def test_llava_on_both_llama_sizes_share_one_tokenizer_as_fedmosaics_w_s_requires():
    small, large = (paper_model(f"llava:llama-{size}").processor.tokenizer for size in ("1B", "3B"))
    assert small.get_vocab() == large.get_vocab()
    assert small.get_vocab() != paper_model("llava:qwen-0.5B").processor.tokenizer.get_vocab()


@pytest.mark.parametrize("name", ["vilt:B32", "flava:full", "llava:qwen-0.5B"])
def test_a_one_block_version_runs_forward_through_a_client_model_on_the_cpu(name):
    backbone = paper_backbone(name, layers=1)
    assert backbone.encoder.dtype == torch.float32  # no GPU here
    config = ModelConfig(backbone=name, lora=LoraConfig(rank=2))
    model = build_client_model(backbone, config, 3, seed=0, private_copy=False)
    assert any("lora_" in n for n in model.trainable_names())
    texts = [f"{backbone.image_prompt} a red circle", f"{backbone.image_prompt} the blue square"]
    if backbone.generates_text:
        texts = texts[:1]  # 576 image tokens and 3 words (Qwen has no <bos>): one is enough on a CPU
    encoded = backbone.tokenizer(texts, padding=True, return_tensors="pt")
    batch = {"pixel_values": torch.rand(len(texts), 3, 32, 32), "input_ids": encoded["input_ids"],
             "attention_mask": encoded["attention_mask"]}
    with torch.no_grad():
        # a causal LM: its next-token logits, which a text-generation task trains; else the classifier head's
        outputs = model.lm_logits(batch) if backbone.generates_text else model(batch)
    vocabulary = backbone.encoder.config.text_config.vocab_size if backbone.generates_text else None
    assert outputs.shape == ((1, 576 + 3, vocabulary) if backbone.generates_text else (2, 3))
    assert torch.isfinite(outputs).all()


@pytest.mark.parametrize("name, allowed", [
    ("llava:llama-8B", "llava:llama-1B, llava:llama-3B, llava:qwen-0.5B, llava:qwen-1.5B, llava:qwen-3B"),
    ("vilt:B16", "vilt:B32"),
    ("flava:base", "flava:full"),
])
def test_an_unknown_size_is_one_sentence_listing_the_sizes(name, allowed):
    with pytest.raises(ConfigError, match=rf"model\.backbone = '{name}' is not known.*; allowed: {allowed}\.$"):
        build_backbone(ModelConfig(backbone=name), seed=0)


def test_the_offline_twin_of_drake_static_is_the_paper_config_on_paper_size_models_and_synthetic_tasks():
    twin = load_config(ROOT / "configs" / "fedmosaic" / "paper_drake_static_offline.yaml")
    paper = load_config(ROOT / "configs" / "fedmosaic" / "paper_drake_static.yaml")
    assert (twin.federation, twin.train, twin.model.lora, twin.placement, twin.ray, twin.data.stream) == (
        paper.federation, paper.train, paper.model.lora, paper.placement, paper.ray, paper.data.stream)
    assert twin.ray.object_store_memory == 24 * 10**9  # a round's payloads and uploads, about 10 GB, fit
    assert [task.clients for task in twin.data.tasks] == [task.clients for task in paper.data.tasks]
    assert {name: (arch.clients, arch.backbone) for name, arch in twin.architectures.items()} == {
        "llama1b": (paper.architectures["llama1b"].clients, "llava:llama-1B"),
        "llama3b": (paper.architectures["llama3b"].clients, "llava:llama-3B"),
    }
    paper_to_twin = {paper.architectures["llama1b"].backbone: "llava:llama-1B"}
    for ours, theirs in zip(twin.methods, paper.methods, strict=True):
        params = {k: paper_to_twin.get(v, v) if k == "relevance_model" else v for k, v in theirs.params.items()}
        assert (ours.name, ours.label, ours.params) == (theirs.name, theirs.label, params)
        build_method(ours, 0, num_clients=10, architecture_of=["llama1b"] * 4 + ["llama3b"] * 6)
    # the 576 image tokens, <|begin_of_text|>, a question of the offline tasks and its answer fit every text
    assert {task.max_text_length for task in twin.data.tasks} == {576 + 10}


def test_pfedmmas_clip_vit_b_16_builds_offline_at_its_published_size_without_pretrained_weights():
    """The twins' open_clip:ViT-B-16 (no model.pretrained) is open_clip's own model, randomly initialised: both towers
    at CLIP ViT-B/16's published size and its real BPE tokenizer, nothing downloaded."""
    import open_clip

    model = open_clip.create_model("ViT-B-16", pretrained=None, device="meta")
    assert _count(model) == 149_620_737 and _count(model.visual) == 86_192_640
    assert (model.token_embedding.weight.shape, model.text_projection.shape) == ((49408, 512), (512, 512))
    assert open_clip.get_tokenizer("ViT-B-16")(["a photo of a class_3."]).shape == (1, 77)


def test_text_targets_end_with_the_separator_where_a_bert_tokenizer_has_no_end_of_sequence_token():
    from rayfed.data.sources.dataset import ArrayDataset
    from rayfed.tasks.kinds import TextGeneration, end_of_text_id

    backbone = paper_backbone("vilt:B32", layers=1)  # ViLT's (BERT's) tokenizer: [SEP], no eos token
    tokenizer = backbone.tokenizer
    assert tokenizer.eos_token_id is None and end_of_text_id(tokenizer) == tokenizer.sep_token_id
    dataset = ArrayDataset(text=np.array(["what color is it", "what shape"]), target=np.array(["red", "a circle"]))
    columns = TextGeneration().encode(dataset, np.arange(2), backbone)
    ends = [row[row != tokenizer.pad_token_id][-1] for row in columns["target_ids"]]
    assert ends == [tokenizer.sep_token_id] * 2


def test_a_tokenizer_with_neither_end_token_is_one_sentence():
    from types import SimpleNamespace

    from rayfed.tasks.kinds import end_of_text_id

    with pytest.raises(ConfigError, match=r"has neither an end-of-sequence nor a separator token"):
        end_of_text_id(SimpleNamespace(eos_token_id=None, sep_token_id=None))


@pytest.mark.parametrize("max_image_length", [-1, 5])
def test_vilts_unpadded_patch_embedding_is_transformers_bitwise_without_reading_values_back(max_image_length):
    """rayfed's ViLT embeds a batch of unpadded images (no pixel_mask) with transformers' draws of the patch order and
    the same products, without a host read per image; with a pixel_mask it is transformers' own code."""
    backbone = paper_backbone("vilt:B32", layers=1)
    encoder = backbone.encoder.eval()
    encoder.config.max_image_length = max_image_length
    reference = transformers.ViltModel(encoder.config).eval()
    reference.load_state_dict(encoder.state_dict())
    size = encoder.config.image_size
    pixels = torch.randn(3, 3, size, size, generator=torch.Generator().manual_seed(0))
    ids = torch.tensor([[101, 2000, 102]] * 3)
    outputs = {}
    for name, model in (("rayfed", encoder), ("transformers", reference)):
        torch.manual_seed(7)
        with torch.no_grad(), CountedOps() as reads:
            out = model(input_ids=ids, pixel_values=pixels)
        outputs[name] = (out.last_hidden_state, out.pooler_output, torch.rand(1), reads.count)
    (hidden, pooled, next_draw, reads), (ref_hidden, ref_pooled, ref_next_draw, ref_reads) = outputs.values()
    assert torch.equal(hidden, ref_hidden) and torch.equal(pooled, ref_pooled)
    assert torch.equal(next_draw, ref_next_draw)  # the same draws from the host's generator
    assert ref_reads - reads >= 5 * len(pixels)  # what is left is transformers' attention mask check, in both
    torch.manual_seed(7)
    with torch.no_grad():
        masked = encoder(input_ids=ids, pixel_values=pixels, pixel_mask=torch.ones(3, size, size, dtype=torch.long))
    assert torch.equal(masked.pooler_output, ref_pooled)


def test_llavas_forward_under_a_capture_reads_nothing_back_and_gives_the_uncaptured_logits(monkeypatch):
    """Under a CUDA graph's capture (as transformers and rayfed tell one, stood in for on the CPU) LLaVA's training
    forward over images and padded texts reads no value back to the host, which a capture cannot hold, and gives the
    uncaptured logits bitwise; uncaptured, transformers' check of the image tokens' count runs as before."""
    from rayfed.models.families import llava
    from rayfed.models.features import causal_lm_logits

    backbone = build_backbone(ModelConfig(backbone="tiny-pretrained:llava"), 0)
    encoder, config = backbone.encoder, backbone.encoder.config
    image = [config.image_token_id] * config.image_seq_length
    ids = torch.tensor([[1, *image, 6, 7, 8, 9]] * 2)
    mask = torch.ones_like(ids)
    mask[1, -2:] = 0
    size = config.vision_config.image_size
    batch = {"input_ids": ids, "attention_mask": mask,
             "pixel_values": torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(0))}
    with CountedOps() as uncaptured_reads:
        uncaptured = causal_lm_logits(encoder, batch)
    short = ids.clone()
    short[:, 1] = 6  # a text of one image token too few
    with pytest.raises(ValueError, match="Image features and image tokens do not match"):
        causal_lm_logits(encoder, {**batch, "input_ids": short})
    assert uncaptured_reads.count >= 1
    monkeypatch.setattr(llava, "capturing", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)  # transformers' own test
    with CountedOps() as reads:
        captured = causal_lm_logits(encoder, batch)
    assert reads.count == 0 and torch.equal(captured, uncaptured)


def test_vilts_patch_order_on_a_gpu_keeps_distinct_patches_drawn_afresh_for_each_image():
    """On a GPU the patch order is drawn by the device's generator (which a CUDA graph replays afresh), here the
    CPU's: each image keeps ``chosen`` distinct patches."""
    from rayfed.models.families.vilt import device_patch_order

    torch.manual_seed(3)
    order = device_patch_order(4, 9, 5, torch.device("cpu"))
    assert order.shape == (4, 5) and all(len(set(row.tolist())) == 5 for row in order)
    assert order.min() >= 0 and order.max() < 9
    assert not torch.equal(order[0], order[1])  # a fresh order per image
    whole = device_patch_order(2, 9, 9, torch.device("cpu"))
    assert all(sorted(row.tolist()) == list(range(9)) for row in whole)  # every patch kept: a permutation


def test_a_paper_size_backbones_random_weights_are_drawn_on_the_requested_device():
    """An actor draws a paper-size model's random weights on its own device (its GPU, not its one CPU thread);
    ``meta`` gives the shapes without memory; without a device they are drawn as before, bitwise."""
    meta = build_backbone(ModelConfig(backbone="vilt:B32"), seed=0, device="meta").encoder
    assert all(param.is_meta for param in meta.parameters()) and _count(meta) == 111_595_008
    torch.manual_seed(0)
    default = paper_backbone("vilt:B32", layers=1).encoder
    torch.manual_seed(0)
    on_cpu = paper_backbone("vilt:B32", layers=1, device="cpu").encoder
    assert all(param.device.type == "cpu" for param in on_cpu.parameters())
    assert all(torch.equal(a, b) for a, b in zip(default.state_dict().values(), on_cpu.state_dict().values()))


def test_an_actor_asks_for_its_backbone_on_its_own_device(monkeypatch, tiny_run):
    from rayfed.actors import client

    asked = []

    def recorded(config, seed, device=None):
        asked.append(device)
        return build_backbone(config, seed, device)

    monkeypatch.setattr(client, "build_backbone", recorded)
    actor = client.ClientActor(load_config(tiny_run), [0, 1])
    assert asked == [actor.device]


def test_the_preflight_checks_paper_size_backbones_from_their_shapes_without_drawing_their_weights(monkeypatch):
    """The driver's preflight builds a paper-size backbone (and FedMosaic's W_s) on the meta device: billions of
    random weights are not drawn on its CPU; the method's model is built and the tasks encoded (for LLaVA's 576 image
    tokens), the forward is left to the actors."""
    from rayfed.actors.client import run_methods
    from rayfed.data.clients import build_federation
    from rayfed.methods.fedmosaic import method as fedmosaic_method
    from rayfed.simulation import check_model, preflight

    built = []

    def meta_only(config, seed, device=None):
        assert device is not None and torch.device(device).type == "meta", f"{config.backbone} built on {device}"
        built.append(config.backbone)
        return build_backbone(config, seed, device)

    monkeypatch.setattr(preflight, "build_backbone", meta_only)
    monkeypatch.setattr(fedmosaic_method, "build_backbone", meta_only)
    task = {"source": "task-groups:vqa", "kind": "text_generation", "partition": {"name": "iid"},
            "max_text_length": 576 + 10, "options": {"group": 0, "num_samples": 8, "question_types": ["color"]}}
    config = load_config({
        "data": {"tasks": [{**task, "name": "a", "clients": [0]}, {**task, "name": "b", "clients": [1]}]},
        "model": {"backbone": "llava:llama-1B", "lora": {"rank": 8, "alpha": 16}},
        "federation": {"rounds": 1, "clients_per_round": 2},
        "methods": [{"name": "fedmosaic", "relevance_model": "llava:llama-3B"}],  # W_s: another size, one vocabulary
        "placement": {"executor": "local"},
    })
    federation = build_federation(config.data, config.seed)
    check_model(config, federation, run_methods(config, federation))
    assert built == ["llava:llama-1B", "llava:llama-3B"]
