"""Kettle hub package."""
