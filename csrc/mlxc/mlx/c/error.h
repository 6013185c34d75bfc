/* The error channel of the mlx-c subset (upstream mlx-c v0.6.0 names).
 *
 * Every fallible call in this API catches the C++ exception MLX threw,
 * hands its message to the installed handler, and returns a non-zero status
 * (or an empty handle). Nothing in this subset prints-and-exits: where
 * upstream's default handler would end the process, this one writes the
 * message to stderr and returns, so a caller that checks return codes keeps
 * control. Libraries install their own handler to route messages.
 */
#ifndef MLX_C_ERROR_H
#define MLX_C_ERROR_H

#ifdef __cplusplus
extern "C" {
#endif

/* Receives each error message; `data` is the pointer given at install. */
typedef void (*mlx_error_handler_func)(const char* msg, void* data);

/* Installs `handler` process-wide (NULL restores the default handler).
 * `data` is owned by the handler slot from now on: `dtor`, when not NULL, is
 * called on it once the handler is replaced. */
void mlx_set_error_handler(
    mlx_error_handler_func handler,
    void* data,
    void (*dtor)(void*));

/* Formats a message and hands it to the installed handler. */
void _mlx_error(const char* file, const int line, const char* fmt, ...);

#define mlx_error(...) _mlx_error(__FILE__, __LINE__, __VA_ARGS__)

#ifdef __cplusplus
}
#endif

#endif
