"""HTTP routes, one module per resource. Thin: validate, authorize, call a client, return a model."""
