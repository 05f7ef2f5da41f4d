"""The names the adapter gives and reads in Transformers' experts interfaces, declared once.

- `AUTO`: selector picks the backend per layer and token-count bucket.
- `PREFIX + backend` ("selector:grouped_mm"): that selector backend, whatever Transformers calls its own.
- `EAGER`: Transformers' name for the module's own forward; never registered, never shadowed.
- `DECODE_SWAPS`: the decode-phase swaps selector performs (Transformers swaps its own "grouped_mm" itself).
- `TRANSFORMERS_FALLBACK`: prefix of a quantised plan that runs Transformers' own FP8 function.

The adapter's own marks on the functions it hands Transformers are named here too (it keeps no state in
an experts module's `__dict__`: what it needs per module goes through `selector.dispatch`).
"""

from __future__ import annotations

from collections.abc import Mapping

from selector import dispatch

PREFIX = "selector:"
AUTO = dispatch.AUTO
EAGER = "eager"
DECODE_SWAPS: Mapping[str, str] = {PREFIX + "grouped_mm": PREFIX + "batched_mm"}
TRANSFORMERS_FALLBACK = "transformers:"

# attribute on each function registered into Transformers' interfaces: the selector request it runs
FORWARD_REQUEST_ATTR = "_selector_request"
# attribute on the decode hook installed into GenerationMixin: the Transformers function it wraps
HOOK_WRAPS_ATTR = "_selector_wraps"
