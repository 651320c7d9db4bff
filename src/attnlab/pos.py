"""Short alias of `attnlab.positional`: ``attnlab.pos.RoPE`` is ``attnlab.positional.RoPE``."""

from .positional import *  # noqa: F403
from .positional import __all__ as __all__
