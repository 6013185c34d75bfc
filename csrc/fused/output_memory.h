/* Where the fused primitives' outputs live (CUDA builds only). Private to
 * fused/.
 *
 * MLX's own CUDA kernels take their outputs from the encoder's
 * stream-ordered device pool, through cu::malloc_async (declared in
 * mlx/allocator.h). MLX's public allocator, the only one libmlx.so
 * exports, gives unified memory instead; asked for a size whose cached
 * buffer is in device memory, it converts that buffer on the spot (a new
 * managed allocation and a blocking copy), several times the pool's host
 * cost per output (docs/cuda-build.md has the measurement).
 *
 * Two things here rely on MLX's private workings: cu::malloc_async, which
 * libmlx.so builds with hidden visibility, and the use count of an array's
 * private shared_ptr (node_references, for writing over an input). Both
 * are used only where the loaded libmlx.so is the very build this library
 * compiled against (mlx_build_identity.h: same version, same build-id),
 * and only after a probe of each at run time: the lookup of
 * cu::malloc_async in the library's own symbol table (.symtab, which MLX's
 * wheels keep) must find an exported function of the same file at the
 * address the dynamic linker gave it, and the use count must read 1, 2, 1
 * on a probe array shared and let go. Where any of that fails, outputs
 * come from the public allocator and no input is written over (every
 * write copies): slower, never wrong.
 */
#ifndef MLX_DUALNORM_FUSED_OUTPUT_MEMORY_H
#define MLX_DUALNORM_FUSED_OUTPUT_MEMORY_H

#include <cstddef>

#include "mlx/array.h"

#include "mlx/allocator.h"
#include "mlx/backend/cuda/device.h"

namespace mlx_dualnorm_fused {

/* `bytes` of memory for one output of a kernel added to `encoder`, owned
 * by the returned Data (hand it to array::set_data). */
mlx::core::allocator::Data output_memory(size_t bytes, mlx::core::cu::CommandEncoder& encoder);

/* Gives `output` the memory of `buffer` and returns true when MLX itself
 * would let a node write into it (its SliceUpdate donates so): nothing but
 * the `node_outputs` outputs of the node being evaluated hold `buffer`
 * (each output of a multi-output node keeps its own list of the node's
 * inputs, so MLX's is_donatable, which asks for one holder, never says yes
 * for one), no other array shares its memory, the memory is MLX's own and
 * not much larger than the output (MLX's limit), and `buffer` is
 * row-contiguous, of the output's shape and dtype. Otherwise
 * gives `output` fresh memory (output_memory) and returns false: the
 * caller fills it. Either way `buffer`'s visible contents stay what every
 * holder saw: written in place only where no one else can look. */
bool take_buffer_or_allocate(const mlx::core::array& buffer, mlx::core::array& output,
                             size_t node_outputs, mlx::core::cu::CommandEncoder& encoder);

/* Gives `output` the memory of `input`, laid out with `strides` (which
 * must hold exactly its elements), where the node being evaluated may
 * write its output over its input: the conditions of
 * take_buffer_or_allocate but the shape, and the caller must know that
 * `output`'s elements, so laid out, lie where `input`'s do, and that its
 * kernel reads each element of `input` before it is written over (in the
 * same thread, or across a barrier of the block that writes it) and that
 * no other block reads it. Otherwise gives `output` fresh memory
 * (output_memory), laid out the same. */
void take_input_memory_or_allocate(const mlx::core::array& input, mlx::core::array& output,
                                   const mlx::core::Strides& strides, size_t node_outputs,
                                   mlx::core::cu::CommandEncoder& encoder);

/* Whether outputs come from MLX's stream-ordered device pool (true) or
 * from its public, unified-memory allocator (false: another MLX build than
 * the one compiled against, or a failed lookup). Does the check and the
 * lookup if they have not been done; needs no GPU. */
bool outputs_use_stream_ordered_pool();

} // namespace mlx_dualnorm_fused

#endif
