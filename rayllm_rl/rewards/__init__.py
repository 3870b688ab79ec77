"""Reward functions and scorers for built-in tasks."""
