"""feos.fleet."""
