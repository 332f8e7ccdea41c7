"""The short limits of the `strict_server` fixture (tests/server/conftest.py), shared with its tests."""

STRICT = {"header_timeout": 1.0, "body_timeout": 1.0, "max_connections": 4, "time_limit": 2.0}
