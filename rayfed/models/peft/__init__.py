"""What a method trains over a frozen backbone, parameter-efficiently.

One job a module: ``modules`` (bottleneck adapters, VPT and modality prompts, bias tuning, MLP heads, and their
per-task copies), ``attach`` (what ``model.module`` names, added to a client model's encoder, LoRA through peft
included), ``named_adapters`` (named, mixed LoRA adapters on a decoder's linear layers) and ``lora_groups`` (several
LoRA adapters in one forward).
"""
