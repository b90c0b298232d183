"""Where a model comes from: a local path, or a hub id found in the cache or over the network.

`locate` is called before any model is loaded (--model's pipeline, the reward models), so that a
missing model fails at once with its cause named, instead of after the Hugging Face libraries'
retries with "does not appear to have a file named ...". Offline means `HF_HUB_OFFLINE` is set, or
the hub (`HF_ENDPOINT`, default https://huggingface.co) cannot be reached within PROBE_S seconds.
Offline, a hub id that is in the cache is loaded from its cached folder; one that is not is an
OSError that says what was tried and what to pass instead.
"""

import functools
import os
import socket
from urllib.parse import urlparse

PROBE_S = 3.0


def cache_dir() -> str:
    """The Hugging Face hub cache, as huggingface_hub finds it (HF_HUB_CACHE, else HF_HOME/hub)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    home = os.environ.get("HF_HOME") or os.path.expanduser("~/.cache/huggingface")
    return os.path.join(home, "hub")


def offline_reason() -> str | None:
    """Why the hub can't be used ("HF_HUB_OFFLINE is set", "no network ..."), or None if it can."""
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        return "HF_HUB_OFFLINE is set"
    return _probe(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")


@functools.cache
def _probe(endpoint: str) -> str | None:
    url = urlparse(endpoint)
    host, port = url.hostname or endpoint, url.port or (80 if url.scheme == "http" else 443)
    try:
        socket.create_connection((host, port), timeout=PROBE_S).close()
        return None
    except OSError as e:
        return f"no network: {host}:{port} could not be reached in {PROBE_S:.0f} s ({e})"


def is_hub_id(name: str) -> bool:
    """`name` has a hub id's shape, 'org/name' (two non-empty parts, not starting with . or ~).
    It does not look at the disk: a local path of that shape passes too, so callers look for the
    path first (locate: os.path.exists)."""
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "~"))


def locate(name: str, what: str, needs: str) -> str:
    """`name` if it exists here or the hub can be reached; offline, the cached folder of hub id
    `name` (the one holding the file `needs`, e.g. model_index.json); else an OSError naming `what`
    (the flag or variable that gave it), the cause and the fix."""
    if os.path.exists(name):
        return name
    if not is_hub_id(name):
        raise OSError(f"{what}: {name!r} does not exist here (give a local folder or a hub id)")
    reason = offline_reason()
    if reason is None:
        return name
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(name, needs, cache_dir=cache_dir())
    if isinstance(cached, str):
        return os.path.dirname(cached)
    raise OSError(
        f"{what}: {name!r} is a hub id, but {reason}, and it is not in the cache ({cache_dir()}, "
        f"looked for {needs}). Download it where there is network (hf download {name} "
        f"--local-dir DIR) and point {what} at the folder DIR"
    )
