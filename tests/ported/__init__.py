"""Tests ported from the peers' own test suites (oryx, equinox, JAX)."""
