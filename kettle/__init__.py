"""Kettle: a text-generation inference server with TGI's API."""

__version__ = "0.1.0"
