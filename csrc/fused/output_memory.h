/* Where the fused primitives' outputs live (CUDA builds only). Private to
 * fused/.
 *
 * MLX's own CUDA kernels take their outputs from the encoder's
 * stream-ordered device pool, through cu::malloc_async (declared in
 * mlx/allocator.h). MLX's public allocator, the only one libmlx.so
 * exports, gives unified memory instead; asked for a size whose cached
 * buffer is in device memory, it converts that buffer on the spot (a new
 * managed allocation and a blocking copy). On an H200 in mlx-lm decode that
 * cost 1.7-1.8 µs a fused output on average, against 0.56 µs from the
 * stream-ordered pool (2026-12-01).
 *
 * libmlx.so builds cu::malloc_async with hidden visibility, so it is looked
 * up once in the library's own symbol table (.symtab, which MLX's wheels
 * keep). The lookup proves itself first: it must find an exported function
 * of the same file at the address the dynamic linker gave it. Where either
 * step fails (a stripped or different libmlx.so), the public allocator
 * serves: slower, never wrong.
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
 * from its public, unified-memory allocator (false). Does the lookup if
 * it has not been done; needs no GPU. */
bool outputs_use_stream_ordered_pool();

} // namespace mlx_dualnorm_fused

#endif
