"""gRPC adapters of the scheduler: servicers, the agent client, and the one pb ↔ domain conversion module."""
