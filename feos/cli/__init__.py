"""feos.cli."""
