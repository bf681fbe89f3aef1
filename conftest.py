"""Settings every tier shares."""

from hypothesis import HealthCheck, settings

# The machines are small and shared: a slow example is no failure, only a failing one is.
settings.register_profile(
    "feos", deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True
)
settings.load_profile("feos")
