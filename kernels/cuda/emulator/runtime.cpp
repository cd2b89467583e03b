/*
 * The CUDA emulator's runtime: cooperative fibers for a block's threads, the scheduler that
 * gives barriers, warp collectives and votes their semantics, the launch limits of a device,
 * and a small server that runs launches it reads from stdin (see __init__.py for the wire
 * format and why kernels run in this separate, sanitized process).
 *
 * Scheduling.  Blocks run one after another.  Inside a block, each thread is a fiber that runs
 * until it reaches a synchronisation point (__syncthreads, a warp collective) or returns; when
 * every thread is waiting, the waits that can complete do (a warp collective when every lane
 * of its mask has arrived at one with the same op and mask, a barrier when every thread that
 * has not exited has), and the next round begins.  A wait that can never complete (a lane of a
 * mask has exited, threads wait at different barriers, a barrier while lanes wait in a warp
 * collective) is reported as an error, where a GPU would hang or compute garbage.
 *
 * In the default order threads run in index order, each to its next synchronisation point.  With
 * a seed, the order of blocks, the order of threads in every round, and switches at atomics and
 * fences are drawn from it, so results that depend on an unsynchronised order change.
 *
 * Counting (built with CUDA_EMU_COUNTING, see counting() in __init__.py): ASan is told to call
 * __asan_load{1,2,4,8,16,N} / __asan_store* for every access instead of inlining its check; the
 * definitions below count each one whose address is inside one of the launch's tensor buffers
 * (global memory: shared memory, stacks and the runtime's own data are not), per running fiber,
 * and forward to ASan's own, so every access is still checked.
 */
#include "cuda_emu.h"
#include "cuda_emu_kernels.h"

#include <cxxabi.h>
#include <errno.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <typeinfo>
#include <unistd.h>

#include <algorithm>
#include <string>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define EMU_ASAN 1
#else
#define EMU_ASAN 0
#endif

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

/* ------------------------------------------------------------------ the emulated device */

static const unsigned kMaxThreadsPerBlock = 1024;
static const unsigned kMaxBlockDim[3] = {1024, 1024, 64};
static const unsigned long long kMaxGridDim[3] = {2147483647ull, 65535ull, 65535ull};
static const unsigned long long kMaxSharedPerBlock = 48 * 1024;  /* without an opt-in attribute */
static const size_t kStackSize = 256 * 1024;
static const size_t kGuard = 4096;

namespace cuda_emu {
ThreadState* current = nullptr;
uint3 block_idx = {0, 0, 0};
dim3 block_dim, grid_dim;
}  // namespace cuda_emu

namespace {

enum State { READY, AT_WARP, AT_BARRIER, DONE };

struct Fiber {
    void* sp = nullptr;
    char* stack = nullptr;  /* lowest usable byte (above the guard page) */
    cuda_emu::ThreadState ts;
    int linear = 0, warp = 0, lane = 0;
    int state = DONE;
    int op = 0, arg = 0, width = 32;
    unsigned mask = 0;
    unsigned long long value = 0, result = 0;
    const char* file = "";
    int line = 0;
    void* fake_stack = nullptr;
    /* global-memory accesses of this thread in the current block (CUDA_EMU_COUNTING) */
    unsigned long long loads = 0, load_bytes = 0, stores = 0, store_bytes = 0;
#if !defined(__x86_64__)
    ucontext_t ctx;
#endif
};

std::vector<Fiber> fibers;
int nthreads = 0, live = 0;
Fiber* running = nullptr;
void* sched_sp = nullptr;
#if !defined(__x86_64__)
ucontext_t sched_ctx;
#endif
const void* sched_stack_bottom = nullptr;
size_t sched_stack_size = 0;
void* sched_fake_stack = nullptr;
cuda_emu::BoundCall* call = nullptr;
std::string launch_error;
bool aborted = false;
unsigned long long rng = 0;  /* 0: the default order */

unsigned long long next_random() {  /* splitmix64 */
    unsigned long long z = (rng += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

std::string site(const char* file, int line) {
    const char* slash = strrchr(file, '/');
    return std::string(slash ? slash + 1 : file) + ":" + std::to_string(line);
}

std::string thread_name(const Fiber& f) {
    return "thread (" + std::to_string(f.ts.thread_idx.x) + "," + std::to_string(f.ts.thread_idx.y) + "," +
           std::to_string(f.ts.thread_idx.z) + ")";
}

std::string block_name() {
    return "block (" + std::to_string(cuda_emu::block_idx.x) + "," + std::to_string(cuda_emu::block_idx.y) +
           "," + std::to_string(cuda_emu::block_idx.z) + ")";
}

const char* op_name(int op) {
    switch (op) {
        case cuda_emu::WARP_SYNC: return "__syncwarp";
        case cuda_emu::SHFL_IDX: return "__shfl_sync";
        case cuda_emu::SHFL_UP: return "__shfl_up_sync";
        case cuda_emu::SHFL_DOWN: return "__shfl_down_sync";
        case cuda_emu::SHFL_XOR: return "__shfl_xor_sync";
        case cuda_emu::VOTE_ALL: return "__all_sync";
        case cuda_emu::VOTE_ANY: return "__any_sync";
        case cuda_emu::VOTE_BALLOT: return "__ballot_sync";
    }
    return "?";
}

const char* barrier_name(int op) {
    switch (op) {
        case cuda_emu::BAR_COUNT: return "__syncthreads_count";
        case cuda_emu::BAR_AND: return "__syncthreads_and";
        case cuda_emu::BAR_OR: return "__syncthreads_or";
    }
    return "__syncthreads";
}

/* ------------------------------------------------------------------ context switches */

#if defined(__x86_64__)
extern "C" void cuda_emu_switch(void** save_sp, void* load_sp);
extern "C" void cuda_emu_trampoline();
/* Callee-saved registers, MXCSR and the x87 control word: all a function call preserves. */
asm(R"(
    .text
    .globl cuda_emu_switch
    .type cuda_emu_switch,@function
cuda_emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size cuda_emu_switch, .-cuda_emu_switch

    .globl cuda_emu_trampoline
    .type cuda_emu_trampoline,@function
cuda_emu_trampoline:
    movq %r12, %rdi
    callq *%r13
    ud2
    .size cuda_emu_trampoline, .-cuda_emu_trampoline
)");
#endif

void fiber_main(Fiber* f);

#if !defined(__x86_64__)
void fiber_entry_ucontext(unsigned lo, unsigned hi) {
    fiber_main(reinterpret_cast<Fiber*>(((uintptr_t)hi << 32) | (uintptr_t)lo));
}
#endif

void init_fiber(Fiber& f) {
    if (f.stack == nullptr) {
        void* m = mmap(nullptr, kStackSize + kGuard, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                       -1, 0);
        if (m == MAP_FAILED) {
            fprintf(stderr, "cuda_emu: cannot map a fiber stack: %s\n", strerror(errno));
            abort();
        }
        mprotect(m, kGuard, PROT_NONE);  /* a stack overflow faults instead of corrupting */
        f.stack = static_cast<char*>(m) + kGuard;
    }
#if EMU_ASAN
    /* frames left by this stack's previous fiber (it never returns) must not poison the next */
    ASAN_UNPOISON_MEMORY_REGION(f.stack + kStackSize - 16384, 16384);
#endif
#if defined(__x86_64__)
    uintptr_t top = ((uintptr_t)(f.stack + kStackSize) - 64) & ~(uintptr_t)15;
    void** s = reinterpret_cast<void**>(top);
    unsigned int csr[2];
    asm volatile("stmxcsr %0" : "=m"(csr[0]));
    asm volatile("fnstcw %0" : "=m"(*reinterpret_cast<unsigned short*>(&csr[1])));
    csr[1] &= 0xFFFFu;
    s[-1] = reinterpret_cast<void*>(&cuda_emu_trampoline);
    s[-2] = nullptr;                                  /* rbp */
    s[-3] = nullptr;                                  /* rbx */
    s[-4] = &f;                                       /* r12: the argument */
    s[-5] = reinterpret_cast<void*>(&fiber_main);     /* r13: the entry */
    s[-6] = nullptr;                                  /* r14 */
    s[-7] = nullptr;                                  /* r15 */
    memcpy(&s[-8], csr, 8);
    f.sp = &s[-8];
#else
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack;
    f.ctx.uc_stack.ss_size = kStackSize;
    f.ctx.uc_link = nullptr;
    const uintptr_t p = reinterpret_cast<uintptr_t>(&f);
    makecontext(&f.ctx, (void (*)())fiber_entry_ucontext, 2, (unsigned)(p & 0xFFFFFFFFu), (unsigned)(p >> 32));
#endif
}

void resume(Fiber& f) {
    running = &f;
    cuda_emu::current = &f.ts;
#if EMU_ASAN
    __sanitizer_start_switch_fiber(&sched_fake_stack, f.stack, kStackSize);
#endif
#if defined(__x86_64__)
    cuda_emu_switch(&sched_sp, f.sp);
#else
    swapcontext(&sched_ctx, &f.ctx);
#endif
#if EMU_ASAN
    __sanitizer_finish_switch_fiber(sched_fake_stack, nullptr, nullptr);
#endif
    running = nullptr;
}

/* From a fiber back to the scheduler; `final`: the fiber is never resumed. */
void suspend(bool final) {
    Fiber* f = running;
#if EMU_ASAN
    __sanitizer_start_switch_fiber(final ? nullptr : &f->fake_stack, sched_stack_bottom, sched_stack_size);
#endif
#if defined(__x86_64__)
    cuda_emu_switch(&f->sp, sched_sp);
#else
    swapcontext(&f->ctx, &sched_ctx);
#endif
#if EMU_ASAN
    __sanitizer_finish_switch_fiber(f->fake_stack, &sched_stack_bottom, &sched_stack_size);
#endif
}

void fiber_main(Fiber* f) {
#if EMU_ASAN
    __sanitizer_finish_switch_fiber(nullptr, &sched_stack_bottom, &sched_stack_size);
#endif
    call->run();
    f->state = DONE;
    --live;
    suspend(true);
    __builtin_unreachable();
}

[[noreturn]] void fail_in_fiber(const std::string& what) {
    if (launch_error.empty()) launch_error = what;
    aborted = true;
    running->state = DONE;
    --live;
    suspend(true);
    __builtin_unreachable();
}

Fiber& self(const char* what) {
    if (running == nullptr) {
        fprintf(stderr, "cuda_emu: %s called outside a kernel\n", what);
        abort();
    }
    return *running;
}

/* ------------------------------------------------------------------ completing waits */

int warp_size_of(int warp) {
    const int first = warp * 32;
    return std::min(32, nthreads - first);
}

bool set_error(const std::string& s) {
    if (launch_error.empty()) launch_error = s;
    return false;
}

/* Tries to complete the warp collective lane `f` waits in; true when it did. */
bool complete_warp(Fiber& f) {
    const unsigned mask = f.mask;
    const int base = f.warp * 32, size = warp_size_of(f.warp);
    const std::string where = std::string(op_name(f.op)) + " at " + site(f.file, f.line) + " (" +
                              thread_name(f) + " of " + block_name() + ", lane " + std::to_string(f.lane) + ")";
    if (!(mask & (1u << f.lane))) return set_error(where + ": its mask leaves out the calling lane");
    if (size < 32 && (mask >> size) != 0)
        return set_error(where + ": mask 0x" + [&] { char b[16]; snprintf(b, sizeof b, "%08x", mask); return std::string(b); }() +
                         " names lanes that do not exist (this warp has " + std::to_string(size) + ")");
    for (int l = 0; l < size; ++l) {
        if (!(mask & (1u << l))) continue;
        Fiber& o = fibers[base + l];
        if (o.state == DONE)
            return set_error(where + ": lane " + std::to_string(l) + " of the mask has exited");
        if (o.state == AT_BARRIER) return false;  /* maybe a deadlock: decided by the caller */
        if (o.state != AT_WARP) return false;
        if (o.op != f.op || o.mask != mask || o.width != f.width)
            return set_error(where + ": lane " + std::to_string(l) + " waits in " + op_name(o.op) + " at " +
                             site(o.file, o.line) + " with another op, mask or width (divergent warp collectives)");
    }
    const int width = f.width;
    if (f.op >= cuda_emu::SHFL_IDX && f.op <= cuda_emu::SHFL_XOR && (width < 1 || width > 32 || (width & (width - 1))))
        return set_error(where + ": width " + std::to_string(width) + " is not a power of two in [1, 32]");
    unsigned ballot = 0;
    for (int l = 0; l < size; ++l)
        if ((mask & (1u << l)) && fibers[base + l].value) ballot |= 1u << l;
    for (int l = 0; l < size; ++l) {
        if (!(mask & (1u << l))) continue;
        Fiber& o = fibers[base + l];
        const int seg = (l / (width > 0 ? width : 1)) * width;
        int src = l;
        switch (f.op) {
            case cuda_emu::SHFL_IDX: src = seg + (o.arg & (width - 1)); break;
            case cuda_emu::SHFL_UP: src = l - o.arg < seg ? l : l - o.arg; break;
            case cuda_emu::SHFL_DOWN: src = l + o.arg >= seg + width ? l : l + o.arg; break;
            case cuda_emu::SHFL_XOR: src = l ^ o.arg; if (src < seg || src >= seg + width) src = l; break;
        }
        if (f.op >= cuda_emu::SHFL_IDX && f.op <= cuda_emu::SHFL_XOR) {
            if (src < 0 || src >= 32 || !(mask & (1u << src)))
                return set_error(std::string(op_name(f.op)) + " at " + site(f.file, f.line) + ": lane " +
                                 std::to_string(l) + " reads lane " + std::to_string(src) +
                                 ", which is not in the mask (an undefined value on a GPU)");
            o.result = fibers[base + src].value;
        } else if (f.op == cuda_emu::VOTE_ALL) {
            o.result = ballot == mask;
        } else if (f.op == cuda_emu::VOTE_ANY) {
            o.result = ballot != 0;
        } else if (f.op == cuda_emu::VOTE_BALLOT) {
            o.result = ballot;
        }
    }
    for (int l = 0; l < size; ++l)
        if (mask & (1u << l)) fibers[base + l].state = READY;
    return true;
}

bool complete_barrier() {
    Fiber* first = nullptr;
    int count = 0, waiting = 0;
    for (int i = 0; i < nthreads; ++i) {
        Fiber& f = fibers[i];
        if (f.state == DONE) continue;
        if (f.state != AT_BARRIER) return false;
        ++waiting;
        if (first == nullptr) first = &f;
        else if (f.op != first->op || f.line != first->line || strcmp(f.file, first->file) != 0)
            return set_error("threads of " + block_name() + " wait at different barriers: " + thread_name(*first) +
                             " at " + barrier_name(first->op) + " " + site(first->file, first->line) + ", " +
                             thread_name(f) + " at " + barrier_name(f.op) + " " + site(f.file, f.line) +
                             " (a __syncthreads in divergent code)");
        count += f.value != 0;
    }
    if (first == nullptr) return false;
    int result = 0;
    switch (first->op) {
        case cuda_emu::BAR_COUNT: result = count; break;
        case cuda_emu::BAR_AND: result = count == waiting; break;
        case cuda_emu::BAR_OR: result = count != 0; break;
    }
    for (int i = 0; i < nthreads; ++i)
        if (fibers[i].state == AT_BARRIER) { fibers[i].result = (unsigned long long)result; fibers[i].state = READY; }
    return true;
}

std::string describe_deadlock() {
    std::string s = "deadlock in " + block_name() + ": no waiting thread can continue;";
    int shown = 0;
    for (int i = 0; i < nthreads; ++i) {
        Fiber& f = fibers[i];
        if (f.state == DONE || f.state == READY) continue;
        if (shown++ == 4) { s += " ..."; break; }
        s += " " + thread_name(f) + " waits in " +
             (f.state == AT_BARRIER ? std::string(barrier_name(f.op)) : std::string(op_name(f.op))) + " at " +
             site(f.file, f.line) + ";";
    }
    int exited = 0;
    for (int i = 0; i < nthreads; ++i) exited += fibers[i].state == DONE;
    s += " " + std::to_string(exited) + " of " + std::to_string(nthreads) + " threads have exited";
    return s;
}

/* Runs one block to completion; false (and launch_error) when it failed. */
bool run_block() {
    live = nthreads;
    for (int i = 0; i < nthreads; ++i) {
        Fiber& f = fibers[i];
        init_fiber(f);
        f.state = READY;
        f.result = 0;
        f.loads = f.load_bytes = f.stores = f.store_bytes = 0;
    }
    std::vector<int> order(nthreads);
    for (int i = 0; i < nthreads; ++i) order[i] = i;
    for (;;) {
        if (rng) {
            for (int i = nthreads - 1; i > 0; --i) std::swap(order[i], order[next_random() % (unsigned long long)(i + 1)]);
        }
        for (int i : order) {
            if (fibers[i].state != READY) continue;
            resume(fibers[i]);
            if (aborted) return false;
        }
        if (live == 0) return true;
        bool woke = false, ready = false;
        for (int i = 0; i < nthreads; ++i) {
            if (fibers[i].state == AT_WARP && complete_warp(fibers[i])) woke = true;
            if (!launch_error.empty()) return false;
        }
        if (!woke && complete_barrier()) woke = true;
        if (!launch_error.empty()) return false;
        for (int i = 0; i < nthreads; ++i) ready = ready || fibers[i].state == READY;
        if (!ready) {
            launch_error = describe_deadlock();
            return false;
        }
    }
}

}  // namespace

/* ------------------------------------------------------------------ the kernels' side */

namespace cuda_emu {

unsigned long long warp_collective(int op, unsigned mask, unsigned long long value, int arg, int width,
                                   const char* file, int line) {
    Fiber& f = self(op_name(op));
    f.op = op;
    f.mask = mask;
    f.value = value;
    f.arg = arg;
    f.width = width;
    f.file = file;
    f.line = line;
    f.state = AT_WARP;
    suspend(false);
    return f.result;
}

int barrier(int op, int pred, const char* file, int line) {
    Fiber& f = self(barrier_name(op));
    f.op = op;
    f.value = (unsigned long long)pred;
    f.file = file;
    f.line = line;
    f.state = AT_BARRIER;
    suspend(false);
    return (int)f.result;
}

void interleave_point() {
    if (rng && running && (next_random() & 1)) suspend(false);  /* stays READY */
}

unsigned activemask() {
    Fiber& f = self("__activemask");
    unsigned m = 0;
    const int base = f.warp * 32, size = warp_size_of(f.warp);
    for (int l = 0; l < size; ++l)
        if (fibers[base + l].state != DONE) m |= 1u << l;
    return m;
}

void trap(const char* what, const char* file, int line) {
    fail_in_fiber(std::string(what) + " at " + site(file, line) + " in " + thread_name(self(what)) + " of " +
                  block_name());
}

const char* tag_name(int tag) {
    switch (tag) {
        case ARG_NULL: return "a null pointer";
        case ARG_PTR: return "a tensor";
        case ARG_I32: return "int32";
        case ARG_I64: return "int64";
        case ARG_U32: return "uint32";
        case ARG_U64: return "uint64";
        case ARG_F32: return "float32";
        case ARG_F64: return "float64";
        case ARG_BOOL: return "bool";
    }
    return "an unsupported type";
}

std::string demangle(const char* mangled) {
    int status = 0;
    char* d = abi::__cxa_demangle(mangled, nullptr, nullptr, &status);
    std::string s = status == 0 && d ? d : mangled;
    free(d);
    return s;
}

std::string type_mismatch(int index, const std::string& param, const Arg& a) {
    std::string got = a.tag == ARG_PTR ? std::string("a ") + a.dtype + " tensor" : tag_name(a.tag);
    return "parameter " + std::to_string(index) + " is `" + param + "`, the launch passes " + got;
}

}  // namespace cuda_emu

/* ------------------------------------------------------------------ counting */

#if defined(CUDA_EMU_COUNTING)
#include <dlfcn.h>

namespace {

/* Plain arrays and no calls below: these functions are not instrumented, and anything they
 * called that is (a std::vector's operator[] not inlined) would call back into them. */
const int kMaxCountedBuffers = 256;
struct Counting {
    int nbufs = 0;
    uintptr_t lo[kMaxCountedBuffers], hi[kMaxCountedBuffers];
    /* per buffer: bytes read, bytes written, loads, stores (all threads) */
    unsigned long long read[kMaxCountedBuffers], written[kMaxCountedBuffers];
    unsigned long long loads[kMaxCountedBuffers], stores[kMaxCountedBuffers];
    /* the busiest thread: most loads (ties: the first seen), and the most of each per thread */
    unsigned long long max_loads, max_load_bytes, max_stores, max_store_bytes;
    unsigned max_block[3], max_thread[3];
} counts;

__attribute__((no_sanitize_address)) inline void count_access(uintptr_t a, unsigned long long n, bool store) {
    Fiber* f = running;
    if (f == nullptr) return;  /* the scheduler, argument binding, copies: not the kernel */
    const int k = counts.nbufs;
    for (int i = 0; i < k; ++i) {
        if (a < counts.lo[i] || a >= counts.hi[i]) continue;
        if (store) {
            counts.written[i] += n;
            counts.stores[i] += 1;
            f->stores += 1;
            f->store_bytes += n;
        } else {
            counts.read[i] += n;
            counts.loads[i] += 1;
            f->loads += 1;
            f->load_bytes += n;
        }
        return;
    }
}

void counting_begin(const std::vector<uintptr_t>& lo, const std::vector<uintptr_t>& hi) {
    if ((int)lo.size() > kMaxCountedBuffers) {
        fprintf(stderr, "cuda_emu: a counted launch has more than %d buffers\n", kMaxCountedBuffers);
        abort();
    }
    memset(&counts, 0, sizeof counts);
    counts.nbufs = (int)lo.size();
    for (int i = 0; i < counts.nbufs; ++i) {
        counts.lo[i] = lo[i];
        counts.hi[i] = hi[i];
    }
}

/* After each block: its threads' counts against the launch's busiest so far. */
void counting_block_done() {
    for (int i = 0; i < nthreads; ++i) {
        const Fiber& f = fibers[i];
        if (f.loads > counts.max_loads) {
            counts.max_loads = f.loads;
            counts.max_block[0] = cuda_emu::block_idx.x;
            counts.max_block[1] = cuda_emu::block_idx.y;
            counts.max_block[2] = cuda_emu::block_idx.z;
            counts.max_thread[0] = f.ts.thread_idx.x;
            counts.max_thread[1] = f.ts.thread_idx.y;
            counts.max_thread[2] = f.ts.thread_idx.z;
        }
        counts.max_load_bytes = std::max(counts.max_load_bytes, f.load_bytes);
        counts.max_stores = std::max(counts.max_stores, f.stores);
        counts.max_store_bytes = std::max(counts.max_store_bytes, f.store_bytes);
    }
}

/* Reply: 10 u64 (max loads, max load bytes, max stores, max store bytes per thread; the block
 * and thread index of the thread with the most loads), then per buffer read, written, loads,
 * stores. */
std::vector<unsigned long long> counting_record() {
    std::vector<unsigned long long> r = {counts.max_loads, counts.max_load_bytes, counts.max_stores,
                                         counts.max_store_bytes};
    for (unsigned v : counts.max_block) r.push_back(v);
    for (unsigned v : counts.max_thread) r.push_back(v);
    for (int i = 0; i < counts.nbufs; ++i) {
        r.push_back(counts.read[i]);
        r.push_back(counts.written[i]);
        r.push_back(counts.loads[i]);
        r.push_back(counts.stores[i]);
    }
    return r;
}

typedef void (*AsanCheck)(uintptr_t);
typedef void (*AsanCheckN)(uintptr_t, uintptr_t);
AsanCheck real_load[5], real_store[5];  /* sizes 1, 2, 4, 8, 16 */
AsanCheckN real_loadN, real_storeN;

/* ASan's own checks (libasan, the next definition after this executable's), found before the
 * static constructors run instrumented code; not instrumented itself (its stores would call the
 * hooks before there is anything to forward to). */
__attribute__((constructor(101), no_sanitize_address)) void find_asan_checks() {
    const char* loads[5] = {"__asan_load1", "__asan_load2", "__asan_load4", "__asan_load8", "__asan_load16"};
    const char* stores[5] = {"__asan_store1", "__asan_store2", "__asan_store4", "__asan_store8", "__asan_store16"};
    for (int i = 0; i < 5; ++i) {
        real_load[i] = reinterpret_cast<AsanCheck>(dlsym(RTLD_NEXT, loads[i]));
        real_store[i] = reinterpret_cast<AsanCheck>(dlsym(RTLD_NEXT, stores[i]));
        if (!real_load[i] || !real_store[i]) {
            fprintf(stderr, "cuda_emu: the counting build found no %s in libasan\n", real_load[i] ? stores[i] : loads[i]);
            abort();
        }
    }
    real_loadN = reinterpret_cast<AsanCheckN>(dlsym(RTLD_NEXT, "__asan_loadN"));
    real_storeN = reinterpret_cast<AsanCheckN>(dlsym(RTLD_NEXT, "__asan_storeN"));
    if (!real_loadN || !real_storeN) {
        fprintf(stderr, "cuda_emu: the counting build found no __asan_loadN/__asan_storeN in libasan\n");
        abort();
    }
}

}  // namespace

namespace cuda_emu {
void count_store(const void* address, unsigned long long bytes) {
    count_access(reinterpret_cast<uintptr_t>(address), bytes, true);
}
}  // namespace cuda_emu

#define CUDA_EMU_COUNTED(I, N)                                                                   \
    extern "C" __attribute__((no_sanitize_address)) void __asan_load##N(uintptr_t a) {            \
        count_access(a, N, false);                                                                \
        real_load[I](a);                                                                          \
    }                                                                                             \
    extern "C" __attribute__((no_sanitize_address)) void __asan_store##N(uintptr_t a) {           \
        count_access(a, N, true);                                                                 \
        real_store[I](a);                                                                         \
    }
CUDA_EMU_COUNTED(0, 1)
CUDA_EMU_COUNTED(1, 2)
CUDA_EMU_COUNTED(2, 4)
CUDA_EMU_COUNTED(3, 8)
CUDA_EMU_COUNTED(4, 16)
extern "C" __attribute__((no_sanitize_address)) void __asan_loadN(uintptr_t a, uintptr_t n) {
    count_access(a, n, false);
    real_loadN(a, n);
}
extern "C" __attribute__((no_sanitize_address)) void __asan_storeN(uintptr_t a, uintptr_t n) {
    count_access(a, n, true);
    real_storeN(a, n);
}
#endif

/* ------------------------------------------------------------------ launches */

namespace {

std::string cuda_invalid(const std::string& why) { return "CUDA_ERROR_INVALID_VALUE: invalid argument (" + why + ")"; }

struct Buffer {
    unsigned char* base = nullptr;
    unsigned long long nbytes = 0;
    unsigned head = 0;
};

std::string launch(const cuda_emu::KernelEntry& k, const unsigned grid[3], const unsigned block[3],
                   unsigned long long shared, std::vector<cuda_emu::Arg>& args) {
    const char* axes = "xyz";
    unsigned long long threads = 1, blocks = 1;
    for (int d = 0; d < 3; ++d) {
        if (block[d] == 0 || block[d] > kMaxBlockDim[d])
            return cuda_invalid(std::string("blockDim.") + axes[d] + " = " + std::to_string(block[d]) +
                                ", the device allows 1.." + std::to_string(kMaxBlockDim[d]));
        if (grid[d] == 0 || grid[d] > kMaxGridDim[d])
            return cuda_invalid(std::string("gridDim.") + axes[d] + " = " + std::to_string(grid[d]) +
                                ", the device allows 1.." + std::to_string(kMaxGridDim[d]));
        threads *= block[d];
        blocks *= grid[d];
    }
    if (threads > kMaxThreadsPerBlock)
        return cuda_invalid(std::to_string(threads) + " threads per block, the device allows " +
                            std::to_string(kMaxThreadsPerBlock));
    if (shared > kMaxSharedPerBlock || shared > cuda_emu_dynamic_shared_capacity)
        return cuda_invalid(std::to_string(shared) + " bytes of dynamic shared memory per block, the device allows " +
                            std::to_string(kMaxSharedPerBlock));
    std::string err;
    std::unique_ptr<cuda_emu::BoundCall> bound = k.bind(args, err);
    if (!bound) return std::string("kernel ") + k.name + ": " + err;

    cuda_emu::block_dim = dim3(block[0], block[1], block[2]);
    cuda_emu::grid_dim = dim3(grid[0], grid[1], grid[2]);
    nthreads = (int)threads;
    if ((int)fibers.size() < nthreads) fibers.resize(nthreads);
    for (int i = 0; i < nthreads; ++i) {
        Fiber& f = fibers[i];
        f.linear = i;
        f.warp = i / 32;
        f.lane = i % 32;
        f.ts.thread_idx = {(unsigned)(i % block[0]), (unsigned)((i / block[0]) % block[1]),
                           (unsigned)(i / (block[0] * block[1]))};
    }
    call = bound.get();
    launch_error.clear();
    aborted = false;
#if EMU_ASAN
    /* bytes past the launch's dynamic shared memory are out of bounds */
    ASAN_UNPOISON_MEMORY_REGION(cuda_emu_dynamic_shared, cuda_emu_dynamic_shared_capacity);
    ASAN_POISON_MEMORY_REGION(cuda_emu_dynamic_shared + shared, cuda_emu_dynamic_shared_capacity - shared);
#endif
    /* blocks in an order drawn from the seed: i -> (a*i + c) mod n with gcd(a, n) = 1 */
    unsigned long long a = 1, c = 0;
    if (rng && blocks > 1) {
        c = next_random() % blocks;
        do a = next_random() % blocks; while (a == 0 || std::__gcd(a, blocks) != 1);
    }
    bool ok = true;
    for (unsigned long long i = 0; i < blocks && ok; ++i) {
        const unsigned long long b = (unsigned long long)(((unsigned __int128)a * i + c) % blocks);
        cuda_emu::block_idx = {(unsigned)(b % grid[0]), (unsigned)((b / grid[0]) % grid[1]),
                               (unsigned)(b / ((unsigned long long)grid[0] * grid[1]))};
        /* shared memory starts each block as garbage (NaN as floats, -1 as integers), as
         * uninitialised memory does, so a read before any write shows */
        memset(cuda_emu_dynamic_shared, 0xFF, shared);
        ok = run_block();
#if defined(CUDA_EMU_COUNTING)
        if (ok) counting_block_done();
#endif
    }
    call = nullptr;
    cuda_emu::current = nullptr;
    if (!ok) {
#if EMU_ASAN
        for (Fiber& f : fibers)  /* abandoned fibers leave poisoned frames everywhere */
            if (f.stack) ASAN_UNPOISON_MEMORY_REGION(f.stack, kStackSize);
#endif
        return std::string("kernel ") + k.name + ": " + launch_error;
    }
    return "";
}

/* ------------------------------------------------------------------ the server */

int in_fd = 0, out_fd = 1;

bool read_all(void* p, size_t n) {
    char* c = static_cast<char*>(p);
    while (n) {
        const ssize_t r = read(in_fd, c, n);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return false;
        c += r;
        n -= (size_t)r;
    }
    return true;
}

void write_all(const void* p, size_t n) {
    const char* c = static_cast<const char*>(p);
    while (n) {
        const ssize_t r = write(out_fd, c, n);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) _exit(3);
        c += r;
        n -= (size_t)r;
    }
}

template <typename T> T get() {
    T v;
    if (!read_all(&v, sizeof v)) _exit(0);  /* the client went away */
    return v;
}

std::string get_string() {
    const unsigned n = get<unsigned>();
    std::string s(n, '\0');
    if (n && !read_all(&s[0], n)) _exit(0);
    return s;
}

void reply(unsigned status, const std::string& msg) {
    write_all(&status, 4);
    const unsigned n = (unsigned)msg.size();
    write_all(&n, 4);
    write_all(msg.data(), n);
}

}  // namespace

int main() {
    /* kernels' printf goes to stderr; the protocol keeps stdout for itself */
    out_fd = dup(1);
    dup2(2, 1);
    int count = 0;
    const cuda_emu::KernelEntry* table = cuda_emu_kernel_table(&count);
    for (;;) {
        const unsigned op = get<unsigned>();
        if (op == 0) return 0;
        if (op == 2) {  /* list the kernels */
            std::string names;
            for (int i = 0; i < count; ++i) names += std::string(table[i].name) + "\n";
            reply(0, names);
            continue;
        }
        const std::string name = get_string();
        unsigned grid[3], block[3];
        for (unsigned& g : grid) g = get<unsigned>();
        for (unsigned& b : block) b = get<unsigned>();
        const unsigned long long shared = get<unsigned long long>();
        rng = get<unsigned long long>();
        std::vector<Buffer> bufs(get<unsigned>());
        for (Buffer& b : bufs) {
            b.nbytes = get<unsigned long long>();
            b.head = get<unsigned>();
            /* exactly the tensor's bytes, placed at its offset within a 256-byte aligned
             * allocation (a CUDA allocation's alignment); the sanitizer's redzones follow */
            void* p = nullptr;
            if (posix_memalign(&p, 256, b.head + b.nbytes + (b.head + b.nbytes == 0)) != 0) {
                fprintf(stderr, "cuda_emu: out of memory for a %llu-byte argument\n", b.nbytes);
                abort();
            }
            b.base = static_cast<unsigned char*>(p);
            if (!read_all(b.base + b.head, b.nbytes)) _exit(0);
#if EMU_ASAN
            ASAN_POISON_MEMORY_REGION(b.base, b.head & ~7u);
#endif
        }
        std::vector<std::string> dtypes;
        const unsigned nargs = get<unsigned>();
        std::vector<cuda_emu::Arg> args(nargs);
        dtypes.reserve(nargs);
        std::string bad;
        for (cuda_emu::Arg& a : args) {
            a.tag = (int)get<unsigned>();
            a.kind = (int)get<unsigned>();
            a.elem_size = (int)get<unsigned>();
            const unsigned buf = get<unsigned>();
            const unsigned long long v = get<unsigned long long>();
            dtypes.push_back(get_string());
            a.bits = v;
            a.ptr = nullptr;
            if (a.tag == cuda_emu::ARG_PTR) {
                if (buf >= bufs.size()) { bad = "argument names a missing buffer"; continue; }
                a.ptr = bufs[buf].base + bufs[buf].head + v;
            }
        }
        for (size_t i = 0; i < args.size(); ++i) args[i].dtype = dtypes[i].c_str();
        const cuda_emu::KernelEntry* k = nullptr;
        for (int i = 0; i < count; ++i)
            if (name == table[i].name) k = &table[i];
        std::string err = bad;
        if (err.empty() && k == nullptr) {
            err = "CUDA_ERROR_NOT_FOUND: named symbol not found (no kernel " + name + " in this source; it has:";
            for (int i = 0; i < count; ++i) err += std::string(" ") + table[i].name;
            err += ")";
        }
#if defined(CUDA_EMU_COUNTING)
        {
            std::vector<uintptr_t> lo, hi;
            for (Buffer& b : bufs) {
                lo.push_back(reinterpret_cast<uintptr_t>(b.base + b.head));
                hi.push_back(reinterpret_cast<uintptr_t>(b.base + b.head + b.nbytes));
            }
            counting_begin(lo, hi);
        }
#endif
        if (err.empty()) err = launch(*k, grid, block, shared, args);
        reply(err.empty() ? 0 : 1, err);
        if (err.empty()) {
            for (Buffer& b : bufs) write_all(b.base + b.head, b.nbytes);
#if defined(CUDA_EMU_COUNTING)
            const std::vector<unsigned long long> record = counting_record();
            write_all(record.data(), record.size() * sizeof(unsigned long long));
#endif
        }
        for (Buffer& b : bufs) {
#if EMU_ASAN
            ASAN_UNPOISON_MEMORY_REGION(b.base, b.head);
#endif
            free(b.base);
        }
    }
}
