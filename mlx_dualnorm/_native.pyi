"""Types of the cffi module built by build_ffi.py (declarations: the C
headers in csrc/)."""

from typing import Any

ffi: Any
lib: Any
