"""What a paper config meets on real data and real hub checkpoints, checked offline: ``${VAR}`` in config strings,
text limits that follow the model, hub checkpoints in the dtype they ship in, chat templates, QuickGELU for
OpenAI's CLIP weights."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import yaml

from rayfed.config import load_config
from rayfed.config.loading import dump_config
from rayfed.errors import ConfigError

MOSAIC_SOURCE = "hf:${DRAKE_ROOT}/client0/task0"


def _with_task_sources(tiny_run: dict, *sources: str) -> dict:
    run = copy.deepcopy(tiny_run)
    data = run.pop("data")
    run["data"] = {"tasks": [
        {"name": f"t{index}", "source": source, "synthetic": data["synthetic"], "partition": data["partition"],
         "num_clients": 2} for index, source in enumerate(sources)]}
    run["federation"]["clients_per_round"] = 2
    return run


# ${VAR} in config strings ----------------------------------------------------------------------------------------
def test_a_braced_variable_in_a_yaml_config_expands_and_the_dumped_config_holds_its_value(tiny_run, tmp_path,
                                                                                           monkeypatch):
    monkeypatch.setenv("DRAKE_ROOT", "/data/drake")
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(_with_task_sources(tiny_run, "synthetic", MOSAIC_SOURCE)))
    config = load_config(path)
    assert config.data.tasks[1].source == "hf:/data/drake/client0/task0"
    dump_config(config, tmp_path / "config.yaml")
    rerun = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert rerun["data"]["tasks"][1]["source"] == "hf:/data/drake/client0/task0"


def test_variables_expand_in_dicts_and_overrides_and_only_the_braced_form(tiny_run, monkeypatch):
    monkeypatch.setenv("RUN_NAME", "drake")
    monkeypatch.setenv("ROOT", "/data")
    config = load_config({**tiny_run, "name": "${RUN_NAME}-$RUN_NAME"}, ["model.pretrained=${ROOT}/w.pt"])
    assert config.name == "drake-$RUN_NAME"
    assert config.model.pretrained == "/data/w.pt"
    assert tiny_run["name"] == "tiny"  # the caller's dict is left as it was


def test_an_unset_variable_is_refused_naming_it_and_the_field(tiny_run, monkeypatch):
    monkeypatch.delenv("DRAKE_ROOT", raising=False)
    with pytest.raises(ConfigError) as info:
        load_config(_with_task_sources(tiny_run, "synthetic", "synthetic", MOSAIC_SOURCE))
    message = str(info.value)
    assert message.startswith(f"data.tasks.2.source = {MOSAIC_SOURCE!r} uses the environment variable DRAKE_ROOT, "
                              "which is not set; export it")
    assert "\n" not in message and message.endswith(".")


# A hub-like LLaVA folder: CLIP at 336 px, patch 14 (576 image tokens), a small Llama, stored in bf16 ---------------
LLAMA3_TEMPLATE = (  # the shape of Llama 3's chat template (no system turn), as the FedMosaic authors' code sets it
    "{{- bos_token }}{%- for message in messages %}{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)


def _hub_llava(folder, chat_template: str | None = None, positions: int = 2048) -> str:
    """Saved as a hub checkpoint would be: bf16 weights, a tokenizer without a stated limit (transformers' "no limit"
    model_max_length), the processor that expands ``<image>``, and optionally a chat template."""
    import torch
    import transformers

    from rayfed.zoo import paper
    from rayfed.zoo.tokenizers import IMAGE, word_tokenizer

    tokenizer = word_tokenizer(append_eos=False, model_max_length=int(1e30))
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>",
                                                                "<|eot_id|>"]})
    tokenizer.add_tokens(["user", "assistant"])  # the template's role names, words the offline vocabulary lacks
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    small = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    vision = transformers.CLIPVisionConfig(**small, image_size=336, patch_size=14)
    text = transformers.LlamaConfig(**small, num_key_value_heads=1, vocab_size=len(tokenizer),
                                    max_position_embeddings=positions, bos_token_id=tokenizer.bos_token_id,
                                    eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    config = transformers.LlavaConfig(vision_config=vision, text_config=text, image_seq_length=576,
                                      image_token_id=tokenizer.convert_tokens_to_ids(IMAGE))
    torch.manual_seed(0)
    transformers.LlavaForConditionalGeneration(config).to(torch.bfloat16).save_pretrained(folder)
    paper.llava_processor(tokenizer, IMAGE, 336, 14).save_pretrained(folder)
    return str(folder)


def _vqa(rows: int = 3, size: int = 8):
    import numpy as np

    from rayfed.data.sources import ArrayDataset

    rng = np.random.default_rng(0)
    return ArrayDataset(images=rng.random((rows, size, size, 3), dtype=np.float32),
                        text=np.array(["what shape is this ?", "what color is the circle ?", "is the circle red ?"][:rows]),
                        target=np.array(["a red circle", "blue", "red"][:rows]))


@pytest.fixture(scope="module")
def hub_llava(tmp_path_factory) -> str:
    return _hub_llava(tmp_path_factory.mktemp("llava"))


@pytest.fixture(scope="module")
def chat_llava(tmp_path_factory) -> str:
    return _hub_llava(tmp_path_factory.mktemp("chat-llava"), LLAMA3_TEMPLATE)


def _backbone(folder: str, **model):
    from rayfed.config import ModelConfig
    from rayfed.models import build_backbone

    return build_backbone(ModelConfig(backbone=f"hf:{folder}", **model), seed=0)


# Text limits -------------------------------------------------------------------------------------------------------
def test_a_hub_llava_reads_its_576_image_tokens_within_its_own_limit_and_pads_to_the_data_not_the_limit(hub_llava):
    import numpy as np

    from rayfed.tasks.kinds import IGNORE, Classification, TextGeneration

    backbone = _backbone(hub_llava)
    assert backbone.text_limit == 2048  # its positions: the tokenizer states no limit, and 512 is no cap
    columns = TextGeneration().encode(_vqa(), np.arange(3), backbone)
    image_tokens = (columns["input_ids"] == backbone.encoder.config.image_token_id).sum(dim=1)
    assert image_tokens.tolist() == [576, 576, 576]
    assert columns["input_ids"].shape == (3, 640)  # <bos>, 576, 7 question tokens, 4 target tokens: up to 64 * 10
    targets = columns["labels"][columns["labels"] != IGNORE]
    assert backbone.tokenizer.decode(targets[:3]) == "a red circle"
    dataset = dataclasses.replace(_vqa(), labels=np.array([0, 1, 0]))
    ids = Classification().encode(dataset, np.arange(3), backbone)["input_ids"]
    assert ids.shape == (3, 640) and ids.shape[1] < backbone.text_limit


def test_a_prompt_over_the_models_own_limit_is_refused_naming_the_limit(tmp_path):
    import numpy as np

    from rayfed.tasks.kinds import TextGeneration

    backbone = _backbone(_hub_llava(tmp_path, positions=580))
    with pytest.raises(ConfigError, match=r"a prompt of 582 tokens and a target of 4 exceed the text limit of "
                                          r"model\.backbone = 'hf:.*', 580 tokens \(its image tokens included\)"):
        TextGeneration().encode(_vqa(1), np.arange(1), backbone)


def test_the_text_limit_is_the_models_positions_or_a_stated_tokenizer_limit_below_them():
    from types import SimpleNamespace

    from rayfed.models.families.common import _text_limit

    assert _text_limit(SimpleNamespace(model_max_length=int(1e30)), 131072) == 131072
    assert _text_limit(SimpleNamespace(model_max_length=8192), 131072) == 8192
    assert _text_limit(SimpleNamespace(model_max_length=4096), 40) == 40
    assert _text_limit(SimpleNamespace(), 2048) == 2048


# Hub checkpoints' dtype ----------------------------------------------------------------------------------------------
def test_a_hub_checkpoint_keeps_its_shipped_dtype_on_a_gpu_and_float32_on_a_cpu(hub_llava):
    import torch

    from rayfed.config import ModelConfig
    from rayfed.models import load_hf_backbone
    from rayfed.models.families.common import weights_dtype

    assert weights_dtype("auto", "cuda") == "auto" and weights_dtype("auto", torch.device("cuda", 1)) == "auto"
    assert weights_dtype("auto", "cpu") is torch.float32
    assert weights_dtype(torch.bfloat16, "cuda") is torch.bfloat16  # the llama:/llava: twins' rule, the same function
    on_gpu = load_hf_backbone(hub_llava, ModelConfig(backbone=f"hf:{hub_llava}"), dtype=weights_dtype("auto", "cuda"))
    assert {p.dtype for p in on_gpu.encoder.parameters()} == {torch.bfloat16}
    if not torch.cuda.is_available():  # this process's own rule: float32 on a CPU
        assert {p.dtype for p in _backbone(hub_llava).encoder.parameters()} == {torch.float32}


# Chat templates ------------------------------------------------------------------------------------------------------
def test_a_llava_with_a_chat_template_reads_the_users_turn_and_learns_the_assistants_answer(chat_llava):
    import numpy as np

    from rayfed.tasks.kinds import IGNORE, TextGeneration

    backbone = _backbone(chat_llava)
    assert backbone.chat_template
    columns = TextGeneration().encode(_vqa(1), np.arange(1), backbone)
    tokens = backbone.tokenizer.convert_ids_to_tokens(columns["input_ids"][0][columns["attention_mask"][0].bool()])
    assert tokens[:3] == ["<bos>", "<|start_header_id|>", "user"]  # one <bos>: the template's, none added again
    # LLaVA's layout in the user's turn: the image tokens, a new line, the question
    assert tokens[4:580] == ["<image>"] * 576 and tokens[580:] == [
        "what", "shape", "is", "this", "?", "<|eot_id|>", "<|start_header_id|>", "assistant", "<|end_header_id|>",
        "a", "red", "circle", "<|eot_id|>"]
    labelled = columns["labels"][0][columns["labels"][0] != IGNORE]
    assert backbone.tokenizer.convert_ids_to_tokens(labelled) == ["a", "red", "circle", "<|eot_id|>"]
    prompt = columns["prompt_ids"][0][columns["prompt_mask"][0].bool()]  # what generation continues
    assert backbone.tokenizer.convert_ids_to_tokens(prompt) == tokens[:-4]
    raw = _backbone(chat_llava, chat_template=False)
    raw_tokens = raw.tokenizer.convert_ids_to_tokens(
        TextGeneration().encode(_vqa(1), np.arange(1), raw)["input_ids"][0])
    assert raw_tokens[:578] == ["<bos>", *["<image>"] * 576, "what"] and "<|start_header_id|>" not in raw_tokens


def test_a_chat_models_scored_generations_stop_where_the_template_closes_the_assistants_turn(chat_llava, monkeypatch):
    import numpy as np
    import torch

    from rayfed.config import ModelConfig
    from rayfed.models import build_client_model
    from rayfed.tasks import Task
    from rayfed.tasks.kinds import TextGeneration

    # the model runs on the CPU here, so it loads as a process without a GPU loads it (float32, no autocast)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    backbone = _backbone(chat_llava)
    kind = TextGeneration()
    model = build_client_model(backbone, ModelConfig(backbone=f"hf:{chat_llava}", lora={"rank": 2}),
                               Task(0, "vqa", kind=kind), 0)
    stops = []
    generate = model.encoder.generate
    model.encoder.generate = lambda **inputs: stops.append(inputs["eos_token_id"]) or generate(**inputs)
    batch = kind.encode(_vqa(), np.arange(3), backbone)
    with torch.no_grad():
        scores = kind.score(model, batch)
    assert stops == [backbone.tokenizer.convert_tokens_to_ids("<|eot_id|>")]
    assert math.isfinite(scores["nll"]) and scores["tokens"] == 4 + 2 + 2  # each answer and its <|eot_id|>


def test_chat_template_true_without_one_is_refused(hub_llava):
    with pytest.raises(ConfigError, match=r"model\.chat_template = true, but the tokenizer of model\.backbone = "
                                          r"'hf:.*' has no chat template"):
        _backbone(hub_llava, chat_template=True)


# OpenAI's CLIP weights: QuickGELU ------------------------------------------------------------------------------------
def test_open_clip_is_told_quick_gelu_where_its_record_of_the_pretrained_tag_says_so():
    from rayfed.zoo.openclip import pretrained_options

    assert pretrained_options("ViT-B-16", "openai") == {"force_quick_gelu": True}
    assert pretrained_options("ViT-B-32", "openai") == {"force_quick_gelu": True}
    assert pretrained_options("ViT-B-16", "laion2b_s34b_b88k") == {}
    assert pretrained_options("ViT-B-16", "/weights/my_clip.pt") == {}  # a file: nothing to go by
    assert pretrained_options("ViT-B-16", None) == {}


def test_the_open_clip_backbone_and_classifier_build_openai_weights_with_quick_gelu(monkeypatch):
    """Both ways rayfed builds open_clip models pass the tag's activation; built (shapes only, no download) with what
    they pass, the towers run QuickGELU, not GELU."""
    import open_clip

    from rayfed import zoo
    from rayfed.config import ModelConfig
    from rayfed.models import build_backbone

    calls = []

    def recorded(factory):
        def build(arch, pretrained=None, **options):
            calls.append((factory.__name__, arch, pretrained, options))
            return factory(arch, pretrained=None, device="meta", **options)
        return build

    for name in ("create_model", "create_model_and_transforms"):
        monkeypatch.setattr(open_clip, name, recorded(getattr(open_clip, name)))
    tower = build_backbone(ModelConfig(backbone="open_clip:ViT-B-16", pretrained="openai"), 0).encoder
    classifier = zoo.load("open_clip:ViT-B-16", pretrained="openai").model
    assert calls == [("create_model", "ViT-B-16", "openai", {"force_quick_gelu": True}),
                     ("create_model_and_transforms", "ViT-B-16", "openai", {"force_quick_gelu": True})]
    for model in (tower, classifier):
        activations = {type(module).__name__ for module in model.modules()} & {"GELU", "QuickGELU"}
        assert activations == {"QuickGELU"}


# Version floors ------------------------------------------------------------------------------------------------------
FLOORS_NEEDED = {  # the first release with what the code uses (pyproject.toml's comment says which feature)
    "torch": "2.6", "transformers": "5.9", "peft": "0.18", "open_clip_torch": "3.0",
}


def test_pyprojects_floors_are_at_least_the_releases_with_the_features_the_code_uses():
    import tomllib
    from pathlib import Path

    import open_clip
    import transformers
    from packaging.requirements import Requirement
    from packaging.version import Version

    text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    floors = {}
    for line in tomllib.loads(text)["project"]["dependencies"]:
        requirement = Requirement(line)
        floors[requirement.name] = min((Version(s.version) for s in requirement.specifier if s.operator == ">="),
                                       default=None)
    for package, needed in FLOORS_NEEDED.items():
        assert floors[package] is not None and floors[package] >= Version(needed), (package, floors[package])
    # the features themselves, on the installed releases
    vit = transformers.ViTModel(transformers.ViTConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                                       intermediate_size=8, image_size=8, patch_size=4))
    assert {"q_proj", "v_proj"} <= {name.rsplit(".", 1)[-1] for name, _ in vit.named_modules()}
    assert open_clip.get_pretrained_cfg("ViT-B-16", "openai").get("quick_gelu") is True


# Samples of several images ---------------------------------------------------------------------------------------------
def _two_image_vqa(slots: int = 2, pad_value: float = 0.0):
    """Three samples of up to ``slots`` images (2, 1, 2 valid; the rest ``pad_value``), the first with two
    placeholders in its text, the others with none."""
    import numpy as np

    from rayfed.data.sources import ArrayDataset

    images = np.full((3, slots, 32, 32, 3), pad_value, dtype=np.float32)
    images[:, :2] = np.random.default_rng(0).random((3, 2, 32, 32, 3), dtype=np.float32)
    images[1, 1:] = pad_value
    return ArrayDataset(images=images, image_counts=np.array([2, 1, 2]),
                        text=np.array(["<image> and <image> : what color ?", "what color ?", "what shape ?"]),
                        target=np.array(["red", "blue", "circle"]))


@pytest.fixture(scope="module")
def tiny_llava():
    from rayfed.config import ModelConfig
    from rayfed.models import build_backbone

    config = ModelConfig(backbone="tiny-pretrained:llava", lora={"rank": 2})
    return config, build_backbone(config, seed=0)


def _loss(model, kind, batch):
    return kind.loss(kind.forward(model, batch), batch)


def test_a_llava_reads_one_image_token_run_per_valid_image_where_the_text_marks_them(tiny_llava):
    import numpy as np

    from rayfed.tasks.kinds import TextGeneration

    _, backbone = tiny_llava
    columns = TextGeneration().encode(_two_image_vqa(), np.arange(3), backbone)
    assert columns["pixel_values"].shape == (3, 2, 3, 32, 32) and columns["image_counts"].tolist() == [2, 1, 2]
    image_id = backbone.encoder.config.image_token_id
    runs = 16  # 32 px at patch 8
    tokens = [backbone.tokenizer.convert_ids_to_tokens(row[mask.bool()])
              for row, mask in zip(columns["input_ids"], columns["attention_mask"])]
    assert (columns["input_ids"] == image_id).sum(dim=1).tolist() == [2 * runs, runs, 2 * runs]
    assert tokens[0][:1 + 2 * runs + 2] == ["<bos>", *["<image>"] * runs, "and", *["<image>"] * runs, ":"]  # marked
    assert tokens[2][:1 + 2 * runs + 1] == ["<bos>", *["<image>"] * (2 * runs), "what"]  # unmarked: all before


def test_a_two_image_sample_trains_and_scores_and_padding_images_do_not_change_the_loss(tiny_llava):
    import numpy as np
    import torch

    from rayfed.models import build_client_model
    from rayfed.tasks import Task
    from rayfed.tasks.kinds import TextGeneration

    config, backbone = tiny_llava
    kind = TextGeneration()
    model = build_client_model(backbone, config, Task(0, "vqa", kind=kind), 0)
    batch = kind.encode(_two_image_vqa(), np.arange(3), backbone)
    loss = _loss(model, kind, batch)
    assert math.isfinite(loss.item())
    for other in (_two_image_vqa(pad_value=0.7), _two_image_vqa(slots=3)):  # other padding, one more padding slot
        assert torch.equal(_loss(model, kind, kind.encode(other, np.arange(3), backbone)), loss)
    changed = _two_image_vqa()
    changed.images[0, 1] = 1 - changed.images[0, 1]  # the first sample's second image is read
    assert not torch.equal(_loss(model, kind, kind.encode(changed, np.arange(3), backbone)), loss)
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    loss.backward()
    optimizer.step()
    assert _loss(model, kind, batch).item() < loss.item()
    with torch.no_grad():
        scores = kind.score(model, batch)
    assert math.isfinite(scores["nll"]) and scores["tokens"] == 3 * 2 and 0 <= scores["token_f1"] <= 3


@pytest.mark.parametrize("backbone", ["tiny-pretrained:vilt", "tiny-pretrained:vit"])
def test_a_backbone_of_one_image_a_sample_refuses_samples_of_several(backbone):
    import numpy as np

    from rayfed.config import ModelConfig
    from rayfed.models import build_backbone
    from rayfed.tasks.kinds import Classification

    dataset = dataclasses.replace(_two_image_vqa(), target=None, labels=np.array([0, 1, 0]))
    if backbone.endswith("vit"):
        dataset = dataclasses.replace(dataset, text=None)
    built = build_backbone(ModelConfig(backbone=backbone), seed=0)
    with pytest.raises(ConfigError, match=rf"model\.backbone = '{backbone}' reads one image a sample, but "
                                          r"data\.tasks\['a'\]\.image_column holds up to 2 images a sample"):
        Classification().check(dataset, built, "data.tasks['a']")


def test_multiple_choice_scores_each_option_after_all_of_a_samples_images(tiny_llava):
    import numpy as np
    import torch

    from rayfed.models import build_client_model
    from rayfed.tasks import Task
    from rayfed.tasks.kinds import MultipleChoice

    config, backbone = tiny_llava
    kind = MultipleChoice()
    dataset = dataclasses.replace(_two_image_vqa(), target=None, labels=np.array([0, 1, 0]),
                                  choices=np.array([["red", "blue"], ["red", "blue"], ["circle", "square"]]))
    model = build_client_model(backbone, config, Task(0, "mc", kind=kind, num_choices=2), 0)
    batch = kind.encode(dataset, np.arange(3), backbone)
    with torch.no_grad():
        scores = kind.forward(model, batch)
        padded = kind.forward(model, kind.encode(dataclasses.replace(dataset, images=np.concatenate(
            [dataset.images, np.ones_like(dataset.images[:, :1])], axis=1)), np.arange(3), backbone))
    assert scores.shape == (3, 2) and torch.isfinite(scores).all() and torch.equal(padded, scores)


def test_a_text_that_marks_another_number_of_images_than_its_sample_has_is_refused(tiny_llava):
    import numpy as np

    from rayfed.tasks.kinds import TextGeneration

    dataset = dataclasses.replace(_two_image_vqa(), image_counts=np.array([1, 1, 2]))
    with pytest.raises(ConfigError, match=r"the text '<image> and <image> : what color \?' marks 2 images with "
                                          r"'<image>', but its sample has 1; mark every image of a sample once, or none"):
        TextGeneration().encode(dataset, np.arange(3), tiny_llava[1])
