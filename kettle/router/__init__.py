"""Kettle router package."""
