/* Compile ids, and erasing their traces from every thread's compile cache
 * (internal).
 *
 * MLX keeps one compile cache per thread, and mlx_detail_compile_erase
 * clears the calling thread's alone (upstream mlx-c's contract). A thread
 * that traced a graph and was then left alone would keep that trace until it
 * exits. So every thread that applies registers here, and closing an object
 * queues its compile ids on every other registered thread; each thread
 * erases its queue at the start of its next apply. A thread's exit drops its
 * MLX cache and, through the key destructor, its queue. Ids are never
 * reused, so a late erase can only hit the closed object's own traces.
 *
 * Each thread also notes which objects it applied, and a close queues ids
 * only on the threads that applied that object: what is held for a thread
 * is bounded by the objects it applied itself, so threads that sit idle
 * while others create and close objects accumulate nothing. */
#ifndef MLX_DUALNORM_PRIVATE_COMPILE_ERASURE_H
#define MLX_DUALNORM_PRIVATE_COMPILE_ERASURE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "mlx/c/mlx.h"

/* Fills `ids` with `count` (at most 16) compile ids never used before in
 * this process. */
void dualnorm_new_compile_ids(uintptr_t* ids, size_t count);

/* Registers the calling thread once and notes that it applies the object
 * whose compile ids start at `object_compile_ids` (every apply calls it;
 * an object it noted lately costs no lock); false when out of host memory. */
bool dualnorm_register_applying_thread(const uintptr_t* object_compile_ids);

/* Erases the compile-cache entries other threads' closes queued for the
 * calling thread. Non-zero when an erase failed. */
int dualnorm_erase_queued_compile_ids(void);

/* Erases `ids` (one object's, in the order registered) from the calling
 * thread's cache now and queues them on every other thread that applied
 * that object. Non-zero when an erase failed or host memory ran
 * out (that thread then keeps the traces until it exits). */
int dualnorm_erase_compile_ids_everywhere(const uintptr_t* ids, size_t count);

#endif
