"""Vision-language models: vision towers, their projectors, and decoders whose image tokens take the towers'
features (``qwen2_5_vl.py``). Their families are declared under ``models/families/`` as every other's."""

from torchtune_ac.models.vision.qwen2_5_vl import Qwen2_5_VL, Qwen2_5_VLArgs, VisionArgs, VisionTower

__all__ = ["Qwen2_5_VL", "Qwen2_5_VLArgs", "VisionArgs", "VisionTower"]
