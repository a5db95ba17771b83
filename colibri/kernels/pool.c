/* The native kernels' own thread pool: a fork/join that costs a few microseconds.
 *
 * Why not OpenMP: libgomp keeps one team per thread that starts parallel regions. The engine runs
 * its forward passes on its own thread, and the process's main thread has usually run torch ops
 * too, so two teams exist; libgomp then counts more threads than cores and makes every worker
 * sleep on a futex almost at once after each region (its "throttled" spin), and each of the
 * hundreds of small GEMVs of a decode step pays a wake-up. Measured on a 2-core VM: int8 GEMVs at
 * 6-8 GB/s from a second thread against 11-16 GB/s from the main thread.
 *
 * Here workers spin for a bounded time after each job (SPIN_NS: long enough to bridge the Python
 * between two kernels of a step, short enough not to burn a core on a busy machine), then sleep
 * on a condition variable; jobs are split into more pieces than threads, claimed dynamically. One
 * caller at a time uses the pool; a concurrent
 * caller runs its job on its own thread. coli_set_threads(n) sets how many threads a job uses
 * (the engine sets it with torch.set_num_threads).
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sched.h>
#include <time.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#else
#define CPU_RELAX() ((void)0)
#endif

#define MAX_WORKERS 255
/* 50 us bridges the Python between two kernels of a step (10-30 us); 300 us was measured to cost a
 * busy machine (benchmarks/bench_threads.py next to a spinning process: 0.67-0.60 of quiet at
 * 300 us, 0.85-0.95 at 50 us, the quiet figure unchanged). Override: -DSPIN_NS=... via
 * COLIBRI_NATIVE_CFLAGS. */
#ifndef SPIN_NS
#define SPIN_NS 50000L
#endif

typedef void (*coli_job)(void *arg, int id, int n);

/* Work goes out in CHUNKS_PER_THREAD x threads pieces that any thread may claim: on a machine where
 * another process (an HTTP server's event loop, a client) takes a core for a moment, a descheduled
 * worker holds up one small piece instead of half the job, and a job never waits for a worker that
 * has not woken yet (the caller claims what is left). Each piece is a fixed range of output rows,
 * so the bits do not depend on who computes what. Two per thread, not more: the threads claim pieces
 * in turn, so each piece is a new stretch of weights for the claiming thread, whose prefetch starts
 * over (int4 decode steps/s +5-10% at 2 than at 4 per thread, medians of interleaved runs on the 0.44b
 * model; 8 was slower still, 1 no better than 2; next to a busy process the same within the noise). */
#ifndef CHUNKS_PER_THREAD
#define CHUNKS_PER_THREAD 2
#endif

static pthread_mutex_t call_mu = PTHREAD_MUTEX_INITIALIZER; /* one caller at a time */
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;      /* sleeping workers */
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
static atomic_uint gen;          /* bumped once per job */
static _Atomic uint64_t claim;   /* (job gen << 32) | (chunks << 16) | next chunk: claimed by CAS */
static atomic_int completed;     /* chunks of the current job finished */
static int sleepers;             /* under mu */
static int n_workers;            /* under call_mu */
static int n_threads = 1;
static coli_job job_fn;
static void *job_arg;
static int job_n;                /* threads the current job may use (workers with id >= job_n sit out) */
static unsigned born_gen[MAX_WORKERS + 1]; /* the job count when worker i was made: it waits for the next */

/* One background job at a time (coli_background_post), run by worker 1 between two jobs: 0 none, 3 being
 * prepared, 1 posted, 2 running. It polls bg_stop, which the next job (coli_parallel) or
 * coli_background_wait raises. */
typedef void (*coli_bg_job)(void *arg, const atomic_int *stop);
static atomic_int bg_state;
static atomic_int bg_stop;
static coli_bg_job bg_fn;
static void *bg_arg;

static void run_background(void) {
    int posted = 1;
    if (!atomic_compare_exchange_strong_explicit(&bg_state, &posted, 2, memory_order_acq_rel, memory_order_acquire))
        return;
    bg_fn(bg_arg, &bg_stop);
    atomic_store_explicit(&bg_state, 0, memory_order_release);
}

static int bg_posted(int id) { return id == 1 && atomic_load_explicit(&bg_state, memory_order_acquire) == 1; }

static long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000L + ts.tv_nsec;
}

/* Claim and run chunks of job `g` until none is left (or the job is over: a newer one is posted). A
 * successful claim keeps job g alive (its caller waits for every chunk), so job_fn/job_arg are g's. */
static void run_chunks(unsigned g) {
    for (;;) {
        uint64_t v = atomic_load_explicit(&claim, memory_order_acquire);
        if ((unsigned)(v >> 32) != g) return;
        unsigned n = (unsigned)(v >> 16) & 0xffffu, c = (unsigned)v & 0xffffu;
        if (c >= n) return;
        if (!atomic_compare_exchange_weak_explicit(&claim, &v, v + 1, memory_order_acq_rel, memory_order_acquire))
            continue;
        job_fn(job_arg, (int)c, (int)n);
        atomic_fetch_add_explicit(&completed, 1, memory_order_acq_rel);
    }
}

static void *worker(void *p) {
    int id = (int)(intptr_t)p;
    unsigned seen = born_gen[id];
    for (;;) {
        unsigned g;
        long t0 = now_ns();
        int spins = 0;
        while ((g = atomic_load_explicit(&gen, memory_order_acquire)) == seen) {
            if (bg_posted(id)) {  /* (then spin again, as after a job) */
                run_background();
                t0 = now_ns();
                continue;
            }
            CPU_RELAX();
            if (++spins % 256 == 0 && now_ns() - t0 > SPIN_NS) {
                pthread_mutex_lock(&mu);
                sleepers++;
                while ((g = atomic_load_explicit(&gen, memory_order_acquire)) == seen && !bg_posted(id))
                    pthread_cond_wait(&cv, &mu);
                sleepers--;
                pthread_mutex_unlock(&mu);
                if (g == seen) continue;  /* woken for a background job */
                break;
            }
        }
        seen = g;
        if (id < job_n) run_chunks(g);  /* job_n may already be a newer job's: then no claim succeeds */
    }
    return NULL;
}

/* A forked child has none of the parent's workers (only the forking thread survives a fork): start
 * over, or its first parallel job would wait forever for workers that do not exist. */
static void atfork_child(void) {
    pthread_mutex_init(&call_mu, NULL);
    pthread_mutex_init(&mu, NULL);
    pthread_cond_init(&cv, NULL);
    n_workers = 0;
    sleepers = 0;
    atomic_store(&completed, 0);
    atomic_store(&bg_state, 0);
}

__attribute__((constructor)) static void pool_init(void) { pthread_atfork(NULL, NULL, atfork_child); }

void coli_set_threads(int n) { n_threads = n < 1 ? 1 : (n > MAX_WORKERS + 1 ? MAX_WORKERS + 1 : n); }

int coli_get_threads(void) { return n_threads; }

/* fn(arg, c, C) for every chunk c in [0, C), C = CHUNKS_PER_THREAD x n, on up to n threads (the caller
 * among them); returns when all are done. fn must compute a fixed share of the work from (c, C).
 * n <= 1, or the pool busy with another caller: fn(arg, 0, 1) on the calling thread. */
void coli_parallel(coli_job fn, void *arg, int n) {
    if (atomic_load_explicit(&bg_state, memory_order_relaxed)) atomic_store_explicit(&bg_stop, 1, memory_order_relaxed);
    if (n > n_threads) n = n_threads;
    if (n <= 1 || pthread_mutex_trylock(&call_mu) != 0) {
        fn(arg, 0, 1);
        return;
    }
    while (n_workers < n - 1) {
        pthread_t t;
        pthread_attr_t at;
        pthread_attr_init(&at);
        pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
        born_gen[n_workers + 1] = atomic_load_explicit(&gen, memory_order_relaxed);
        if (pthread_create(&t, &at, worker, (void *)(intptr_t)(n_workers + 1)) != 0) {
            pthread_attr_destroy(&at);
            break;
        }
        pthread_attr_destroy(&at);
        n_workers++;
    }
    if (n > n_workers + 1) n = n_workers + 1;
    int chunks = n * CHUNKS_PER_THREAD;
    if (chunks > 0xffff) chunks = 0xffff;
    unsigned g = atomic_load_explicit(&gen, memory_order_relaxed) + 1;
    job_fn = fn;
    job_arg = arg;
    job_n = n;
    atomic_store_explicit(&completed, 0, memory_order_relaxed);
    atomic_store_explicit(&claim, ((uint64_t)g << 32) | ((uint64_t)chunks << 16), memory_order_release);
    atomic_store_explicit(&gen, g, memory_order_release);
    pthread_mutex_lock(&mu);
    if (sleepers) pthread_cond_broadcast(&cv);
    pthread_mutex_unlock(&mu);
    run_chunks(g);
    /* Only chunks a worker claimed and has not finished are left; yield the core now and then in case
     * that worker is waiting for it. */
    for (int spins = 1; atomic_load_explicit(&completed, memory_order_acquire) < chunks; spins++) {
        CPU_RELAX();
        if (spins % 4096 == 0) sched_yield();
    }
    pthread_mutex_unlock(&call_mu);
}

/* A background job for worker 1 to run while the caller goes on (e.g. Python between two decode steps):
 * coli_background_claim() (1: the slot is the caller's; 0 with one thread, no worker yet, or a job still
 * posted or running), then whatever fn will read prepared, then coli_background_post(fn, arg). fn
 * returns soon after *stop turns nonzero, which the next parallel job or coli_background_wait makes it.
 * What fn reads must stay valid until the job ends: see coli_background_wait. */
int coli_background_claim(void) {
    int idle = 0;
    if (n_threads < 2 || n_workers < 1) return 0;
    return atomic_compare_exchange_strong_explicit(&bg_state, &idle, 3, memory_order_acq_rel, memory_order_acquire);
}

void coli_background_post(coli_bg_job fn, void *arg) {
    bg_fn = fn;
    bg_arg = arg;
    atomic_store_explicit(&bg_stop, 0, memory_order_relaxed);
    atomic_store_explicit(&bg_state, 1, memory_order_release);
    pthread_mutex_lock(&mu);
    if (sleepers) pthread_cond_broadcast(&cv);
    pthread_mutex_unlock(&mu);
}

/* Stop the background job and return once none is posted or running (before freeing what it reads). */
void coli_background_wait(void) {
    atomic_store_explicit(&bg_stop, 1, memory_order_release);
    for (;;) {
        int s = atomic_load_explicit(&bg_state, memory_order_acquire);
        if (s == 0) return;
        if (s == 1 && atomic_compare_exchange_strong_explicit(&bg_state, &s, 0, memory_order_acq_rel,
                                                              memory_order_acquire))
            return;
        CPU_RELAX();
    }
}
