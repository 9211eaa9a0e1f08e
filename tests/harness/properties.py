"""Hypothesis settings for property tests that run on the rank pool."""

from hypothesis import HealthCheck, settings


def property_settings(max_examples: int) -> settings:
    """No deadline (a pool task takes what the machine gives it), the pool fixture allowed in
    every example (it is session-wide on purpose), and a blob to replay a failure with."""
    return settings(
        max_examples=max_examples,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
        print_blob=True,
    )
