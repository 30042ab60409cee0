"""The S3 side: obstore's synchronous API, called only from worker threads.

Every method blocks and is meant for ``trio.to_thread.run_sync``; none touches trio. Errors from
obstore (its own classes, and the built-in ``FileNotFoundError``/``ValueError`` it also raises) are
translated here into :class:`~kvtrio.l2.BackendError` or :class:`~kvtrio.l2.BackendUnavailable`
with a one-line message, so nothing of obstore's escapes the backend.

No copies on the way out: ``put`` hands obstore the caller's memoryviews as a list, which obstore
turns into one request body made of several buffers (zero-copy). On the way in, obstore collects
the response body into one buffer and :func:`copy_into` copies it into the caller's buffers with
numpy, which releases the GIL for the copy.
"""

from __future__ import annotations

import datetime
import os
import re
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import obstore
from obstore.exceptions import PermissionDeniedError, UnauthenticatedError
from obstore.store import S3Store

from kvtrio.l2 import BackendError, BackendUnavailable, Buffers

if TYPE_CHECKING:
    from ._backend import S3Options

__all__ = ["MAX_OBJECT_SIZE", "S3Client", "copy_into", "translate"]

MAX_OBJECT_SIZE = 5 << 30
"""The largest object one S3 PUT can write."""

_SMALL_COPY = 1 << 16  # below this, a memoryview copy under the GIL is cheaper than numpy's setup
_STATUS = re.compile(r"status code: (\d{3})")
_CODE = re.compile(r"<Code>([^<]+)</Code>")
_UNAVAILABLE_STATUSES = (502, 503, 504)


class S3Client:
    """One bucket of one S3 service, through an ``obstore`` S3Store (thread-safe)."""

    def __init__(self, options: S3Options) -> None:
        self.bucket = options.bucket
        self.timeout = options.timeout
        self.where = options.endpoint or "AWS S3"
        self.region = (
            options.region
            or os.environ.get("AWS_REGION")
            or os.environ.get("AWS_DEFAULT_REGION")
            or "us-east-1"
        )
        config: dict[str, Any] = {"unsigned_payload": not options.sign_payload}
        if options.endpoint:
            config["endpoint"] = options.endpoint
        if options.region:
            config["region"] = options.region
        if options.access_key_id:
            config["access_key_id"] = options.access_key_id
            config["secret_access_key"] = options.secret_access_key
        timeout = datetime.timedelta(seconds=options.timeout)
        try:
            self.store = S3Store(
                options.bucket,
                client_options={
                    "allow_http": options.allow_http,
                    "timeout": timeout,
                    "connect_timeout": min(timeout, datetime.timedelta(seconds=5)),
                },
                retry_config={
                    "max_retries": options.retries,
                    "retry_timeout": timeout,
                    "backoff": {
                        "init_backoff": datetime.timedelta(milliseconds=50),
                        "max_backoff": datetime.timedelta(seconds=1),
                        "base": 2,
                    },
                },
                **config,
            )
        except Exception as exc:  # obstore's configuration errors (also from AWS_* variables)
            raise ValueError(f"invalid S3 configuration: {_first_line(exc)}") from None

    # ----------------------------------------------------------------- objects

    def head(self, path: str) -> bool:
        """Whether the object exists (a HEAD request)."""
        try:
            obstore.head(self.store, path)
        except FileNotFoundError:
            return False
        except Exception as exc:
            raise translate(exc, "HEAD", self.where) from None
        return True

    def get_into(self, path: str, parts: Buffers, size: int) -> bool | None:
        """Read the object into ``parts`` (``size`` bytes in all): True once copied, False if
        its length differs (nothing is copied then), None if it does not exist."""
        try:
            result = obstore.get(self.store, path)
            if result.meta["size"] != size:
                return False  # (the unread body is dropped with its connection)
            data = result.bytes()
        except FileNotFoundError:
            return None
        except Exception as exc:
            raise translate(exc, "GET", self.where) from None
        if len(data) != size:
            return False
        copy_into(data, parts)
        return True

    def put(self, path: str, parts: Buffers) -> None:
        """Write the concatenation of ``parts`` as one object with one PUT (atomic in S3)."""
        views = [_flat(part) for part in parts if part.nbytes]
        try:
            obstore.put(self.store, path, views, use_multipart=False)
        except Exception as exc:
            raise translate(exc, "PUT", self.where) from None

    def delete(self, paths: Sequence[str]) -> None:
        """Delete the objects (missing ones are not an error; one request per 1000 paths)."""
        try:
            obstore.delete(self.store, list(paths))
        except FileNotFoundError:
            pass
        except Exception as exc:
            raise translate(exc, "DELETE", self.where) from None

    # ----------------------------------------------------------------- the bucket

    def prepare_bucket(self, probe_path: str, create: bool) -> None:
        """Check that the bucket exists and is accessible; create it if missing and ``create``.

        The check is a GET of ``probe_path`` (not a kvtrio object name): S3 answers a missing
        bucket with ``NoSuchBucket`` and a missing object with ``NoSuchKey``.
        """
        try:
            obstore.get(self.store, probe_path)
            return  # (a probe object exists: the bucket certainly does)
        except FileNotFoundError as exc:
            missing = "NoSuchBucket" in str(exc)
        except (PermissionDeniedError, UnauthenticatedError):
            raise BackendError(
                f"s3: access to bucket {self.bucket!r} at {self.where} denied (check the "
                "credentials; they need s3:ListBucket, GetObject, PutObject, DeleteObject)"
            ) from None
        except Exception as exc:
            raise translate(exc, "checking the bucket", self.where) from None
        if not missing:
            return  # the bucket exists, the probe object does not
        if not create:
            raise BackendError(
                f"s3: bucket {self.bucket!r} does not exist at {self.where} "
                "(create it, or set create_bucket=true)"
            )
        self._create_bucket()

    def _create_bucket(self) -> None:
        """CreateBucket, with a presigned URL (obstore signs; it has no bucket operations)."""
        try:
            url = obstore.sign(self.store, "PUT", "", datetime.timedelta(minutes=5))
        except Exception as exc:
            raise translate(exc, "signing CreateBucket", self.where) from None
        body = b""
        if self.region != "us-east-1":
            body = (
                '<CreateBucketConfiguration xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
                f"<LocationConstraint>{self.region}</LocationConstraint>"
                "</CreateBucketConfiguration>"
            ).encode()
        request = urllib.request.Request(url, data=body, method="PUT")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout):
                pass
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode("utf-8", "replace")
            code = _CODE.search(detail)
            if code and code.group(1) in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                return  # created meanwhile (by us or a concurrent server)
            raise BackendError(
                f"s3: creating bucket {self.bucket!r} at {self.where} failed: HTTP {exc.code}"
                + (f" {code.group(1)}" if code else "")
            ) from None
        except OSError as exc:
            reason = getattr(exc, "reason", exc)
            raise BackendUnavailable(
                f"s3: creating bucket {self.bucket!r}: cannot reach {self.where}: {reason}"
            ) from None


def translate(exc: BaseException, what: str, where: str) -> BackendError:
    """The kvtrio error for an exception raised by obstore during ``what``.

    Connection failures, timeouts and 502/503/504 answers (after obstore's retries) are
    :class:`BackendUnavailable`; everything else is :class:`BackendError`.
    """
    text = str(exc)
    if isinstance(exc, (PermissionDeniedError, UnauthenticatedError, PermissionError)):
        return BackendError(f"s3: {what} denied by {where} (check the credentials)")
    status = _STATUS.search(text)
    if status is not None:
        number = int(status.group(1))
        code = _CODE.search(text)
        detail = f"HTTP {number}" + (f" {code.group(1)}" if code else "")
        if number in _UNAVAILABLE_STATUSES:
            return BackendUnavailable(f"s3: {what} failed: {where} answered {detail}")
        return BackendError(f"s3: {what} failed: {where} answered {detail}")
    if "kind: Connect" in text:
        return BackendUnavailable(f"s3: {what} failed: cannot connect to {where}")
    if "kind: Timeout" in text or "timed out" in text.lower():
        return BackendUnavailable(f"s3: {what} failed: no answer from {where} in time")
    if "error sending request" in text or "kind: Body" in text or "kind: Decode" in text:
        return BackendUnavailable(f"s3: {what} failed: connection to {where} lost")
    return BackendError(f"s3: {what} failed: {type(exc).__name__}: {_first_line(exc)}")


def copy_into(data: Any, parts: Buffers) -> None:
    """Copy the bytes of ``data`` (a buffer) into consecutive ``parts``."""
    source = memoryview(data).cast("B")
    offset = 0
    for part in parts:
        target = _flat(part)
        count = target.nbytes
        if count < _SMALL_COPY:
            target[:] = source[offset : offset + count]
        else:  # numpy releases the GIL while it copies: the trio thread keeps running
            np.copyto(
                np.frombuffer(target, dtype=np.uint8),
                np.frombuffer(source, dtype=np.uint8, count=count, offset=offset),
            )
        offset += count


def _flat(part: memoryview) -> memoryview:
    """``part`` as a 1-D view of bytes (what obstore and the copies expect)."""
    return part if part.ndim == 1 and part.format == "B" else part.cast("B")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().split("\n", 1)[0].strip()
    return text[:300] if text else type(exc).__name__
