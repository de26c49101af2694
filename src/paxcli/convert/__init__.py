"""Checkpoint inspection and conversion (`pax checkpoint inspect|convert`).

formats.py: the registry of source readers (orbax, safetensors, hf, paxml); see its docstring.
"""
