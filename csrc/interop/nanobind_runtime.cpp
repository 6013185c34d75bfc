/* nanobind's runtime, compiled into mlx_dualnorm._interop from the nanobind
 * package's single-file build (the extension is built with NB_DOMAIN=mlx so
 * it shares mlx.core's type registry). Included rather than listed as a
 * source so its object file stays in this build's own temp folder. */
#include <nb_combined.cpp>
