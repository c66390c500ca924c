"""Kettle layers package."""
