/* The error channel of the mlx-c subset (upstream mlx-c v0.6.0 names).
 *
 * Every fallible call catches the C++ exception MLX threw, hands its message
 * to the installed handler, and returns a non-zero status (or an empty
 * handle). As upstream, the message gets " at FILE:LINE" (where it was
 * reported) appended, and the DEFAULT handler prints it and EXITS the
 * process: a library must install its own handler before its first call.
 */
#ifndef MLX_ERROR_H
#define MLX_ERROR_H

#ifdef __cplusplus
extern "C" {
#endif

/* Receives each error message; `data` is the pointer given at install. */
typedef void (*mlx_error_handler_func)(const char* msg, void* data);

/* Installs `handler` process-wide (NULL restores the default handler).
 * With a `dtor`, the slot owns `data` and calls `dtor` on it once the
 * handler is replaced; without one, `data` stays the caller's. */
void mlx_set_error_handler(
    mlx_error_handler_func handler,
    void* data,
    void (*dtor)(void*));

/* Formats a message (printf-style), appends " at FILE:LINE" and hands it
 * to the installed handler. */
void _mlx_error(const char* file, const int line, const char* fmt, ...);

#define mlx_error(...) _mlx_error(__FILE__, __LINE__, __VA_ARGS__)

#ifdef __cplusplus
}
#endif

#endif
