"""Tools for agents and reward functions: ``PythonSandbox`` runs untrusted model-written Python safely."""
from rayllm_rl.tools.sandbox import PythonSandbox, SandboxResult

__all__ = ["PythonSandbox", "SandboxResult"]
