"""The dcr delta format v1: dtypes, digests, codec and manifest.

Everything in this package is pure: it turns bytes and arrays into bytes and
arrays and never touches a file system. ``format_spec/`` is the normative text.
"""
