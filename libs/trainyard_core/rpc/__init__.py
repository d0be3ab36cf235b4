"""gRPC plumbing shared by the services: server bootstrap, error mapping, client channels."""
