"""Vision-language models: vision towers, their projectors, and decoders whose image tokens take the towers'
features (``qwen2_5_vl.py``, ``gemma3.py``). Their families are declared under ``models/families/`` as every other's."""

from torchtune_ac.models.vision.gemma3 import Gemma3Vision, Gemma3VisionArgs, SiglipArgs, SiglipTower
from torchtune_ac.models.vision.qwen2_5_vl import Qwen2_5_VL, Qwen2_5_VLArgs, VisionArgs, VisionTower

__all__ = ["Gemma3Vision", "Gemma3VisionArgs", "SiglipArgs", "SiglipTower", "Qwen2_5_VL", "Qwen2_5_VLArgs", "VisionArgs",
           "VisionTower"]
