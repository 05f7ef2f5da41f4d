"""The names the adapter gives and reads in Transformers' experts interfaces, declared once.

- `AUTO`: selector picks the backend per layer and token-count bucket.
- `PREFIX + backend` ("selector:grouped_mm"): that selector backend, whatever Transformers calls its own.
- `EAGER`: Transformers' name for the module's own forward; never registered, never shadowed.
- `DECODE_SWAPS`: the decode-phase swaps selector performs (Transformers swaps its own "grouped_mm" itself).
- `TRANSFORMERS_FALLBACK`: prefix of a quantised plan that runs Transformers' own FP8 function.
"""

from __future__ import annotations

from collections.abc import Mapping

from selector import dispatch

PREFIX = "selector:"
AUTO = dispatch.AUTO
EAGER = "eager"
DECODE_SWAPS: Mapping[str, str] = {PREFIX + "grouped_mm": PREFIX + "batched_mm"}
TRANSFORMERS_FALLBACK = "transformers:"
