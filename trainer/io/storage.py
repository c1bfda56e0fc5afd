"""Local folders and object storage behind one set of small functions (fsspec underneath).

Remote URIs (``s3://bucket/prefix``) are read by copying them into a local cache folder and
written by uploading a finished local folder. s3fs reads the usual AWS variables; a custom
endpoint (SeaweedFS, MinIO) comes from ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL`` or
MLflow's ``MLFLOW_S3_ENDPOINT_URL``.

Every remote operation here (upload, download, listing, probe) retries connection failures and
the object store's 5xx answers with exponential backoff (1 s doubling to 30 s) for
``ALIGNFLOW_S3_RETRY_SECONDS`` (default 180 s), then raises a one-line `StorageError`. An upload
retries file by file, so the checkpoint's marker, written last, is only written once every file
is there: a store that stays down leaves the previous checkpoint the newest complete one.

Transfers of `PROGRESS_MIN_BYTES` or more show their progress (trainer/io/progress.py: a bar on a
terminal, a line every 30 s or 25 % otherwise), fed by fsspec's transfer callbacks.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from fsspec.callbacks import Callback

from trainer.errors import StorageError
from trainer.extras import require
from trainer.io.progress import Reporter

log = logging.getLogger(__name__)
PROGRESS_MIN_BYTES = 64 * 2**20  # smaller transfers take seconds: no progress lines

RETRY_ENV = "ALIGNFLOW_S3_RETRY_SECONDS"
DEFAULT_RETRY_SECONDS = 180.0
_T = TypeVar("_T")


def is_remote(uri: str) -> bool:
    return "://" in uri and not uri.startswith("file://")


def filesystem(uri: str):
    """The fsspec filesystem for a URI, with the S3 endpoint taken from the environment."""
    import fsspec

    protocol = uri.split("://", 1)[0] if is_remote(uri) else "file"
    options = {}
    if protocol in ("s3", "s3a"):
        require("s3fs", feature=f"Reading or writing {protocol}:// paths")
        endpoint = (os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
                    or os.environ.get("MLFLOW_S3_ENDPOINT_URL"))
        if endpoint:
            options["endpoint_url"] = endpoint
        # Listings must see objects written a moment ago by this or another process.
        options["use_listings_cache"] = False
        options["skip_instance_cache"] = True
    return fsspec.filesystem(protocol, **options)


def cache_dir() -> Path:
    return Path(os.environ.get("ALIGNFLOW_CACHE", Path.home() / ".cache" / "alignflow"))


def local_cache_path(uri: str) -> Path:
    """Where `fetch_to_local` puts `uri` by default. Each rank of a multi-process run (LOCAL_RANK,
    set by accelerate/torchrun) gets its own copy: ranks on one node re-downloading the same
    folder would otherwise overwrite files another rank is reading."""
    digest = hashlib.sha256(uri.encode()).hexdigest()[:16]
    rank = os.environ.get("LOCAL_RANK")
    return cache_dir() / "remote" / (f"rank{rank}" if rank else "") / f"{digest}-{Path(uri.rstrip('/')).name}"


def retry_seconds() -> float:
    """How long remote operations keep retrying a store that does not answer (``ALIGNFLOW_S3_RETRY_SECONDS``)."""
    value = os.environ.get(RETRY_ENV)
    try:
        return max(0.0, float(value)) if value else DEFAULT_RETRY_SECONDS
    except ValueError:
        raise StorageError(f"{RETRY_ENV}={value!r} is not a number of seconds.") from None


def _transient(err: BaseException) -> bool:
    """A failure that a store coming back would cure: no connection, a dropped or timed-out one, a 5xx."""
    if isinstance(err, ConnectionError | TimeoutError):
        return True
    try:
        import botocore.exceptions as bce

        if isinstance(err, bce.ConnectionError | bce.HTTPClientError):  # refused, reset, timed out, closed
            return True
    except ImportError:
        pass
    try:
        import aiohttp

        if isinstance(err, aiohttp.ClientConnectionError):
            return True
    except ImportError:
        pass
    text = str(err)
    return isinstance(err, OSError) and not isinstance(err, FileNotFoundError | PermissionError) and any(
        code in text for code in ("ServiceUnavailable", "InternalError", "SlowDown", "(503)", "(500)", "(502)"))


def retrying(uri: str, what: str, call: Callable[[], _T]) -> _T:
    """`call()`, retried with backoff while the store behind a remote `uri` does not answer (local: once).

    After `retry_seconds()` it raises a one-line `StorageError`; other errors pass through at once."""
    if not is_remote(uri):
        return call()
    budget = retry_seconds()
    deadline, delay, attempt = time.monotonic() + budget, 1.0, 0
    while True:
        try:
            return call()
        except Exception as err:
            if not _transient(err):
                raise
            attempt += 1
            first_line = (str(err).splitlines() or [""])[0][:200]
            left = deadline - time.monotonic()
            if left <= 0:
                raise StorageError(
                    f"Cannot {what} {uri!r}: the object store did not answer for {budget:.0f} s ({attempt} attempt{'s' if attempt > 1 else ''}; "
                    f"{type(err).__name__}: {first_line}). Check that it is up and reachable (AWS_ENDPOINT_URL), or "
                    f"wait longer with {RETRY_ENV}.") from None
            log.warning("Cannot %s %s (%s: %s); retrying in %.0f s (%.0f s of %.0f s left).", what, uri,
                        type(err).__name__, first_line, min(delay, left), left, budget)
            time.sleep(min(delay, left))
            delay = min(delay * 2, 30.0)


def fetch_to_local(uri: str, dest: str | Path | None = None) -> str:
    """Copy a remote file or prefix into a local folder (re-downloaded every call) and return the local path."""
    fs = filesystem(uri)
    try:
        is_file = retrying(uri, "read", lambda: fs.isfile(uri))
        exists = is_file or retrying(uri, "read", lambda: fs.isdir(uri))
    except StorageError:
        raise
    except Exception as err:
        raise StorageError(f"Cannot read {uri!r} ({type(err).__name__}: {str(err)[:200]}); check the S3 endpoint "
                           "(AWS_ENDPOINT_URL) and credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY).") from None
    if not exists:
        raise FileNotFoundError(f"{uri!r} does not exist.")
    dest = Path(dest) if dest else local_cache_path(uri)
    total = (retrying(uri, "read", lambda: fs.info(uri).get("size") or 0) if is_file
             else sum(size or 0 for size in find_sizes(uri).values()))
    if is_file:
        dest.parent.mkdir(parents=True, exist_ok=True)
        retrying(uri, "download", lambda: _transfer(f"download {uri}", total, lambda callback: fs.get(
            uri, str(dest), callback=callback)))
        return str(dest)
    dest.mkdir(parents=True, exist_ok=True)
    retrying(uri, "download", lambda: _transfer(f"download {uri}", total, lambda callback: fs.get(
        uri.rstrip("/") + "/", str(dest) + "/", recursive=True, callback=callback)))
    return str(dest)


class _Bytes(Callback):
    """fsspec's callback for a transfer: the bytes it moves go to `bar`. When fs.get/put move several
    files, each file's bytes come through the child callback of `branched`, and this one's own
    count (of files) is left out."""

    def __init__(self, bar: Reporter) -> None:
        super().__init__()
        self.bar, self.many = bar, False

    def branched(self, path_1: str, path_2: str, **kwargs) -> _Bytes:
        self.many = True
        return _Bytes(self.bar)

    def relative_update(self, inc: int = 1) -> None:
        super().relative_update(inc)
        if not self.many:
            self.bar.update(inc)


def _transfer(what: str, total: int, call: Callable[[Callback], _T]) -> _T:
    """`call(callback)` with progress over `total` bytes (none below PROGRESS_MIN_BYTES); each attempt
    (see `retrying`) counts afresh."""
    with Reporter(total, what, bytes_=True, disable=total < PROGRESS_MIN_BYTES, logger=log) as bar:
        return call(_Bytes(bar))


def upload_dir(local: str | Path, uri: str, exclude: tuple[str, ...] = ()) -> None:
    """Upload every file under `local` to the prefix `uri`, skipping names in `exclude` (relative paths).
    Each file is retried on its own (`retrying`), so an outage mid-upload resumes at the file it stopped at."""
    fs = filesystem(uri)
    local = Path(local)
    files = [(path, path.relative_to(local).as_posix()) for path in sorted(local.rglob("*")) if path.is_file()]
    files = [(path, rel) for path, rel in files if rel not in exclude]
    total = sum(path.stat().st_size for path, _ in files)
    with Reporter(total, f"upload to {uri}", bytes_=True, disable=total < PROGRESS_MIN_BYTES, logger=log) as bar:
        for path, rel in files:
            target, base = f"{uri.rstrip('/')}/{rel}", bar.done

            def put(path=path, target=target, base=base) -> None:
                bar.update(base - bar.done)  # a retried file counts from its start again
                fs.put_file(str(path), target, callback=_Bytes(bar))

            retrying(target, "upload to", put)


def join(base: str, *parts: str) -> str:
    if is_remote(base):
        return "/".join([base.rstrip("/"), *parts])
    return str(Path(base, *parts))


def exists(uri: str, retry: bool = True) -> bool:
    """Whether `uri` exists; `retry=False` asks once (checks before a run, which must fail in seconds)."""
    fs = filesystem(uri)
    return retrying(uri, "read", lambda: fs.exists(uri)) if retry else fs.exists(uri)


def list_dirs(uri: str) -> list[str]:
    """Names of the immediate sub-folders of a local folder or remote prefix ([] if it does not exist)."""
    fs = filesystem(uri)
    try:
        entries = retrying(uri, "list", lambda: fs.ls(uri, detail=True))
    except FileNotFoundError:
        return []
    return [Path(e["name"].rstrip("/")).name for e in entries if e["type"] == "directory"]


def read_text(uri: str) -> str:
    fs = filesystem(uri)
    return retrying(uri, "read", lambda: fs.cat_file(uri).decode())


def find_sizes(uri: str) -> dict[str, int]:
    """Every file under a folder or prefix as {relative path: size}, from one listing."""
    fs = filesystem(uri)
    root = fs._strip_protocol(uri).rstrip("/")
    found = retrying(uri, "list", lambda: fs.find(root, detail=True))
    return {path[len(root):].lstrip("/"): entry.get("size") for path, entry in found.items()}


def write_text(uri: str, text: str) -> None:
    fs = filesystem(uri)
    if not is_remote(uri):
        Path(uri).parent.mkdir(parents=True, exist_ok=True)

    def write() -> None:
        try:
            with fs.open(uri, "w") as fh:
                fh.write(text)
        except OSError as err:
            if err.errno is None or err.filename:
                raise
            raise OSError(err.errno, err.strerror, uri) from err  # name the file (a full disk fails on close)

    retrying(uri, "write", write)


def remove(uri: str) -> None:
    fs = filesystem(uri)
    if retrying(uri, "read", lambda: fs.exists(uri)):
        retrying(uri, "delete", lambda: fs.rm(uri, recursive=True))


def check_writable(uri: str) -> None:
    """Write and delete a small probe object under `uri`: a read-only or impossible path, an
    unreachable S3 endpoint or wrong credentials fail here in seconds, not at the first save."""
    import uuid

    probe = join(uri, f".alignflow-write-probe-{uuid.uuid4().hex[:12]}")
    fs = filesystem(probe)
    try:  # one attempt, no retries: a store that is down at the start fails the run in seconds
        if not is_remote(probe):
            Path(probe).parent.mkdir(parents=True, exist_ok=True)
        with fs.open(probe, "w") as fh:
            fh.write("alignflow checks that it can write here\n")
        fs.rm(probe)
    except Exception as err:  # OSError, botocore's ClientError / EndpointConnectionError, ...
        hint = ("check the S3 endpoint (AWS_ENDPOINT_URL) and credentials (AWS_ACCESS_KEY_ID / "
                "AWS_SECRET_ACCESS_KEY) and that the bucket exists" if is_remote(uri)
                else "check that the folder can be created and written")
        raise StorageError(f"Cannot write to output_dir {uri!r} ({type(err).__name__}: {str(err)[:200]}); {hint}.") \
            from None


def fingerprint(uri: str) -> str:
    """A short hash of what is stored at a file or folder/prefix, from the listing alone (no download):
    every file's relative name, size and version (the object store's ETag, a local file's mtime).

    It changes when any file is added, removed or rewritten, so a pipeline that passes it to a task
    turns new data at an unchanged URI into a new cache key."""
    fs = filesystem(uri)
    root = fs._strip_protocol(uri).rstrip("/")
    info = retrying(uri, "list", lambda: fs.info(root))
    entries = retrying(uri, "list", lambda: fs.find(root, detail=True)) if info["type"] == "directory" else {root: info}
    digest = hashlib.sha256()
    for path in sorted(entries):
        entry = entries[path]
        version = entry.get("ETag") or entry.get("etag") or entry.get("mtime") or entry.get("LastModified") or ""
        rel = path[len(root):].lstrip("/")
        digest.update(f"{rel}\0{entry.get('size')}\0{version}\n".encode())
    return digest.hexdigest()[:16]
