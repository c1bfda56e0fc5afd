"""Where a run came from (the code's git sha, the container image, alignflow's version) and the
redaction of secrets before anything is written down. No MLflow here: checkpoints record these too."""

from __future__ import annotations

import functools
import os
import re
import subprocess
from pathlib import Path
from typing import Any

# scheme://user:password@ or scheme://token@ ; the password runs to the last "@" before a "/".
_USERINFO = re.compile(r"(\b[A-Za-z][A-Za-z0-9+.\-]*://)([^\s/@:]*)(?::([^\s/]*))?@")


def redact_uri(text: str) -> str:
    """Hide the secrets of every URI in `text`: ``http://user:pw@host`` -> ``http://user:***@host``;
    a bare ``http://token@host`` -> ``http://***@host``. Text without credentials is unchanged."""

    def hide(m: re.Match) -> str:
        scheme, user, password = m.group(1), m.group(2), m.group(3)
        return f"{scheme}{user}:***@" if password is not None else f"{scheme}***@"

    return _USERINFO.sub(hide, text)


def redact_secrets(value: Any) -> Any:
    """`redact_uri` applied to every string inside nested dicts, lists and tuples (a config as a dict,
    a manifest) — for whatever is printed, logged as params or written to files."""
    if isinstance(value, str):
        return redact_uri(value)
    if isinstance(value, dict):
        return {k: redact_secrets(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(redact_secrets(v) for v in value)
    return value


@functools.cache
def git_sha() -> str | None:
    """The commit of the alignflow source: ``ALIGNFLOW_GIT_SHA`` (images bake it in, having no
    .git), else ``git rev-parse HEAD`` next to this file; None without git or commits."""
    if sha := os.environ.get("ALIGNFLOW_GIT_SHA"):
        return sha
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent,
                             capture_output=True, text=True, timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    sha = out.stdout.strip()
    return sha if out.returncode == 0 and sha else None


def container_image() -> dict[str, str]:
    """The container image this process runs in, as the launcher told it: ``image`` (name) and
    ``image_digest`` (a registry digest, or the local image id) from ALIGNFLOW_IMAGE /
    ALIGNFLOW_IMAGE_DIGEST (`alignflow pipeline run --local --containers` passes both); empty outside one."""
    found = {"image": os.environ.get("ALIGNFLOW_IMAGE", ""), "image_digest": os.environ.get("ALIGNFLOW_IMAGE_DIGEST", "")}
    return {key: value for key, value in found.items() if value}


def alignflow_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("alignflow")
    except PackageNotFoundError:  # running from a source tree that is not installed
        return "unknown"
