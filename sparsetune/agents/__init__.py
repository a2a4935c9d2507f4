"""Agents that write new flows: proposers (evolve, claude, openai), the harness, the sandbox."""
