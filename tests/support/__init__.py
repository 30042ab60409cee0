"""Tests of the test support (``tests/_support``): the Redis/Valkey servers the tests start."""
