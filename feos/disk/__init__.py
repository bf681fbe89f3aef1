"""feos.disk."""
