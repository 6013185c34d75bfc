"""cffi declarations, one module per C header, in the order cffi needs them.

Each module holds the C text cffi parses for one area: TYPES (typedefs and
enums) and FUNCTIONS (prototypes), mirroring the header beside it in csrc/.
build_ffi.py assembles them; the headers themselves stay the single source
of the real declarations, compiled against these by cffi's API mode.
"""

AREAS = (
    "error",
    "array",
    "vector",
    "device",
    "stream",
    "closure",
    "compile",
    "fast",
    "dual_head_norm",
)
