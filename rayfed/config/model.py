"""The ``model`` section: the backbone and what is trained over it."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from rayfed.config.fields import BackboneName, ClientModelName, Section


class LoraConfig(Section):
    rank: int = Field(4, gt=0)
    alpha: float = Field(8.0, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    targets: tuple[str, ...] | None = Field(
        None, description="names of the linear modules LoRA goes on; default: the backbone family's attention "
        "query and value (ViT q_proj/v_proj, ViLT/FLAVA query/value, LLMs q_proj/v_proj); an open_clip image tower's "
        "out_proj, c_fc and c_proj (its query and value are fused in torch's MultiheadAttention)"
    )


class AdapterConfig(Section):
    dim: int = Field(8, gt=0, description="bottleneck width of the d -> dim -> d adapter")
    site: Literal["mlp", "output"] = Field(
        "mlp", description="mlp: after a block's MLP, inside its residual (ViT/CLIP); output: after a BERT-style "
        "layer's output sublayer (ViLT, FLAVA)"
    )
    activation: Literal["gelu", "relu"] = Field("gelu", description="the bottleneck's nonlinearity")
    init: Literal["zero", "normal"] = Field(
        "zero", description="zero: PyTorch's default down-projection, zero up-projection (the adapter starts as the "
        "identity); normal: every weight N(0, 0.02), every bias 0"
    )


class PromptConfig(Section):
    tokens: int = Field(5, gt=0, description="learnable prompt tokens per modality (text and image)")
    hidden: int = Field(192, gt=0, description="width of the Embedding -> Linear -> Tanh -> Linear reparameterisation")


class VptConfig(Section):
    prompts: int = Field(8, gt=0, description="learnable prompt tokens per block (VPT-deep)")


MODULES = ("head", "lora", "adapter", "vpt", "full", "bias", "prompt")
# what a method entry's `model` may override
MODULE_FIELDS = ("module", "lora", "adapter", "vpt", "prompt", "head", "client", "client_options")


class ModelConfig(Section):
    backbone: BackboneName = "tiny:vit"
    pretrained: str | None = Field(None, description="open_clip: a pretrained tag (openai, ...) or a weights file")
    module: Literal["head", "lora", "adapter", "vpt", "full", "bias", "prompt"] | None = Field(
        None, description="what is trained over the backbone (bias: every parameter named *bias*, BitFit; prompt: "
        "learnable tokens per modality at ViLT's embedding level); unset: lora if model.lora is set, else head"
    )
    lora: LoraConfig | None = LoraConfig()
    adapter: AdapterConfig = AdapterConfig()
    vpt: VptConfig = VptConfig()
    prompt: PromptConfig = PromptConfig()
    head: Literal["linear", "mlp"] = Field(
        "linear", description="a classifier head's form: linear, or mlp: Linear(d, 2d) -> LayerNorm -> GELU -> "
        "Linear(2d, C) (ViLT's VQA head)"
    )
    image_size: int | None = Field(None, gt=0, description="input size; default: the backbone's own")
    chat_template: bool | None = Field(
        None, description="wrap a text-generating backbone's prompts in its tokenizer's chat template (a user turn, "
        "then the assistant's answer as the target); unset: when the tokenizer has one; false: the raw prompt"
    )
    client: ClientModelName = Field(
        None, description="the model a method trains over the backbone: a registered client model (`rayfed list` "
        "shows them), a 'package.module:Name' builder or the builder itself; unset: the backbone with "
        "model.module and a head per task"
    )
    client_options: dict[str, Any] = Field({}, description="model.client's options, which it checks")

    @field_validator("client_options")
    @classmethod
    def _options_of_a_client(cls, options: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        if options and info.data.get("client") is None:
            raise ValueError("it needs model.client, the client model these are options of (the default model's "
                             "settings are model.module, lora, adapter, vpt, prompt and head)")
        return options

    @model_validator(mode="after")
    def _resolve_module(self) -> ModelConfig:
        if self.module is None:
            object.__setattr__(self, "module", "lora" if self.lora is not None else "head")
        elif self.module == "lora" and self.lora is None:
            raise ValueError("model.module = 'lora' needs model.lora (rank, alpha, targets), which is null")
        return self
