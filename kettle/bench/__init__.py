"""Kettle bench package."""
