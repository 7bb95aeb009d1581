"""agentrl: train LLM agents with reinforcement learning over multi-turn interactions."""

from __future__ import annotations

__version__ = "0.1.0"
