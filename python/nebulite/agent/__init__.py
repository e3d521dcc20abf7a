"""The node agent: one process per node and storage scope that owns the shared-memory
tier, persists and commits on behalf of the trainers, and outlives them.

Trainers reach it through `client.AgentEngine` (``init(agent=True)``); `server.Agent` is
the process itself (``python -m nebulite.agent``).
"""
