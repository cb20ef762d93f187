/*
 * CUDA on the host: the device built-ins the project's kernels use, mapped to
 * C++17 for g++, and the block scheduler that runs a kernel with CUDA's
 * semantics. tests/twin/cupy/_kernels.py (the twin's "NVRTC") prepends
 * `#include "cuda_twin.h"` to a CUDA translation unit, appends one wrapper
 * per extern "C" __global__ kernel and builds a shared library; it then
 * calls gctwin_launch() below with the wrapper of the kernel to run.
 *
 * Execution model (one launch at a time per module; the Python side holds a
 * process-wide lock, and gctwin_launch refuses re-entry):
 *
 *   - Thread blocks run one after another in grid order (x fastest, then y,
 *     then z), on the calling OS thread.
 *   - The threads of a block are fibers with their own stacks (GCTWIN_STACK
 *     bytes each, with a guard page below, so an overflow faults instead of
 *     corrupting a neighbour). A thread runs until it reaches a barrier or
 *     returns; no thread is ever preempted, so plain read-modify-writes are
 *     atomic and memory is sequentially consistent at barriers.
 *   - Barriers: __syncthreads* (every thread of the block, same call site)
 *     and the warp operations (__shfl*_sync, __syncwarp, votes: every lane
 *     named by the mask; warps are consecutive groups of 32 threads by linear
 *     thread id x + y * bx + z * bx * by). A warp operation completes when the
 *     last named lane arrives; values are exchanged then, so each lane reads
 *     what its source lane passed.
 *   - Each phase (the runs between barrier releases) runs the ready threads
 *     in a fixed order that is NOT thread-id order: descending by default.
 *     Code that forgets a barrier usually has a low thread (thread 0, lane 0)
 *     produce what others consume; running the consumers first makes them
 *     read stale data instead of, by luck of scheduling, the right value.
 *     (gctwin_launch's order 1, Kernel.launch(order="ascending") in Python,
 *     runs them in id order, to show the difference.)
 *   - __shared__ variables are function-scope statics in the section
 *     "gctwin_shared", filled with 0xff bytes before every block (CUDA leaves
 *     shared memory undefined): a read before any write shows NaN or
 *     all-ones.
 *
 * Errors are reported, never aborted on: gctwin_launch returns non-zero with
 * a message for barrier divergence (a __syncthreads that some live thread
 * misses: it exited or waits at another barrier), warp operations whose mask
 * does not name the caller, names a lane that exited or is not in the block,
 * differs between the named lanes, or reads a lane outside the mask, an
 * invalid shuffle width, __trap(), and any deadlock. This is stricter than
 * the letter of CUDA in one place: CUDA tolerates exited lanes in a shuffle
 * mask (reading them gives undefined values); the twin rejects them.
 * Barrier identity is the source line (__builtin_LINE() of the call, in the
 * unit's own numbering), so two barriers on one line count as one.
 *
 * Floating point: fp32 is CUDA's, not the host's: `float` in a kernel unit
 * names gctwin::f32 (cuda_twin_fp32.h, which lists how a GPU's fp32 differs
 * from SSE's and what the twin does about each: NaN results, conversions to
 * integers, min/max, -ftz). Its arithmetic and fp64's are the host's IEEE
 * arithmetic (SSE on x86-64). The __f*_rn / __d*_rn intrinsics pass their
 * operands and result through empty asm statements so that
 * -ffp-contract=fast can never fuse them (CUDA never contracts them either).
 * With gctwin_module_ftz (NVRTC's -ftz=true) a launch sets MXCSR.FTZ|DAZ
 * (aarch64: FPCR.FZ), which flushes subnormal fp32 inputs and results as the
 * GPU does; the host flag would also flush fp64, so the __d*_rn intrinsics
 * clear it around their operation (plain fp64 operators in a -ftz=true
 * kernel do flush: a known difference). The caller's floating-point control
 * word is restored after the launch.
 *
 * Not provided: dynamic shared memory (extern __shared__), textures,
 * cooperative groups, clock(), half precision, _rz/_ru/_rd rounding, memory
 * bounds checks (a kernel indexing past its buffers corrupts the process, as
 * on a GPU without compute-sanitizer), and preemption: a thread that spins on
 * a flag another thread of its block must set hangs the launch.
 */
#ifndef GCTWIN_CUDA_TWIN_H
#define GCTWIN_CUDA_TWIN_H

#include <float.h>
#include <math.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include <type_traits>

#if !defined(__x86_64__) && !defined(GCTWIN_USE_UCONTEXT)
#define GCTWIN_USE_UCONTEXT 1 /* the fast switch below is x86-64 only */
#endif
#ifdef GCTWIN_USE_UCONTEXT
#include <ucontext.h>
#endif

/* What NVRTC defines for device code; after the system headers, which test
 * __CUDACC__ to work around nvcc's front end. */
#define __CUDACC__ 1
#define __CUDACC_RTC__ 1
#ifndef GCTWIN_CUDA_ARCH
#define GCTWIN_CUDA_ARCH 520 /* NVRTC's default, compute_52; _kernels.py sets -arch's */
#endif
#define __CUDA_ARCH__ GCTWIN_CUDA_ARCH
#define GEOCOMM_CUDA_TWIN 1

#ifndef GCTWIN_STACK
#define GCTWIN_STACK (64 * 1024) /* bytes of stack per thread */
#endif
#define GCTWIN_MAX_THREADS 1024
#define GCTWIN_WARP 32
#define GCTWIN_EXPORT extern "C" __attribute__((visibility("default")))

/* ---- qualifiers ---------------------------------------------------------------- */

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __constant__ static
#define __shared__ static __attribute__((section("gctwin_shared")))
#define __launch_bounds__(...)

/* ---- vector and index types ------------------------------------------------------ */

struct uint3 {
    unsigned int x, y, z;
};

struct dim3 {
    unsigned int x, y, z;
    dim3(unsigned int vx = 1, unsigned int vy = 1, unsigned int vz = 1) : x(vx), y(vy), z(vz) {}
};

#define GCTWIN_VEC2(T, N)                                                                          \
    struct N {                                                                                     \
        T x, y;                                                                                    \
    };                                                                                             \
    inline N make_##N(T x, T y)                                                                    \
    {                                                                                              \
        N v = {x, y};                                                                              \
        return v;                                                                                  \
    }
#define GCTWIN_VEC4(T, N)                                                                          \
    struct N {                                                                                     \
        T x, y, z, w;                                                                              \
    };                                                                                             \
    inline N make_##N(T x, T y, T z, T w)                                                          \
    {                                                                                              \
        N v = {x, y, z, w};                                                                        \
        return v;                                                                                  \
    }
GCTWIN_VEC2(int, int2)
GCTWIN_VEC4(int, int4)
GCTWIN_VEC2(unsigned int, uint2)
GCTWIN_VEC4(unsigned int, uint4)
GCTWIN_VEC2(double, double2)
#undef GCTWIN_VEC2

/* CUDA aligns uchar4 to 4 bytes (and float4, in cuda_twin_fp32.h, to 16): a kernel
 * that casts a pointer to one of them must check that alignment itself. */
struct alignas(4) uchar4 {
    unsigned char x, y, z, w;
};
inline uchar4 make_uchar4(unsigned char x, unsigned char y, unsigned char z, unsigned char w)
{
    uchar4 v = {x, y, z, w};
    return v;
}
#undef GCTWIN_VEC4

inline uint3 make_uint3(unsigned int x, unsigned int y, unsigned int z)
{
    uint3 v = {x, y, z};
    return v;
}

/* ---- runtime state ------------------------------------------------------------------- */

namespace gctwin {

enum { READY, AT_SYNC, AT_WARP, DONE };                    /* thread states */
enum { SHFL_IDX, SHFL_UP, SHFL_DOWN, SHFL_XOR, SYNCWARP, BALLOT }; /* warp operations */
enum { SYNC_PLAIN, SYNC_COUNT, SYNC_AND, SYNC_OR };        /* __syncthreads flavours */

static const char *const warp_op_names[] = {"__shfl_sync", "__shfl_up_sync", "__shfl_down_sync",
                                            "__shfl_xor_sync", "__syncwarp", "a vote"};
static const char *const sync_names[] = {"__syncthreads", "__syncthreads_count",
                                         "__syncthreads_and", "__syncthreads_or"};

struct thread {
    void *sp;            /* saved stack pointer while switched out */
    char *stack;         /* lowest usable byte of its stack */
    uint3 idx;           /* threadIdx */
    unsigned int tid;    /* linear thread id */
    unsigned int state;  /* READY, AT_SYNC, AT_WARP or DONE */
    unsigned int line;   /* source line of the barrier it waits at */
    unsigned int op;     /* AT_SYNC: SYNC_*; AT_WARP: SHFL_* / SYNCWARP / BALLOT */
    unsigned int mask;   /* warp operation: the lanes it names */
    unsigned int bval;   /* shuffle: lane, delta or lane mask (5 bits, as PTX takes it) */
    unsigned int cval;   /* shuffle: PTX's c operand, (32 - width) << 8 | clamp */
    int started;         /* 0 until its fiber first runs in this block */
    unsigned long long value, result; /* what it passes / what it gets back */
#ifdef GCTWIN_USE_UCONTEXT
    ucontext_t uc;
#endif
};

struct warp {
    unsigned int present; /* lanes that exist in this block */
    unsigned int exited;  /* lanes that returned */
    unsigned int waiting; /* lanes waiting at a warp operation */
};

struct state {
    thread *cur;                /* the running thread (the scheduler between runs) */
    void *sched_sp;             /* the scheduler's stack pointer while a fiber runs */
#ifdef GCTWIN_USE_UCONTEXT
    ucontext_t sched_uc;
#endif
    void (*call)(void **);      /* the kernel's gctwin_call_* wrapper */
    void **args;
    uint3 block_idx;
    dim3 block_dim, grid_dim;
    unsigned int nthreads;
    int active, failed, ftz;
    char err[2048];
    char *pool;                 /* thread stacks (with guard pages), pool_slots of them */
    size_t pool_slots, slot_size;
    thread threads[GCTWIN_MAX_THREADS];
    warp warps[GCTWIN_MAX_THREADS / GCTWIN_WARP];
};

static state g;

/* The kernel unit defines this (1: compiled with -ftz=true). */
extern const int module_ftz;

} // namespace gctwin

/* The built-in variables: read-only views of the running thread and its block. */
#define threadIdx (static_cast<const uint3 &>(::gctwin::g.cur->idx))
#define blockIdx (static_cast<const uint3 &>(::gctwin::g.block_idx))
#define blockDim (static_cast<const dim3 &>(::gctwin::g.block_dim))
#define gridDim (static_cast<const dim3 &>(::gctwin::g.grid_dim))
static const int warpSize = GCTWIN_WARP;

/* ---- context switch --------------------------------------------------------------------- */

#ifndef GCTWIN_USE_UCONTEXT
/* gctwin_swap(save, load): push the callee-saved registers, store the stack
 * pointer in *save, switch to the stack `load` and pop its registers. A new
 * fiber's stack holds zeroed registers and the address of gctwin_fiber_entry,
 * which calls gctwin_fiber_main with a 16-byte aligned stack. */
extern "C" void gctwin_swap(void **save, void *load) __attribute__((visibility("hidden")));
extern "C" void gctwin_fiber_entry(void) __attribute__((visibility("hidden")));
__asm__(".text\n"
        ".globl gctwin_swap\n"
        ".hidden gctwin_swap\n"
        ".type gctwin_swap, @function\n"
        "gctwin_swap:\n"
        "    pushq %rbp\n"
        "    pushq %rbx\n"
        "    pushq %r12\n"
        "    pushq %r13\n"
        "    pushq %r14\n"
        "    pushq %r15\n"
        "    movq %rsp, (%rdi)\n"
        "    movq %rsi, %rsp\n"
        "    popq %r15\n"
        "    popq %r14\n"
        "    popq %r13\n"
        "    popq %r12\n"
        "    popq %rbx\n"
        "    popq %rbp\n"
        "    ret\n"
        ".size gctwin_swap, .-gctwin_swap\n"
        ".globl gctwin_fiber_entry\n"
        ".hidden gctwin_fiber_entry\n"
        ".type gctwin_fiber_entry, @function\n"
        "gctwin_fiber_entry:\n"
        "    call gctwin_fiber_main\n"
        "    ud2\n"
        ".size gctwin_fiber_entry, .-gctwin_fiber_entry\n");
#endif

extern "C" void gctwin_fiber_main(void) __attribute__((visibility("hidden"), used, noreturn));

namespace gctwin {

/* Back to the scheduler; returns when the scheduler resumes this thread. */
static inline void yield(void)
{
#ifdef GCTWIN_USE_UCONTEXT
    swapcontext(&g.cur->uc, &g.sched_uc);
#else
    gctwin_swap(&g.cur->sp, g.sched_sp);
#endif
}

/* Run thread t until it blocks or exits (its first run starts the kernel). */
static void resume(thread *t)
{
    g.cur = t;
    if (!t->started) {
        t->started = 1;
#ifdef GCTWIN_USE_UCONTEXT
        getcontext(&t->uc);
        t->uc.uc_stack.ss_sp = t->stack;
        t->uc.uc_stack.ss_size = GCTWIN_STACK;
        t->uc.uc_link = NULL;
        makecontext(&t->uc, gctwin_fiber_main, 0);
#else
        void **top = (void **)(t->stack + GCTWIN_STACK); /* 16-byte aligned */
        void **sp = top - 7;                             /* r15 r14 r13 r12 rbx rbp ret */
        for (int i = 0; i < 6; ++i)
            sp[i] = NULL;
        sp[6] = (void *)gctwin_fiber_entry;
        t->sp = sp;
#endif
    }
#ifdef GCTWIN_USE_UCONTEXT
    swapcontext(&g.sched_uc, &t->uc);
#else
    gctwin_swap(&g.sched_sp, t->sp);
#endif
}

/* Record the launch's first error (printf-style); the scheduler stops at it. */
__attribute__((format(printf, 1, 2))) static void fail(const char *fmt, ...)
{
    if (g.failed)
        return;
    g.failed = 1;
    int used = snprintf(g.err, sizeof g.err, "block (%u,%u,%u): ", g.block_idx.x,
                        g.block_idx.y, g.block_idx.z);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g.err + used, sizeof g.err - (size_t)used, fmt, ap);
    va_end(ap);
}

static thread *lane_thread(unsigned int w, unsigned int lane)
{
    return &g.threads[w * GCTWIN_WARP + lane];
}

/* "thread (x,y,z)" of t, in a small rotating buffer (several per message). */
static const char *who(const thread *t)
{
    static char buf[4][48];
    static int next;
    char *b = buf[next++ & 3];
    snprintf(b, sizeof buf[0], "thread (%u,%u,%u)", t->idx.x, t->idx.y, t->idx.z);
    return b;
}

} // namespace gctwin

extern "C" void gctwin_fiber_main(void)
{
    using namespace gctwin;
    g.call(g.args);
    g.cur->state = DONE;
    yield(); /* never resumed */
    __builtin_trap();
}

/* ---- barriers ------------------------------------------------------------------------ */

namespace gctwin {

/* Wait at a __syncthreads of flavour `op` with predicate `pred`; the result
 * of the flavour's reduction over the block. */
static __attribute__((noinline)) int block_barrier(unsigned int op, int pred, unsigned int line)
{
    thread *t = g.cur;
    t->state = AT_SYNC;
    t->op = op;
    t->line = line;
    t->value = pred != 0;
    yield();
    return (int)t->result;
}

/* Wait at warp operation `op`; the value this lane receives. The lane
 * bookkeeping happens in the scheduler (on its own stack). */
static __attribute__((noinline)) unsigned long long warp_op(unsigned int op, unsigned int mask,
                                                            unsigned long long value,
                                                            unsigned int bval, unsigned int cval,
                                                            unsigned int line)
{
    thread *t = g.cur;
    t->state = AT_WARP;
    t->op = op;
    t->mask = mask;
    t->value = value;
    t->bval = bval & 31u;
    t->cval = cval;
    t->line = line;
    yield();
    return t->result;
}

/* PTX's c operand of a shuffle of `width` lanes (clamp: 0 for up, 31 otherwise). */
static inline unsigned int shfl_c(int width, unsigned int clamp, unsigned int line)
{
    if (width < 1 || width > GCTWIN_WARP || (width & (width - 1))) {
        fail("%s: shuffle at line %u with width %d (must be a power of two in [1, 32])",
             who(g.cur), line, width);
        yield(); /* the scheduler stops the launch */
    }
    return ((unsigned int)(GCTWIN_WARP - width) << 8) | clamp;
}

template <class T> inline unsigned long long to_bits(T v)
{
    static_assert(sizeof(T) == 4 || sizeof(T) == 8, "shuffles move 32- or 64-bit values");
    unsigned long long b = 0;
    memcpy(&b, &v, sizeof v);
    return b;
}

template <class T> inline T from_bits(unsigned long long b)
{
    T v;
    memcpy(&v, &b, sizeof v);
    return v;
}

} // namespace gctwin

inline void __syncthreads(unsigned int line = __builtin_LINE())
{
    gctwin::block_barrier(gctwin::SYNC_PLAIN, 0, line);
}
inline int __syncthreads_count(int pred, unsigned int line = __builtin_LINE())
{
    return gctwin::block_barrier(gctwin::SYNC_COUNT, pred, line);
}
inline int __syncthreads_and(int pred, unsigned int line = __builtin_LINE())
{
    return gctwin::block_barrier(gctwin::SYNC_AND, pred, line);
}
inline int __syncthreads_or(int pred, unsigned int line = __builtin_LINE())
{
    return gctwin::block_barrier(gctwin::SYNC_OR, pred, line);
}

inline void __syncwarp(unsigned int mask = 0xffffffffu, unsigned int line = __builtin_LINE())
{
    gctwin::warp_op(gctwin::SYNCWARP, mask, 0, 0, 0, line);
}
inline unsigned int __ballot_sync(unsigned int mask, int pred,
                                  unsigned int line = __builtin_LINE())
{
    return (unsigned int)gctwin::warp_op(gctwin::BALLOT, mask, pred != 0, 0, 0, line);
}
inline int __any_sync(unsigned int mask, int pred, unsigned int line = __builtin_LINE())
{
    return gctwin::warp_op(gctwin::BALLOT, mask, pred != 0, 0, 0, line) != 0;
}
inline int __all_sync(unsigned int mask, int pred, unsigned int line = __builtin_LINE())
{
    return gctwin::warp_op(gctwin::BALLOT, mask, pred != 0, 0, 0, line) == mask;
}
/* The lanes of the caller's warp that have not exited (the twin has no
 * divergence inside a warp to report). */
inline unsigned int __activemask(void)
{
    const gctwin::warp &w = gctwin::g.warps[gctwin::g.cur->tid / GCTWIN_WARP];
    return w.present & ~w.exited;
}

/* The shuffles, for every 32- and 64-bit type CUDA overloads them for. */
#define GCTWIN_SHUFFLES(T)                                                                         \
    inline T __shfl_sync(unsigned int mask, T var, int src, int width = GCTWIN_WARP,               \
                         unsigned int line = __builtin_LINE())                                     \
    {                                                                                              \
        unsigned int c = gctwin::shfl_c(width, 31u, line);                                         \
        return gctwin::from_bits<T>(gctwin::warp_op(gctwin::SHFL_IDX, mask,                        \
                                                    gctwin::to_bits(var), (unsigned int)src, c,    \
                                                    line));                                        \
    }                                                                                              \
    inline T __shfl_up_sync(unsigned int mask, T var, unsigned int delta, int width = GCTWIN_WARP, \
                            unsigned int line = __builtin_LINE())                                  \
    {                                                                                              \
        unsigned int c = gctwin::shfl_c(width, 0u, line);                                          \
        return gctwin::from_bits<T>(                                                               \
            gctwin::warp_op(gctwin::SHFL_UP, mask, gctwin::to_bits(var), delta, c, line));         \
    }                                                                                              \
    inline T __shfl_down_sync(unsigned int mask, T var, unsigned int delta,                        \
                              int width = GCTWIN_WARP, unsigned int line = __builtin_LINE())       \
    {                                                                                              \
        unsigned int c = gctwin::shfl_c(width, 31u, line);                                         \
        return gctwin::from_bits<T>(                                                               \
            gctwin::warp_op(gctwin::SHFL_DOWN, mask, gctwin::to_bits(var), delta, c, line));       \
    }                                                                                              \
    inline T __shfl_xor_sync(unsigned int mask, T var, int lane_mask, int width = GCTWIN_WARP,     \
                             unsigned int line = __builtin_LINE())                                 \
    {                                                                                              \
        unsigned int c = gctwin::shfl_c(width, 31u, line);                                         \
        return gctwin::from_bits<T>(gctwin::warp_op(gctwin::SHFL_XOR, mask,                        \
                                                    gctwin::to_bits(var),                          \
                                                    (unsigned int)lane_mask, c, line));            \
    }
GCTWIN_SHUFFLES(int)
GCTWIN_SHUFFLES(unsigned int)
GCTWIN_SHUFFLES(long)
GCTWIN_SHUFFLES(unsigned long)
GCTWIN_SHUFFLES(long long)
GCTWIN_SHUFFLES(unsigned long long)
GCTWIN_SHUFFLES(float)
GCTWIN_SHUFFLES(double)

inline void __threadfence(void) {}
inline void __threadfence_block(void) {}
inline void __threadfence_system(void) {}

/* __trap(): the launch fails (a GPU reports an unspecified launch failure). */
inline void __trap(unsigned int line = __builtin_LINE())
{
    gctwin::fail("%s called __trap() at line %u", gctwin::who(gctwin::g.cur), line);
    gctwin::yield();
}

/* ---- scheduler -------------------------------------------------------------------------- */

namespace gctwin {

/* The source lane of lane `lane` in a shuffle by t (PTX shfl.sync), and in
 * *in_range whether it is in the segment (else the lane reads itself). */
static unsigned int shfl_source(const thread *t, unsigned int lane, int *in_range)
{
    unsigned int segmask = (t->cval >> 8) & 31u, clamp = t->cval & 31u;
    unsigned int max_lane = (lane & segmask) | (clamp & ~segmask);
    unsigned int min_lane = lane & segmask;
    unsigned int b = t->bval;
    int j;
    switch (t->op) {
    case SHFL_UP:
        j = (int)lane - (int)b;
        *in_range = j >= (int)max_lane;
        break;
    case SHFL_DOWN:
        j = (int)(lane + b);
        *in_range = j <= (int)max_lane;
        break;
    case SHFL_XOR:
        j = (int)(lane ^ b);
        *in_range = j <= (int)max_lane;
        break;
    default: /* SHFL_IDX */
        j = (int)(min_lane | (b & ~segmask));
        *in_range = j <= (int)max_lane;
        break;
    }
    return *in_range ? (unsigned int)j : lane;
}

/* Every lane of `mask` (warp w) has arrived at warp operation `lead`'s: exchange. */
static void complete_warp_op(unsigned int w, unsigned int mask, const thread *lead)
{
    unsigned int votes = 0;
    for (unsigned int l = 0; l < GCTWIN_WARP; ++l)
        if ((mask >> l & 1u) && lane_thread(w, l)->value)
            votes |= 1u << l;
    for (unsigned int l = 0; l < GCTWIN_WARP; ++l) {
        if (!(mask >> l & 1u))
            continue;
        thread *u = lane_thread(w, l);
        if (lead->op == BALLOT) {
            u->result = votes;
        } else if (lead->op == SYNCWARP) {
            u->result = 0;
        } else {
            int in_range;
            unsigned int j = shfl_source(u, l, &in_range);
            if (!(mask >> j & 1u)) {
                fail("%s (warp %u lane %u): %s at line %u reads lane %u, which its mask 0x%08x "
                     "does not name", who(u), w, l, warp_op_names[u->op], u->line, j, mask);
                return;
            }
            u->result = lane_thread(w, j)->value;
        }
    }
    for (unsigned int l = 0; l < GCTWIN_WARP; ++l)
        if (mask >> l & 1u)
            lane_thread(w, l)->state = READY;
    g.warps[w].waiting &= ~mask;
}

/* t just arrived at a warp operation: check it against its warp, and
 * complete the operation if it was the last lane named. */
static void arrive_warp(thread *t)
{
    unsigned int w = t->tid / GCTWIN_WARP, lane = t->tid % GCTWIN_WARP, bit = 1u << lane;
    warp *wp = &g.warps[w];
    const char *name = warp_op_names[t->op];
    if (!(t->mask & bit)) {
        fail("%s (warp %u lane %u): %s at line %u with mask 0x%08x, which does not name the "
             "calling lane", who(t), w, lane, name, t->line, t->mask);
        return;
    }
    if (t->mask & ~wp->present) {
        fail("%s (warp %u lane %u): %s at line %u with mask 0x%08x names lanes 0x%08x that "
             "are not in the block (%u threads)", who(t), w, lane, name, t->line, t->mask,
             t->mask & ~wp->present, g.nthreads);
        return;
    }
    if (t->mask & wp->exited) {
        fail("%s (warp %u lane %u): %s at line %u with mask 0x%08x names lane %d, which "
             "exited", who(t), w, lane, name, t->line, t->mask,
             __builtin_ctz(t->mask & wp->exited));
        return;
    }
    for (unsigned int l = 0; l < GCTWIN_WARP; ++l) {
        if (!(wp->waiting >> l & 1u))
            continue;
        const thread *u = lane_thread(w, l);
        int related = (u->mask & bit) || (t->mask >> l & 1u);
        if (related && (u->mask != t->mask || u->op != t->op || u->line != t->line ||
                        (u->op <= SHFL_XOR && u->cval != t->cval))) {
            fail("warp %u: lane %u waits at %s at line %u (mask 0x%08x, width %u) while lane "
                 "%u reaches %s at line %u (mask 0x%08x, width %u): the lanes of a warp "
                 "operation must make the same call with the same mask and width", w, l,
                 warp_op_names[u->op], u->line, u->mask, 32u - (u->cval >> 8), lane, name,
                 t->line, t->mask, 32u - (t->cval >> 8));
            return;
        }
    }
    wp->waiting |= bit;
    if ((wp->waiting & t->mask) == t->mask)
        complete_warp_op(w, t->mask, t);
}

/* t returned from the kernel. */
static void exit_thread(thread *t)
{
    unsigned int w = t->tid / GCTWIN_WARP, lane = t->tid % GCTWIN_WARP;
    warp *wp = &g.warps[w];
    wp->exited |= 1u << lane;
    for (unsigned int l = 0; l < GCTWIN_WARP; ++l) {
        const thread *u = lane_thread(w, l);
        if ((wp->waiting >> l & 1u) && (u->mask >> lane & 1u)) {
            fail("%s (warp %u lane %u) waits at %s at line %u with mask 0x%08x, which names "
                 "lane %u (%s), which exited", who(u), w, l, warp_op_names[u->op], u->line,
                 u->mask, lane, who(t));
            return;
        }
    }
}

/* No thread is ready and some are still waiting: release a complete
 * __syncthreads, or report why the block cannot go on. Returns 1 when
 * released. */
static int release_or_fail(unsigned int exited)
{
    const thread *sync = NULL, *other_sync = NULL, *shfl = NULL;
    unsigned int nsync = 0;
    for (unsigned int i = 0; i < g.nthreads; ++i) {
        const thread *t = &g.threads[i];
        if (t->state == AT_SYNC) {
            ++nsync;
            if (!sync)
                sync = t;
            else if (!other_sync && (t->line != sync->line || t->op != sync->op))
                other_sync = t;
        } else if (t->state == AT_WARP && !shfl) {
            shfl = t;
        }
    }
    if (shfl) {
        /* a warp operation waits for a lane that is at a __syncthreads */
        unsigned int w = shfl->tid / GCTWIN_WARP;
        unsigned int missing = shfl->mask & ~g.warps[w].waiting;
        int lane = missing ? __builtin_ctz(missing) : 0;
        const thread *m = lane_thread(w, (unsigned int)lane);
        if (m->state == AT_SYNC)
            fail("deadlock: %s (warp %u lane %u) waits at %s at line %u (mask 0x%08x) for lane "
                 "%d, which waits at %s at line %u", who(shfl), w, shfl->tid % GCTWIN_WARP,
                 warp_op_names[shfl->op], shfl->line, shfl->mask, lane, sync_names[m->op],
                 m->line);
        else
            fail("deadlock: %s (warp %u lane %u) waits at %s at line %u (mask 0x%08x) for lane "
                 "%d", who(shfl), w, shfl->tid % GCTWIN_WARP, warp_op_names[shfl->op],
                 shfl->line, shfl->mask, lane);
        return 0;
    }
    if (other_sync) {
        fail("barrier divergence: %s waits at %s at line %u while %s waits at %s at line %u",
             who(sync), sync_names[sync->op], sync->line, who(other_sync),
             sync_names[other_sync->op], other_sync->line);
        return 0;
    }
    if (exited) {
        const thread *gone = NULL;
        for (unsigned int i = 0; i < g.nthreads && !gone; ++i)
            if (g.threads[i].state == DONE)
                gone = &g.threads[i];
        fail("barrier divergence: %s at line %u is reached by %u of the block's %u threads; "
             "%u exited without reaching it (first: %s)", sync_names[sync->op], sync->line,
             nsync, g.nthreads, exited, who(gone));
        return 0;
    }
    /* every thread waits at the same __syncthreads: release it */
    unsigned long long count = 0;
    for (unsigned int i = 0; i < g.nthreads; ++i)
        count += g.threads[i].value;
    int result = sync->op == SYNC_COUNT ? (int)count
                 : sync->op == SYNC_AND ? count == g.nthreads
                 : sync->op == SYNC_OR  ? count != 0
                                        : 0;
    for (unsigned int i = 0; i < g.nthreads; ++i) {
        g.threads[i].result = (unsigned long long)result;
        g.threads[i].state = READY;
    }
    return 1;
}

extern "C" char __start_gctwin_shared[] __attribute__((visibility("hidden")));
extern "C" char __stop_gctwin_shared[] __attribute__((visibility("hidden")));
/* keeps the section (and so its bounds) in every module; referenced below
 * (not `used`: that marks the section "retain" and conflicts with the
 * kernels' variables) */
static char shared_anchor __attribute__((section("gctwin_shared")));

/* Run the current block to completion; 0, or 1 after fail(). */
static int run_block(const unsigned int *order)
{
    *(volatile char *)&shared_anchor = 0;
    memset(__start_gctwin_shared, 0xff, (size_t)(__stop_gctwin_shared - __start_gctwin_shared));
    unsigned int bx = g.block_dim.x, by = g.block_dim.y;
    for (unsigned int i = 0; i < g.nthreads; ++i) {
        thread *t = &g.threads[i];
        t->idx.x = i % bx;
        t->idx.y = i / bx % by;
        t->idx.z = i / (bx * by);
        t->tid = i;
        t->state = READY;
        t->started = 0;
        t->value = t->result = 0;
    }
    unsigned int nwarps = (g.nthreads + GCTWIN_WARP - 1) / GCTWIN_WARP;
    for (unsigned int w = 0; w < nwarps; ++w) {
        unsigned int lanes = g.nthreads - w * GCTWIN_WARP;
        g.warps[w].present = lanes >= GCTWIN_WARP ? 0xffffffffu : (1u << lanes) - 1u;
        g.warps[w].exited = g.warps[w].waiting = 0;
    }
    unsigned int live = g.nthreads, exited = 0;
    for (;;) {
        int ran = 0;
        for (unsigned int k = 0; k < g.nthreads; ++k) {
            thread *t = &g.threads[order[k]];
            if (t->state != READY)
                continue;
            ran = 1;
            resume(t);
            g.cur = NULL;
            if (!g.failed) {
                if (t->state == DONE) {
                    --live;
                    ++exited;
                    exit_thread(t);
                } else if (t->state == AT_WARP) {
                    arrive_warp(t);
                }
            }
            if (g.failed)
                return 1;
        }
        if (ran)
            continue;
        if (live == 0)
            return 0;
        if (!release_or_fail(exited))
            return 1;
    }
}

/* Stacks for n threads: one mapping, a guard page below each stack. */
static int ensure_stacks(unsigned int n)
{
    if (g.pool_slots >= n)
        return 0;
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    size_t stack = (GCTWIN_STACK + page - 1) / page * page;
    size_t slot = stack + page;
    if (g.pool)
        munmap(g.pool, g.slot_size * g.pool_slots);
    g.pool = NULL;
    g.pool_slots = 0;
    void *p = mmap(NULL, slot * n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS |
                   MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED)
        return -1;
    g.pool = (char *)p;
    g.pool_slots = n;
    g.slot_size = slot;
    for (unsigned int i = 0; i < n; ++i) {
        mprotect(g.pool + i * slot, page, PROT_NONE);
        g.threads[i].stack = g.pool + i * slot + page;
    }
    return 0;
}

/* Floating-point control for a launch: IEEE round-to-nearest, exceptions
 * masked, FTZ/DAZ as the module was compiled. Returns the caller's. */
static unsigned long long fp_enter(int ftz)
{
#if defined(__x86_64__)
    unsigned int old, want = 0x1f80u | (ftz ? 0x8040u : 0u);
    __asm__ volatile("stmxcsr %0" : "=m"(old));
    __asm__ volatile("ldmxcsr %0" : : "m"(want));
    return old;
#elif defined(__aarch64__)
    unsigned long long old;
    __asm__ volatile("mrs %0, fpcr" : "=r"(old));
    unsigned long long want = (old & ~((3ull << 22) | (1ull << 24))) | (ftz ? 1ull << 24 : 0);
    __asm__ volatile("msr fpcr, %0" : : "r"(want));
    return old;
#else
    (void)ftz; /* _kernels.py refuses -ftz=true on other machines */
    return 0;
#endif
}

static void fp_leave(unsigned long long old)
{
#if defined(__x86_64__)
    unsigned int csr = (unsigned int)old;
    __asm__ volatile("ldmxcsr %0" : : "m"(csr));
#elif defined(__aarch64__)
    __asm__ volatile("msr fpcr, %0" : : "r"(old));
#else
    (void)old;
#endif
}

} // namespace gctwin

/*
 * Run the whole grid of the kernel behind `call` (a gctwin_call_* wrapper)
 * with argument pointers `args` (cuLaunchKernel's kernelParams). grid and
 * block: 3 dimensions each, already validated by the caller. order 0 runs
 * each phase's threads in descending id order, 1 in ascending order. Returns
 * 0, or 1 with a message in err (errlen bytes).
 */
GCTWIN_EXPORT int gctwin_launch(void (*call)(void **), void **args, const unsigned int *grid,
                                const unsigned int *block, int order, char *err, size_t errlen)
{
    using namespace gctwin;
    if (g.active) {
        snprintf(err, errlen, "a launch of this module is already running (launches must not "
                              "overlap)");
        return 1;
    }
    unsigned int n = block[0] * block[1] * block[2];
    if (n == 0 || n > GCTWIN_MAX_THREADS) {
        snprintf(err, errlen, "%u threads per block (1 to %d)", n, GCTWIN_MAX_THREADS);
        return 1;
    }
    if (ensure_stacks(n)) {
        snprintf(err, errlen, "could not map stacks for %u threads", n);
        return 1;
    }
    static unsigned int ids[GCTWIN_MAX_THREADS];
    for (unsigned int k = 0; k < n; ++k)
        ids[k] = order == 1 ? k : n - 1 - k;
    g.active = 1;
    g.failed = 0;
    g.err[0] = 0;
    g.call = call;
    g.args = args;
    g.nthreads = n;
    g.block_dim = dim3(block[0], block[1], block[2]);
    g.grid_dim = dim3(grid[0], grid[1], grid[2]);
    g.ftz = module_ftz;
    unsigned long long fp = fp_enter(g.ftz);
    int rc = 0;
    for (unsigned int z = 0; z < grid[2] && !rc; ++z)
        for (unsigned int y = 0; y < grid[1] && !rc; ++y)
            for (unsigned int x = 0; x < grid[0] && !rc; ++x) {
                g.block_idx = make_uint3(x, y, z);
                rc = run_block(ids);
            }
    fp_leave(fp);
    g.active = 0;
    g.cur = NULL;
    if (rc)
        snprintf(err, errlen, "%s", g.err);
    return rc;
}

/* ---- arithmetic intrinsics ------------------------------------------------------------- */

namespace gctwin {

/* v, unknown to the optimizer: an operation on opaque operands whose result
 * is opaque too cannot be contracted with a neighbour. */
template <class T> inline T opaque(T v)
{
#if defined(__x86_64__)
    __asm__("" : "+x"(v));
#elif defined(__aarch64__)
    __asm__("" : "+w"(v));
#else
    volatile T w = v;
    v = w;
#endif
    return v;
}

enum { ADD, SUB, MUL, DIV, SQRT };

template <class T> inline T arith(int op, T a, T b)
{
    a = opaque(a);
    b = opaque(b);
    T r = op == ADD ? a + b : op == SUB ? a - b : op == MUL ? a * b : op == DIV ? a / b : sqrt(a);
    return opaque(r);
}

/* An fp64 operation with the host's flush-to-zero lifted (CUDA's -ftz is
 * fp32 only); the asm operands order the control-word writes around it. */
inline double arith64(int op, double a, double b)
{
    if (!g.ftz)
        return arith(op, a, b);
#if defined(__x86_64__)
    unsigned int old, ieee;
    __asm__ volatile("stmxcsr %0" : "=m"(old));
    ieee = old & ~0x8040u;
    __asm__ volatile("ldmxcsr %2" : "+x"(a), "+x"(b) : "m"(ieee));
    double r = op == ADD ? a + b : op == SUB ? a - b : op == MUL ? a * b : op == DIV ? a / b : sqrt(a);
    __asm__ volatile("ldmxcsr %1" : "+x"(r) : "m"(old));
    return r;
#elif defined(__aarch64__)
    unsigned long long old, ieee;
    __asm__ volatile("mrs %0, fpcr" : "=r"(old));
    ieee = old & ~(1ull << 24);
    __asm__ volatile("msr fpcr, %2" : "+w"(a), "+w"(b) : "r"(ieee));
    double r = op == ADD ? a + b : op == SUB ? a - b : op == MUL ? a * b : op == DIV ? a / b : sqrt(a);
    __asm__ volatile("msr fpcr, %1" : "+w"(r) : "r"(old));
    return r;
#else
    return arith(op, a, b);
#endif
}

} // namespace gctwin

/* CUDA's fp32: the f32 type that `float` names in a kernel unit (see the end of
 * this file), its operators, conversions, intrinsics and math functions. */
#include "cuda_twin_fp32.h"
GCTWIN_SHUFFLES(::gctwin::f32)
#undef GCTWIN_SHUFFLES

inline double __dadd_rn(double a, double b) { return gctwin::arith64(gctwin::ADD, a, b); }
inline double __dsub_rn(double a, double b) { return gctwin::arith64(gctwin::SUB, a, b); }
inline double __dmul_rn(double a, double b) { return gctwin::arith64(gctwin::MUL, a, b); }
inline double __ddiv_rn(double a, double b) { return gctwin::arith64(gctwin::DIV, a, b); }
inline double __drcp_rn(double a) { return gctwin::arith64(gctwin::DIV, 1.0, a); }
inline double __dsqrt_rn(double a) { return gctwin::arith64(gctwin::SQRT, a, 0.0); }
inline double __fma_rn(double a, double b, double c) { return fma(a, b, c); }

/* ---- bit casts and integer intrinsics ---------------------------------------------------- */

inline long long __double_as_longlong(double d) { return (long long)gctwin::to_bits(d); }
inline double __longlong_as_double(long long i)
{
    return gctwin::from_bits<double>((unsigned long long)i);
}
inline int __popc(unsigned int x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x ? __builtin_clz((unsigned int)x) : 32; }
inline int __clzll(long long x) { return x ? __builtin_clzll((unsigned long long)x) : 64; }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline unsigned int __brev(unsigned int x)
{
    unsigned int r = 0;
    for (int i = 0; i < 32; ++i, x >>= 1)
        r = (r << 1) | (x & 1u);
    return r;
}
inline unsigned int __umulhi(unsigned int a, unsigned int b)
{
    return (unsigned int)(((unsigned long long)a * b) >> 32);
}
inline unsigned long long __umul64hi(unsigned long long a, unsigned long long b)
{
    return (unsigned long long)(((unsigned __int128)a * b) >> 64);
}
template <class T> inline T __ldg(const T *p) { return *p; }
template <class T> inline T __ldca(const T *p) { return *p; }

/* CUDA's min/max overloads. */
#define GCTWIN_MINMAX(T)                                                                           \
    inline T min(T a, T b) { return a < b ? a : b; }                                               \
    inline T max(T a, T b) { return a > b ? a : b; }
GCTWIN_MINMAX(int)
GCTWIN_MINMAX(unsigned int)
GCTWIN_MINMAX(long)
GCTWIN_MINMAX(unsigned long)
GCTWIN_MINMAX(long long)
GCTWIN_MINMAX(unsigned long long)
#undef GCTWIN_MINMAX
inline gctwin::f32 min(float a, float b) { return gctwin::ptx_min(a, b); }
inline gctwin::f32 max(float a, float b) { return gctwin::ptx_max(a, b); }
inline double min(double a, double b) { return fmin(a, b); }
inline double max(double a, double b) { return fmax(a, b); }

/* ---- atomics ------------------------------------------------------------------------------ */
/* Threads are never preempted, so a plain read-modify-write is atomic. Each
 * returns the old value, as CUDA's do. */

#define GCTWIN_ATOMIC(NAME, T, EXPR)                                                               \
    inline T NAME(T *address, T val)                                                               \
    {                                                                                              \
        T old = *address;                                                                          \
        *address = (EXPR);                                                                         \
        return old;                                                                                \
    }
#define GCTWIN_ATOMIC_INT(T)                                                                       \
    GCTWIN_ATOMIC(atomicAdd, T, old + val)                                                         \
    GCTWIN_ATOMIC(atomicSub, T, old - val)                                                         \
    GCTWIN_ATOMIC(atomicExch, T, val)                                                              \
    GCTWIN_ATOMIC(atomicMin, T, val < old ? val : old)                                             \
    GCTWIN_ATOMIC(atomicMax, T, val > old ? val : old)                                             \
    GCTWIN_ATOMIC(atomicAnd, T, old & val)                                                         \
    GCTWIN_ATOMIC(atomicOr, T, old | val)                                                          \
    GCTWIN_ATOMIC(atomicXor, T, old ^ val)                                                         \
    inline T atomicCAS(T *address, T compare, T val)                                               \
    {                                                                                              \
        T old = *address;                                                                          \
        if (old == compare)                                                                        \
            *address = val;                                                                        \
        return old;                                                                                \
    }
GCTWIN_ATOMIC_INT(int)
GCTWIN_ATOMIC_INT(unsigned int)
GCTWIN_ATOMIC_INT(long long)
GCTWIN_ATOMIC_INT(unsigned long long)
#undef GCTWIN_ATOMIC_INT
GCTWIN_ATOMIC(atomicExch, float, val)
GCTWIN_ATOMIC(atomicExch, gctwin::f32, val)
GCTWIN_ATOMIC(atomicAdd, double, old + val)
GCTWIN_ATOMIC(atomicInc, unsigned int, old >= val ? 0u : old + 1u)
GCTWIN_ATOMIC(atomicDec, unsigned int, (old == 0u || old > val) ? val : old - 1u)
#undef GCTWIN_ATOMIC

/* atomicAdd on fp32 flushes subnormal inputs and results to zero on every GPU
 * (PTX atom.add.f32), whatever -ftz says. */
inline float gctwin_flush(float f) { return fabsf(f) < FLT_MIN ? copysignf(0.0f, f) : f; }
inline float atomicAdd(float *address, float val)
{
    float old = *address;
    *address = gctwin::canonical(gctwin_flush(gctwin_flush(old) + gctwin_flush(val)));
    return old;
}
inline gctwin::f32 atomicAdd(gctwin::f32 *address, gctwin::f32 val)
{
    return atomicAdd(&address->v, val.v);
}

/* ---- the kernel wrappers' helpers ------------------------------------------------------------ */

namespace gctwin {

template <unsigned int... I> struct seq {};
template <unsigned int N, unsigned int... I> struct make_seq : make_seq<N - 1, N - 1, I...> {};
template <unsigned int... I> struct make_seq<0, I...> {
    typedef seq<I...> type;
};

template <class... A, unsigned int... I>
inline void invoke_seq(void (*kernel)(A...), void **args, seq<I...>)
{
    kernel(*static_cast<typename std::remove_reference<A>::type *>(args[I])...);
}

/* Call `kernel` with the arguments that args[i] point to (cuLaunchKernel's convention). */
template <class... A> inline void invoke(void (*kernel)(A...), void **args)
{
    invoke_seq(kernel, args, typename make_seq<sizeof...(A)>::type());
}

/* The fundamental type a parameter resolves to (typedefs seen through). */
template <class T> struct type_name {
    static const char *get()
    {
        return std::is_pointer<T>::value ? "pointer"
               : std::is_enum<T>::value  ? "enum"
                                         : "struct";
    }
};
#define GCTWIN_TYPE_NAME(T, S)                                                                     \
    template <> struct type_name<T> {                                                              \
        static const char *get() { return S; }                                                     \
    };
GCTWIN_TYPE_NAME(void, "void")
GCTWIN_TYPE_NAME(bool, "bool")
GCTWIN_TYPE_NAME(char, std::is_signed<char>::value ? "char(signed)" : "char(unsigned)")
GCTWIN_TYPE_NAME(signed char, "signed char")
GCTWIN_TYPE_NAME(unsigned char, "unsigned char")
GCTWIN_TYPE_NAME(short, "short")
GCTWIN_TYPE_NAME(unsigned short, "unsigned short")
GCTWIN_TYPE_NAME(int, "int")
GCTWIN_TYPE_NAME(unsigned int, "unsigned int")
GCTWIN_TYPE_NAME(long, "long")
GCTWIN_TYPE_NAME(unsigned long, "unsigned long")
GCTWIN_TYPE_NAME(long long, "long long")
GCTWIN_TYPE_NAME(unsigned long long, "unsigned long long")
GCTWIN_TYPE_NAME(float, "float")
GCTWIN_TYPE_NAME(f32, "float")
GCTWIN_TYPE_NAME(double, "double")
#undef GCTWIN_TYPE_NAME

/* Append "P|c|float;" (pointer to const float) or "V|-|int;" for parameter type A. */
template <class A> inline void describe(char *buf, size_t cap)
{
    typedef typename std::remove_cv<A>::type V;
    typedef typename std::remove_pointer<V>::type P;
    size_t used = strlen(buf);
    if (std::is_pointer<V>::value)
        snprintf(buf + used, cap - used, "P|%c|%s;", std::is_const<P>::value ? 'c' : '-',
                 type_name<typename std::remove_cv<P>::type>::get());
    else
        snprintf(buf + used, cap - used, "V|%c|%s;", std::is_const<A>::value ? 'c' : '-',
                 type_name<V>::get());
}

/* The parameter types of `kernel`, as the compiler sees them (one entry each). */
template <class... A> inline const char *signature(void (*)(A...))
{
    static char buf[4096];
    buf[0] = 0;
    int each[] = {0, (describe<A>(buf, sizeof buf), 0)...};
    (void)each;
    return buf;
}

} // namespace gctwin

/* The unit's `float` is CUDA's fp32 (cuda_twin_fp32.h); last, so that no
 * header sees it. */
#define float ::gctwin::f32

#endif /* GCTWIN_CUDA_TWIN_H */
