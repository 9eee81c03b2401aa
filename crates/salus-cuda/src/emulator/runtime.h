// The CUDA built-ins the kernels use, defined for the host, so the kernels' own source runs
// on a CPU (`emulator`). One launch runs its blocks one after another. A block's threads
// are fibers on the calling thread: `__syncthreads` and the warp shuffles switch to the
// next fiber, and a barrier lets its fibers go when every live thread of the block (or
// warp) has reached it. A kernel whose first block never waits runs its other blocks as
// plain calls, thread after thread; if one of those waits after all, the launch fails.
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#if !defined(__x86_64__)
#include <ucontext.h>
#endif

#define __global__
#define __device__
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
struct dim3 { unsigned x, y, z; };
struct uint4 { unsigned x, y, z, w; };
struct float4 { float x, y, z, w; };
static dim3 blockIdx, threadIdx, blockDim, gridDim;

template <class To, class From> static To emu_bits(From v) {
    To out;
    std::memcpy(&out, &v, sizeof out);
    return out;
}
static float __uint_as_float(unsigned v) { return emu_bits<float>(v); }
static unsigned __float_as_uint(float v) { return emu_bits<unsigned>(v); }
static float __int_as_float(int v) { return emu_bits<float>(v); }
static double __longlong_as_double(long long v) { return emu_bits<double>(v); }
static unsigned __float2uint_rn(float v) { return (unsigned)std::nearbyint(v); }

static float atomicAdd(float* p, float v) {
    float old = *p;
    *p = old + v;
    return old;
}
static unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
    unsigned long long old = *p;
    *p = old + v;
    return old;
}
static int atomicAdd(int* p, int v) {
    int old = *p;
    *p = old + v;
    return old;
}
template <class T> static T emu_cas(T* p, T expected, T desired) {
    T old = *p;
    if (old == expected) *p = desired;
    return old;
}
static unsigned atomicCAS(unsigned* p, unsigned e, unsigned d) { return emu_cas(p, e, d); }
static unsigned long long atomicCAS(unsigned long long* p, unsigned long long e,
                                    unsigned long long d) {
    return emu_cas(p, e, d);
}
static void __threadfence() {}

using std::atan; using std::atan2; using std::ceil; using std::cos; using std::erf; using std::erfc; using std::exp; using std::expm1; using std::fabs;
using std::floor; using std::fmax; using std::fmin; using std::fmod; using std::isnan; using std::lgamma; using std::log; using std::log1p;
using std::pow; using std::rint; using std::sin; using std::sqrt; using std::tan; using std::tanh; using std::trunc;

// ---------------------------------------------------------------------------------------
// Fibers.

enum EmuState { EMU_READY, EMU_BLOCK_WAIT, EMU_WARP_WAIT, EMU_DONE };
static const unsigned EMU_MAX_THREADS = 1024;
static const size_t EMU_STACK = 128 * 1024;

static void (*emu_kernel)(const void*);
static const void* emu_args;
static EmuState emu_state[EMU_MAX_THREADS];
static char* emu_stacks;
static unsigned emu_current;
static bool emu_fibers;   // the block runs as fibers (else: plain calls)
static bool emu_waited;   // some thread of the block waited
static bool emu_broken;   // a plain call waited, or the block deadlocked
static double emu_slots[EMU_MAX_THREADS];

static void emu_fiber();

#if defined(__x86_64__)
// A switch saves the callee-saved registers on the running stack, stores its pointer in
// `*from` and continues on `to` (a stack saved the same way, or a new one from
// `emu_start`): a few instructions, where swapcontext also makes a system call.
extern "C" void emu_switch(void** from, void* to);
asm(R"(
    .text
    .hidden emu_switch
    .globl emu_switch
    .type emu_switch, @function
emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size emu_switch, .-emu_switch
)");
static void* emu_main;
static void* emu_sp[EMU_MAX_THREADS];

// A new stack for thread `t` whose first switch enters `emu_fiber` as if called.
static void emu_start(unsigned t) {
    char* top = emu_stacks + (size_t)(t + 1) * EMU_STACK;
    void** sp = (void**)((uintptr_t)top & ~(uintptr_t)15);
    *--sp = nullptr;                   // emu_fiber's return address (it never returns)
    *--sp = (void*)&emu_fiber;         // where the switch's `ret` goes
    for (int r = 0; r < 6; r++) *--sp = nullptr;  // rbp, rbx, r12-r15
    emu_sp[t] = sp;
}
static void emu_to_main(unsigned t) { emu_switch(&emu_sp[t], emu_main); }
static void emu_to_fiber(unsigned t) { emu_switch(&emu_main, emu_sp[t]); }
#else
static ucontext_t emu_main;
static ucontext_t emu_ctx[EMU_MAX_THREADS];
static void emu_start(unsigned t) {
    getcontext(&emu_ctx[t]);
    emu_ctx[t].uc_stack.ss_sp = emu_stacks + (size_t)t * EMU_STACK;
    emu_ctx[t].uc_stack.ss_size = EMU_STACK;
    emu_ctx[t].uc_link = nullptr;
    makecontext(&emu_ctx[t], emu_fiber, 0);
}
static void emu_to_main(unsigned t) { swapcontext(&emu_ctx[t], &emu_main); }
static void emu_to_fiber(unsigned t) { swapcontext(&emu_main, &emu_ctx[t]); }
#endif

static void emu_wait(EmuState why) {
    if (!emu_fibers) {
        emu_broken = true;
        return;
    }
    emu_waited = true;
    emu_state[emu_current] = why;
    emu_to_main(emu_current);
}

static void __syncthreads() { emu_wait(EMU_BLOCK_WAIT); }

// Every thread of a warp stores its value, waits for the warp, reads `src`'s, and waits
// again, so no slot is overwritten before the warp has read it.
static double emu_exchange(double v, unsigned src) {
    if (!emu_fibers) {
        emu_broken = true;
        return v;
    }
    unsigned me = threadIdx.x;
    emu_slots[me] = v;
    emu_wait(EMU_WARP_WAIT);
    unsigned from = (me & ~31u) | (src & 31u);
    double out = from < blockDim.x ? emu_slots[from] : v;
    emu_wait(EMU_WARP_WAIT);
    return out;
}
static float __shfl_xor_sync(unsigned, float v, int mask) {
    return (float)emu_exchange(v, (threadIdx.x & 31u) ^ (unsigned)mask);
}
static double __shfl_xor_sync(unsigned, double v, int mask) {
    return emu_exchange(v, (threadIdx.x & 31u) ^ (unsigned)mask);
}
static float __shfl_sync(unsigned, float v, int src) { return (float)emu_exchange(v, src); }

static void emu_fiber() {
    emu_kernel(emu_args);
    emu_state[emu_current] = EMU_DONE;
    emu_to_main(emu_current);
}

// Runs one block as fibers; false on a deadlock (a barrier some live thread never reaches).
static bool emu_block_fibers() {
    unsigned n = blockDim.x;
    for (unsigned t = 0; t < n; t++) {
        emu_start(t);
        emu_state[t] = EMU_READY;
    }
    for (;;) {
        bool ran = false;
        for (unsigned t = 0; t < n; t++) {
            if (emu_state[t] != EMU_READY) continue;
            ran = true;
            emu_current = t;
            threadIdx = dim3{t, 0, 0};
            emu_to_fiber(t);
        }
        // Nothing is ready: release each warp whose live threads all wait at a shuffle,
        // else the block if all its live threads wait at `__syncthreads`.
        bool released = false;
        for (unsigned w = 0; w < n; w += 32) {
            unsigned end = w + 32 < n ? w + 32 : n;
            bool all = true, any = false;
            for (unsigned t = w; t < end; t++) {
                if (emu_state[t] == EMU_DONE) continue;
                any = true;
                all = all && emu_state[t] == EMU_WARP_WAIT;
            }
            if (any && all) {
                for (unsigned t = w; t < end; t++)
                    if (emu_state[t] == EMU_WARP_WAIT) emu_state[t] = EMU_READY;
                released = true;
            }
        }
        if (released) continue;
        bool all = true, any = false;
        for (unsigned t = 0; t < n; t++) {
            if (emu_state[t] == EMU_DONE) continue;
            any = true;
            all = all && emu_state[t] == EMU_BLOCK_WAIT;
        }
        if (!any) return true;
        if (!all && !ran) return false;
        if (all)
            for (unsigned t = 0; t < n; t++)
                if (emu_state[t] == EMU_BLOCK_WAIT) emu_state[t] = EMU_READY;
    }
}

// Runs a grid of `gx` x `gy` blocks of `bx` threads. 0: ran; 1: a thread waited where the
// launch ran plain calls; 2: a block deadlocked; 3: too many threads or no memory.
static int emu_launch(void (*kernel)(const void*), const void* args, unsigned gx, unsigned gy,
                      unsigned bx) {
    if (bx == 0 || bx > EMU_MAX_THREADS) return 3;
    if (!emu_stacks) emu_stacks = (char*)std::malloc(EMU_MAX_THREADS * EMU_STACK);
    if (!emu_stacks) return 3;
    emu_kernel = kernel;
    emu_args = args;
    gx = gx ? gx : 1;
    gy = gy ? gy : 1;
    blockDim = dim3{bx, 1, 1};
    gridDim = dim3{gx, gy, 1};
    emu_waited = false;
    emu_broken = false;
    bool fibers = true;
    for (unsigned by = 0; by < gy; by++) {
        for (unsigned b = 0; b < gx; b++) {
            blockIdx = dim3{b, by, 0};
            emu_fibers = fibers;
            if (fibers) {
                if (!emu_block_fibers()) return 2;
                fibers = emu_waited;
            } else {
                for (unsigned t = 0; t < bx; t++) {
                    threadIdx = dim3{t, 0, 0};
                    kernel(args);
                }
                if (emu_broken) return 1;
            }
        }
    }
    return 0;
}

// Zeroes `bytes` at `p` (cuMemsetD8).
extern "C" void emu_zero(void* p, unsigned long long bytes) { std::memset(p, 0, bytes); }
