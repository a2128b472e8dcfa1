"""Adapters on a vision-language model: the language model's linears only, in every vision family."""

import torch

from torchtune_ac.lora.config import AdapterConfig


def test_every_vision_family_keeps_adapters_off_its_tower():
    """A family whose model takes images names its vision side (``vision_modules``): the adapters' targets and
    PEFT's ``exclude_modules`` leave the tower and projector alone, whichever names they share with the decoder."""
    import inspect

    from torchtune_ac.lora.mechanism import find_targets
    from torchtune_ac.lora.peft_names import peft_excluded_modules
    from torchtune_ac.models.families import FAMILIES

    vision = [f for f in FAMILIES if "pixel_values" in inspect.signature(f.model_class.forward).parameters]
    assert {f.name for f in vision} >= {"qwen2_5_vl", "qwen3_vl", "gemma3_vision"}
    for family in vision:
        tiny = next(builder for name, builder in family.builders.items() if name.endswith("_tiny"))
        with torch.device("meta"):
            model = tiny()
        targets = find_targets(model, AdapterConfig(rank=4, targets=["q_proj", "v_proj", "up_proj", "down_proj"]))
        assert family.vision_modules and targets, family.name
        assert not [n for n in targets if n.split(".")[0] in family.vision_modules], family.name
        assert peft_excluded_modules(model), family.name
