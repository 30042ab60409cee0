"""kvtrio's ``s3`` L2 backend: KV-cache objects in AWS S3 or any S3-compatible store.

Registered under the ``kvtrio.backends`` entry-point group as ``s3``; the server creates it from
``--l2 s3:bucket=NAME,endpoint=URL,...``. See the README for the options and semantics.
"""

from ._backend import S3Backend, S3Options

__all__ = ["S3Backend", "S3Options"]
