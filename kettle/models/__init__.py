"""Kettle models package."""
