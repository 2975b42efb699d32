"""The options a remote filesystem's client is opened with: one place for a store (``store.backends``) and
a delta opened by its location (``delta.reader``), so that both get the same client from fsspec's cache."""

from __future__ import annotations

from typing import Any

import fsspec

S3_PROTOCOLS = ("s3", "s3a")
# Connections an S3 client keeps open at once, unless the options or fsspec's configuration say otherwise.
# botocore's 10 made a round of questions larger than that (a push's HEADs of its blocks, beside its
# manifest and children entry) take two round trips, across regions on the producer's critical path.
S3_CONNECTIONS = 64


def client_options(url: str, storage_options: dict[str, Any] | None) -> dict[str, Any]:
    """``storage_options`` for fsspec's ``url_to_fs(url, ...)``, with dcr's defaults where neither they nor
    fsspec's own configuration (``FSSPEC_S3_*``, its config files) set them."""
    options = dict(storage_options or {})
    protocol = fsspec.core.split_protocol(url)[0]
    if protocol not in S3_PROTOCOLS:
        return options
    config = options.get("config_kwargs")
    if config is None:
        # fsspec merges its configuration key by key, and a key given here wins whole: start from its
        # config_kwargs so that what a user configured there still reaches the client.
        config = fsspec.config.conf.get(protocol, {}).get("config_kwargs") or {}
    if isinstance(config, dict) and "max_pool_connections" not in config:
        options["config_kwargs"] = {**config, "max_pool_connections": S3_CONNECTIONS}
    return options
