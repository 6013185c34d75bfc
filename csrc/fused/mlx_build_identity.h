/* The identity of the MLX build this library was compiled against, and of
 * the libmlx.so loaded in the process. Internal to the package (the fused
 * mode asks before it relies on MLX's private layout); in every build, CPU
 * ones too: it needs libmlx.so, not MLX's CUDA backend.
 *
 * An identity is MLX's version and the GNU build-id of its libmlx.so, as
 * one string: "MLX 0.32.4 (build-id 9b1b...)" (the build-id in lowercase
 * hex), or "MLX 0.32.4 (no build-id)" where none is known. The compiled
 * one takes the version from mlx/version.h as compiled and the build-id
 * from MLX_DUALNORM_MLX_BUILD_ID (build_ffi.py reads it from the libmlx.so
 * it links); the loaded one takes mlx::core::version() and the build-id
 * note the dynamic linker mapped with the library that defines it.
 *
 * Each is worked out once per process (thread-safe), needs no GPU, and
 * the strings returned are the library's, valid until the process exits:
 * the caller frees nothing. */
#ifndef MLX_DUALNORM_FUSED_MLX_BUILD_IDENTITY_H
#define MLX_DUALNORM_FUSED_MLX_BUILD_IDENTITY_H

#include <stdbool.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Whether the loaded libmlx.so is the very build compiled against: same
 * version string and same build-id, both known. False on any difference,
 * and where either build-id is unknown. */
bool mlx_dualnorm_mlx_build_matches(void);

/* The identity compiled against (see above). */
const char* mlx_dualnorm_mlx_build_compiled(void);

/* The identity of the libmlx.so loaded in this process (see above). */
const char* mlx_dualnorm_mlx_build_loaded(void);

#ifdef __cplusplus
}
#endif

#endif
