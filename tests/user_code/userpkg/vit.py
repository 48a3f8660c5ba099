"""A tiny Hugging Face ViT for 1x8x8 digits, imported as userpkg.vit:build (tests/test_user_plugins.py)."""

from transformers import ViTConfig, ViTForImageClassification


def build(hidden=32):
    return ViTForImageClassification(ViTConfig(
        image_size=8, patch_size=4, num_channels=1, hidden_size=hidden, num_hidden_layers=2,
        num_attention_heads=2, intermediate_size=64, num_labels=10))
