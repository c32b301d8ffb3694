"""What one server allows: its name, key, admission limit and caps (the safe defaults live here)."""

from __future__ import annotations

from dataclasses import dataclass, field

from mmkv.server.media import MediaPolicy


@dataclass(slots=True)
class ServerSettings:
    """The HTTP front's rules. Defaults are the safe ones: no key (bind to loopback), no remote or
    local media, bodies up to 16 MiB, 8 images a request, 256 requests waiting beyond the batch."""

    served_model_name: str
    api_key: str | None = None
    max_waiting: int = 256  # requests admitted beyond --max-num-seqs before 503
    max_body_bytes: int = 16 * 2**20
    max_images_per_request: int = 8
    retry_after_seconds: int = 1
    media: MediaPolicy = field(default_factory=MediaPolicy)
