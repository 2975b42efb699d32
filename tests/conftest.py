"""Shared pytest configuration."""

pytest_plugins = ["store_fixtures"]  # real S3 endpoint (moto server) and tiny checkpoints for store tests
