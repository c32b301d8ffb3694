"""``mmkv serve``: an OpenAI-compatible HTTP server over one engine (see ``app`` for the API)."""

from mmkv.server.app import build_app
from mmkv.server.async_engine import AsyncEngine
from mmkv.server.launch import build_server
from mmkv.server.media import MediaLoader, MediaPolicy
from mmkv.server.settings import ServerSettings

__all__ = ["AsyncEngine", "MediaLoader", "MediaPolicy", "ServerSettings", "build_app", "build_server"]
