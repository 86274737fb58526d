"""Names for the roles pytrees play, so that signatures say what a tree is."""

from __future__ import annotations

from typing import Any

import jax

Params = Any  # a Flax ``params`` pytree of one model
ClientState = Any  # one client's persistent state (a pytree; ``()`` when the algorithm has none)
PRNGKey = jax.Array
Metrics = dict[str, jax.Array]
