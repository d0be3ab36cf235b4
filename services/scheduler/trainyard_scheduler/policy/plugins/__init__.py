"""Built-in placement plugins."""
