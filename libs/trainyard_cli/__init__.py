"""The `trainyard` command-line client of the gateway, and the local development cluster."""
