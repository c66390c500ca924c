"""Kettle shard package."""
