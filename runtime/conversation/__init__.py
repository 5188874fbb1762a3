"""Conversations on one engine: multi-turn sessions that keep their KV (session.py) and the
ReAct agent on a session (agent.py)."""
