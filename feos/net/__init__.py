"""feos.net."""
