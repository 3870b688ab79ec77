"""Rollout without Ray: the collector that keeps episodes running (collector.py), the staleness
bound it admits under (staleness.py) and the awaitable replay buffer they fill (replay_buffer.py).

The local backend runs these in its process; the Ray backend wraps them in actor shells
(`orchestration/ray/actors.py`). Nothing here needs Ray installed or started.
"""
