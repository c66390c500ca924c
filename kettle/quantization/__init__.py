"""Kettle quantization package."""
