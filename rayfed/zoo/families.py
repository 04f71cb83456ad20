"""The registry of pretrainable tiny model families (``tiny-pretrained:<family>``): the engine's, below, and those
a plug-in module adds with :func:`register_family` (a paper's own pretraining data), listed as the registry's
plug-ins are (pyproject.toml's ``rayfed.plugins`` entry points)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

from rayfed import registry
from rayfed.zoo import causal_lm, clip, flava, llava, openclip, vilt, vit
from rayfed.zoo.registry import Family

_CAUSAL_LM = {
    "llama-small": "Llama-3 style LLM, shallow and narrow (the small clients of a run of mixed model sizes)",
    "llama-large": "Llama-3 style LLM, deep and wide (the large clients of a run of mixed model sizes)",
    "qwen": "Qwen2.5 style LLM (qkv bias; another width)",
}
_LLAVA = {
    "llava": "on llama-small (small clients)",
    "llava-large": "on llama-large (large clients)",
}



class FamilyTable(Mapping[str, Family]):
    """Families by name. The first look-up imports every plug-in module the registry lists
    (:func:`rayfed.registry.load_plugins`), where a package adds its families (:func:`register_family`), so that
    ``tiny-pretrained:<family>`` finds them on any process."""

    def __init__(self, families: Iterable[Family]) -> None:
        self._families = {family.name: family for family in families}

    def add(self, family: Family) -> None:
        self._families[family.name] = family

    def _loaded(self) -> dict[str, Family]:
        registry.load_plugins()
        return self._families

    def __getitem__(self, name: str) -> Family:
        return self._loaded()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._loaded())

    def __len__(self) -> int:
        return len(self._loaded())


def register_family(family: Family) -> Family:
    """Add ``family`` to :data:`FAMILIES` (replacing one of the same name), as ``tiny-pretrained:<family.name>``."""
    FAMILIES.add(family)
    return family


FAMILIES = FamilyTable(
    (
        Family(
            "clip", "HF CLIPModel (openai/clip-vit-base-patch16)", "symmetric image-text contrastive loss",
            clip.RECIPE, clip.build, clip.evaluate, clip.load,
        ),
        Family(
            "clip-vision", "HF CLIPVisionModel, the image tower of the tiny CLIP", "none (clip's vision tower)",
            clip.VISION_RECIPE, clip.build_vision, clip.evaluate_vision, clip.load_vision, requires=("clip",),
        ),
        Family(
            "open_clip", "open_clip CLIP ViT-B-16 (pretrained='openai')",
            "symmetric image-text contrastive loss (open_clip.ClipLoss)",
            openclip.RECIPE, openclip.build, openclip.evaluate, openclip.load_folder,
        ),
        Family(
            "open_clip-deep", "open_clip CLIP ViT-B-16 (pretrained='openai') at its depth: 12 blocks per tower, "
            "pretrained on all classes (a backbone for runs offline)",
            "symmetric image-text contrastive loss (open_clip.ClipLoss)",
            openclip.DEEP_RECIPE, openclip.build, openclip.evaluate, openclip.load_folder,
        ),
        Family(
            "vit", "HF ViT (google/vit-base-patch16-224)", "supervised image classification",
            vit.RECIPE, vit.build, vit.evaluate, vit.load,
        ),
        Family(
            "vilt", "HF ViLT (dandelin/vilt-b32-mlm)",
            "masked language modelling + image-text matching",
            vilt.RECIPE, vilt.build, vilt.evaluate, vilt.load,
        ),
        Family(
            "flava", "HF FLAVA (facebook/flava-full)",
            "image-text contrastive + multimodal masked language modelling + image-text matching",
            flava.RECIPE, flava.build, flava.evaluate, flava.load,
        ),
        *(
            Family(name, stands_in_for, "next-token prediction", causal_lm.RECIPES[name], causal_lm.build,
                   causal_lm.evaluate, causal_lm.load)
            for name, stands_in_for in _CAUSAL_LM.items()
        ),
        *(
            Family(
                name, f"HF LLaVA (llava-hf/llava-1.5-7b-hf), a multi-modal LLM, {stands_in_for}",
                "image-conditioned next-token prediction (captions), vision tower frozen",
                llava.RECIPES[name], llava.build, llava.evaluate, llava.load,
                requires=(llava.VISION, llava.LANGUAGE_MODELS[name]),
            )
            for name, stands_in_for in _LLAVA.items()
        ),
    )
)  # fmt: skip
