"""Agents: an OpenAI-compatible endpoint over the inference engine, and workflows for agent code."""
