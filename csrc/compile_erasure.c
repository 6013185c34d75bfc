/* Erasing compile-cache entries from every thread's cache (see
 * compile_erasure.h). */
#include "private/compile_erasure.h"

#include "mlx_dualnorm/dual_head_norm_common.h" /* the public functions defined here */

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

/* A growable array of ids, owned by the record that holds it. */
typedef struct id_list {
  uintptr_t* ids;
  size_t count;
  size_t capacity;
} id_list;

typedef struct applying_thread {
  struct applying_thread* next;
  /* The first compile id of every open object this thread applied: only
   * these threads can hold its traces, so only they get its ids queued at
   * close. Written under applying_threads_lock. */
  id_list applied_objects;
  id_list queued_ids; /* erased and emptied by the thread itself */
  atomic_bool has_queued_ids; /* read without the lock on every apply */
} applying_thread;

static pthread_mutex_t applying_threads_lock = PTHREAD_MUTEX_INITIALIZER;
static applying_thread* applying_threads = NULL;
static _Thread_local applying_thread* this_applying_thread = NULL;
/* The objects this thread noted lately, direct-mapped by serial: an apply
 * of one of them takes no lock. An entry may outlive the object's close;
 * ids are never reused, so it can only skip noting a closed object, whose
 * applies fail before tracing anything. */
enum { RECENT_OBJECT_SLOTS = 16 };
static _Thread_local uintptr_t recent_objects[RECENT_OBJECT_SLOTS];
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
  free(exiting->applied_objects.ids);
  free(exiting->queued_ids.ids);
  free(exiting);
}

static void create_applying_thread_key(void) {
  pthread_key_create(&applying_thread_key, forget_applying_thread);
}

/* Appends `count` ids to `list`; the caller holds applying_threads_lock. */
static bool append_ids(id_list* list, const uintptr_t* ids, size_t count) {
  if (list->count + count > list->capacity) {
    size_t capacity = 2 * (list->count + count);
    uintptr_t* grown = realloc(list->ids, capacity * sizeof *grown);
    if (grown == NULL) {
      return false;
    }
    list->ids = grown;
    list->capacity = capacity;
  }
  memcpy(list->ids + list->count, ids, count * sizeof *ids);
  list->count += count;
  return true;
}

/* Removes `id` from `list` if there (order is not kept); whether it was. */
static bool remove_id(id_list* list, uintptr_t id) {
  for (size_t index = 0; index < list->count; ++index) {
    if (list->ids[index] == id) {
      list->ids[index] = list->ids[--list->count];
      return true;
    }
  }
  return false;
}

static applying_thread* registered_this_thread(void) {
  if (this_applying_thread != NULL) {
    return this_applying_thread;
  }
  pthread_once(&applying_thread_key_once, create_applying_thread_key);
  applying_thread* record = calloc(1, sizeof *record);
  if (record == NULL || pthread_setspecific(applying_thread_key, record) != 0) {
    free(record);
    return NULL;
  }
  pthread_mutex_lock(&applying_threads_lock);
  record->next = applying_threads;
  applying_threads = record;
  pthread_mutex_unlock(&applying_threads_lock);
  this_applying_thread = record;
  return record;
}

bool dualnorm_register_applying_thread(const uintptr_t* object_compile_ids) {
  uintptr_t object = object_compile_ids[0];
  uintptr_t* recent = &recent_objects[(object >> COMPILE_ID_SERIAL_SHIFT) % RECENT_OBJECT_SLOTS];
  if (*recent == object) {
    return true;
  }
  applying_thread* record = registered_this_thread();
  if (record == NULL) {
    return false;
  }
  pthread_mutex_lock(&applying_threads_lock);
  bool noted = false;
  for (size_t index = 0; index < record->applied_objects.count && !noted; ++index) {
    noted = record->applied_objects.ids[index] == object;
  }
  if (!noted) {
    noted = append_ids(&record->applied_objects, &object, 1);
  }
  pthread_mutex_unlock(&applying_threads_lock);
  if (noted) {
    *recent = object;
  }
  return noted;
}

int dualnorm_erase_queued_compile_ids(void) {
  applying_thread* record = this_applying_thread;
  if (record == NULL || !atomic_load_explicit(&record->has_queued_ids, memory_order_acquire)) {
    return 0;
  }
  pthread_mutex_lock(&applying_threads_lock);
  uintptr_t* queued_ids = record->queued_ids.ids;
  size_t queued_count = record->queued_ids.count;
  record->queued_ids = (id_list){0};
  atomic_store_explicit(&record->has_queued_ids, false, memory_order_relaxed);
  pthread_mutex_unlock(&applying_threads_lock);
  int status = 0;
  for (size_t index = 0; index < queued_count; ++index) {
    status |= mlx_detail_compile_erase(queued_ids[index]);
  }
  free(queued_ids);
  return status;
}

int dualnorm_erase_compile_ids_everywhere(const uintptr_t* ids, size_t count) {
  int status = 0;
  for (size_t index = 0; index < count; ++index) {
    status |= mlx_detail_compile_erase(ids[index]);
  }
  /* Only threads that applied this object can hold its traces; the others
   * get nothing queued, however long they stay idle. */
  pthread_mutex_lock(&applying_threads_lock);
  for (applying_thread* record = applying_threads; record != NULL; record = record->next) {
    if (!remove_id(&record->applied_objects, ids[0]) || record == this_applying_thread) {
      continue;
    }
    if (append_ids(&record->queued_ids, ids, count)) {
      atomic_store_explicit(&record->has_queued_ids, true, memory_order_release);
    } else {
      status = 1;
    }
  }
  pthread_mutex_unlock(&applying_threads_lock);
  return status;
}

size_t mlx_dualnorm_pending_erasure_entries(void) {
  size_t queued = 0;
  pthread_mutex_lock(&applying_threads_lock);
  for (applying_thread* record = applying_threads; record != NULL; record = record->next) {
    queued += record->queued_ids.count + record->applied_objects.count;
  }
  pthread_mutex_unlock(&applying_threads_lock);
  return queued;
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
