"""Local folders and object storage behind one set of small functions (fsspec underneath).

Remote URIs (``s3://bucket/prefix``) are read by copying them into a local cache folder and
written by uploading a finished local folder. s3fs reads the usual AWS variables; a custom
endpoint (SeaweedFS, MinIO) comes from ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL`` or
MLflow's ``MLFLOW_S3_ENDPOINT_URL``.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def is_remote(uri: str) -> bool:
    return "://" in uri and not uri.startswith("file://")


def filesystem(uri: str):
    """The fsspec filesystem for a URI, with the S3 endpoint taken from the environment."""
    import fsspec

    protocol = uri.split("://", 1)[0] if is_remote(uri) else "file"
    options = {}
    if protocol in ("s3", "s3a"):
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


def fetch_to_local(uri: str, dest: str | Path | None = None) -> str:
    """Copy a remote file or prefix into a local folder (re-downloaded every call) and return the local path."""
    fs = filesystem(uri)
    try:
        is_file = fs.isfile(uri)
        exists = is_file or fs.isdir(uri)
    except Exception as err:
        raise OSError(f"Cannot reach {uri!r}: {type(err).__name__}: {err}. Check the S3 endpoint "
                      "(AWS_ENDPOINT_URL) and credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY).") from err
    if not exists:
        raise FileNotFoundError(f"{uri!r} does not exist.")
    dest = Path(dest) if dest else local_cache_path(uri)
    if is_file:
        dest.parent.mkdir(parents=True, exist_ok=True)
        fs.get(uri, str(dest))
        return str(dest)
    dest.mkdir(parents=True, exist_ok=True)
    fs.get(uri.rstrip("/") + "/", str(dest) + "/", recursive=True)
    return str(dest)


def upload_dir(local: str | Path, uri: str, exclude: tuple[str, ...] = ()) -> None:
    """Upload every file under `local` to the prefix `uri`, skipping names in `exclude` (relative paths)."""
    fs = filesystem(uri)
    local = Path(local)
    for path in sorted(local.rglob("*")):
        rel = path.relative_to(local).as_posix()
        if path.is_file() and rel not in exclude:
            fs.put_file(str(path), f"{uri.rstrip('/')}/{rel}")


def join(base: str, *parts: str) -> str:
    if is_remote(base):
        return "/".join([base.rstrip("/"), *parts])
    return str(Path(base, *parts))


def exists(uri: str) -> bool:
    return filesystem(uri).exists(uri)


def list_dirs(uri: str) -> list[str]:
    """Names of the immediate sub-folders of a local folder or remote prefix ([] if it does not exist)."""
    fs = filesystem(uri)
    try:
        entries = fs.ls(uri, detail=True)
    except FileNotFoundError:
        return []
    return [Path(e["name"].rstrip("/")).name for e in entries if e["type"] == "directory"]


def write_text(uri: str, text: str) -> None:
    fs = filesystem(uri)
    if not is_remote(uri):
        Path(uri).parent.mkdir(parents=True, exist_ok=True)
    with fs.open(uri, "w") as fh:
        fh.write(text)


def remove(uri: str) -> None:
    fs = filesystem(uri)
    if fs.exists(uri):
        fs.rm(uri, recursive=True)


class StorageError(OSError):
    """A storage location cannot be used; the message names it and what to check."""


def check_writable(uri: str) -> None:
    """Write and delete a small probe object under `uri`: a read-only or impossible path, an
    unreachable S3 endpoint or wrong credentials fail here in seconds, not at the first save."""
    import uuid

    probe = join(uri, f".alignflow-write-probe-{uuid.uuid4().hex[:12]}")
    try:
        write_text(probe, "alignflow checks that it can write here\n")
        remove(probe)
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
    info = fs.info(root)
    entries = fs.find(root, detail=True) if info["type"] == "directory" else {root: info}
    digest = hashlib.sha256()
    for path in sorted(entries):
        entry = entries[path]
        version = entry.get("ETag") or entry.get("etag") or entry.get("mtime") or entry.get("LastModified") or ""
        rel = path[len(root):].lstrip("/")
        digest.update(f"{rel}\0{entry.get('size')}\0{version}\n".encode())
    return digest.hexdigest()[:16]
