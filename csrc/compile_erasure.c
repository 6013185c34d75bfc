/* Erasing compile-cache entries from every thread's cache (see
 * compile_erasure.h). */
#include "compile_erasure.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* Compile ids: a tag above every user-space address (MLX's own ids are
 * addresses), then a process-wide serial. */
static const uint64_t COMPILE_ID_TAG = UINT64_C(0xD0A1) << 48;
enum { COMPILE_ID_SERIAL_SHIFT = 4 };
static _Atomic uint64_t next_compile_serial = 1;

void dualnorm_new_compile_ids(uintptr_t* ids, size_t count) {
  uint64_t serial = atomic_fetch_add(&next_compile_serial, 1);
  for (size_t index = 0; index < count; ++index) {
    ids[index] = (uintptr_t)(COMPILE_ID_TAG | (serial << COMPILE_ID_SERIAL_SHIFT) | index);
  }
}

typedef struct applying_thread {
  struct applying_thread* next;
  uintptr_t* queued_ids; /* owned; erased and emptied by the thread itself */
  size_t queued_count;
  size_t queued_capacity;
  atomic_bool has_queued_ids; /* read without the lock on every apply */
} applying_thread;

static pthread_mutex_t applying_threads_lock = PTHREAD_MUTEX_INITIALIZER;
static applying_thread* applying_threads = NULL;
static _Thread_local applying_thread* this_applying_thread = NULL;
static pthread_key_t applying_thread_key;
static pthread_once_t applying_thread_key_once = PTHREAD_ONCE_INIT;

/* Signalled whenever a registered thread is forgotten. */
static pthread_cond_t applying_thread_forgotten = PTHREAD_COND_INITIALIZER;

/* Runs at a registered thread's exit, after its C++ thread_local
 * destructors (MLX's among them): unlinks and frees its record. */
static void forget_applying_thread(void* record) {
  applying_thread* exiting = record;
  pthread_mutex_lock(&applying_threads_lock);
  for (applying_thread** link = &applying_threads; *link != NULL; link = &(*link)->next) {
    if (*link == exiting) {
      *link = exiting->next;
      break;
    }
  }
  pthread_cond_broadcast(&applying_thread_forgotten);
  pthread_mutex_unlock(&applying_threads_lock);
  free(exiting->queued_ids);
  free(exiting);
}

static void create_applying_thread_key(void) {
  pthread_key_create(&applying_thread_key, forget_applying_thread);
}

bool dualnorm_register_applying_thread(void) {
  if (this_applying_thread != NULL) {
    return true;
  }
  pthread_once(&applying_thread_key_once, create_applying_thread_key);
  applying_thread* record = calloc(1, sizeof *record);
  if (record == NULL || pthread_setspecific(applying_thread_key, record) != 0) {
    free(record);
    return false;
  }
  pthread_mutex_lock(&applying_threads_lock);
  record->next = applying_threads;
  applying_threads = record;
  pthread_mutex_unlock(&applying_threads_lock);
  this_applying_thread = record;
  return true;
}

int dualnorm_erase_queued_compile_ids(void) {
  applying_thread* record = this_applying_thread;
  if (record == NULL || !atomic_load_explicit(&record->has_queued_ids, memory_order_acquire)) {
    return 0;
  }
  pthread_mutex_lock(&applying_threads_lock);
  uintptr_t* queued_ids = record->queued_ids;
  size_t queued_count = record->queued_count;
  record->queued_ids = NULL;
  record->queued_count = record->queued_capacity = 0;
  atomic_store_explicit(&record->has_queued_ids, false, memory_order_relaxed);
  pthread_mutex_unlock(&applying_threads_lock);
  int status = 0;
  for (size_t index = 0; index < queued_count; ++index) {
    status |= mlx_detail_compile_erase(queued_ids[index]);
  }
  free(queued_ids);
  return status;
}

/* Appends `count` ids to a thread's queue; the caller holds the lock. */
static bool queue_compile_ids(applying_thread* record, const uintptr_t* ids, size_t count) {
  if (record->queued_count + count > record->queued_capacity) {
    size_t capacity = 2 * (record->queued_count + count);
    uintptr_t* grown = realloc(record->queued_ids, capacity * sizeof *grown);
    if (grown == NULL) {
      return false;
    }
    record->queued_ids = grown;
    record->queued_capacity = capacity;
  }
  memcpy(record->queued_ids + record->queued_count, ids, count * sizeof *ids);
  record->queued_count += count;
  atomic_store_explicit(&record->has_queued_ids, true, memory_order_release);
  return true;
}

int dualnorm_erase_compile_ids_everywhere(const uintptr_t* ids, size_t count) {
  int status = 0;
  for (size_t index = 0; index < count; ++index) {
    status |= mlx_detail_compile_erase(ids[index]);
  }
  pthread_mutex_lock(&applying_threads_lock);
  for (applying_thread* record = applying_threads; record != NULL; record = record->next) {
    if (record != this_applying_thread && !queue_compile_ids(record, ids, count)) {
      status = 1;
    }
  }
  pthread_mutex_unlock(&applying_threads_lock);
  return status;
}

/* The registered threads other than the caller; the caller holds the lock. */
static size_t other_applying_threads(void) {
  size_t count = 0;
  for (applying_thread* record = applying_threads; record != NULL; record = record->next) {
    count += record != this_applying_thread;
  }
  return count;
}

size_t mlx_dualnorm_await_thread_exits(unsigned timeout_ms) {
  struct timespec deadline;
  timespec_get(&deadline, TIME_UTC); /* the clock pthread_cond_timedwait reads */
  deadline.tv_sec += timeout_ms / 1000;
  deadline.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
  if (deadline.tv_nsec >= 1000000000L) {
    deadline.tv_sec += 1;
    deadline.tv_nsec -= 1000000000L;
  }
  pthread_mutex_lock(&applying_threads_lock);
  size_t remaining = other_applying_threads();
  while (remaining > 0 &&
         pthread_cond_timedwait(&applying_thread_forgotten, &applying_threads_lock, &deadline) == 0) {
    remaining = other_applying_threads();
  }
  remaining = other_applying_threads();
  pthread_mutex_unlock(&applying_threads_lock);
  return remaining;
}
