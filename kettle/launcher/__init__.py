"""Kettle launcher package."""
