"""gRPC adapter of the checkpoint-store: the servicer and the only pb ↔ domain mapping."""
