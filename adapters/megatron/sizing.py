"""The KV growth's own sizing rule, public, for planning a job's memory before it
runs: how big a cache the launch's engine would grow to with ``extra_bytes`` freed
(``Launch.grown_by``), Megatron's default ``max_requests`` for a block count
(``requests_for``), and what one more concurrent request costs beyond its blocks
(``bytes_per_request``). The adapter sizes every growth with these same functions;
experiments/presets.py plans its presets with them. Imports neither torch nor
Megatron."""

from .args import DEFAULT_KV_MARGIN_GB
from .concurrency import bytes_per_request, requests_for
from .kv_cache import Launch, Size

__all__ = ["DEFAULT_KV_MARGIN_GB", "Launch", "Size", "bytes_per_request", "requests_for"]
