"""The agent's gRPC surface: the AgentService servicer and the one pb ↔ domain mapping (`convert.py`)."""
