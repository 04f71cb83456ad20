"""One entry point for every model a method fine-tunes: tiny pretrained stand-ins, hub models, open_clip."""

from __future__ import annotations

from rayfed.errors import ConfigError, choice_error
from rayfed.lazy import DeferredModule
from rayfed.zoo import cache, causal_lm, clip, flava, llava, openclip, vilt, vit
from rayfed.zoo.registry import ZooModel

transformers = DeferredModule("transformers")

MODEL_NAMES = (
    "tiny-pretrained:<family>",
    "hf:<hub name or local folder>",
    "open_clip:<architecture or local-dir:folder>",
)

_HF_LOADERS = {
    "clip": clip.load,
    "clip_vision_model": clip.load_vision,
    "vit": vit.load,
    "vilt": vilt.load,
    "flava": flava.load,
    "llava": llava.load,
}


def load(name: str, *, pretrained: str | None = None) -> ZooModel:
    """Load ``name``, one of :data:`MODEL_NAMES`.

    ``tiny-pretrained:clip`` builds (first use) or reuses the cached tiny model; ``hf:<name or folder>``
    picks the model class from the config's ``model_type`` (CLIP, CLIP vision, ViT, ViLT, FLAVA, LLaVA,
    any causal LM); ``open_clip:<arch>`` passes ``pretrained`` (a tag such as ``"openai"`` or a
    checkpoint file) to open_clip.
    """
    kind, _, target = name.partition(":")
    if pretrained is not None and kind != "open_clip":
        raise ConfigError(f"pretrained = {pretrained!r} only applies to open_clip: models, not {name!r}.")
    if kind == "tiny-pretrained":
        return cache.family(target).load(str(cache.pretrained(target)))
    if kind == "hf":
        return _load_hf(target)
    if kind == "open_clip":
        return openclip.load(target, pretrained)
    raise choice_error("model", name, MODEL_NAMES)


def _load_hf(name_or_path: str) -> ZooModel:
    try:
        model_type = transformers.AutoConfig.from_pretrained(name_or_path).model_type
    except OSError as err:
        raise ConfigError(
            f"model 'hf:{name_or_path}' could not be loaded (not a local model folder, and the hub is "
            f"unreachable or has no such model): {str(err).splitlines()[0]}"
        ) from None
    if model_type in _HF_LOADERS:
        return _HF_LOADERS[model_type](name_or_path)
    if model_type in transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return causal_lm.load(name_or_path)
    raise ConfigError(
        f"model 'hf:{name_or_path}' is a {model_type!r} model; supported are "
        f"{', '.join(_HF_LOADERS)} and causal language models."
    )
