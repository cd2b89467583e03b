/*
 * The registry a generated shim fills: for each kernel of one .cu source, its name and a
 * function that checks a launch's arguments against the kernel's C parameter types and binds
 * them (see runtime.cpp for the wire format of arguments).
 */
#pragma once

#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <typeinfo>
#include <utility>
#include <vector>

namespace cuda_emu {

enum ArgTag : int { ARG_NULL = 0, ARG_PTR = 1, ARG_I32 = 2, ARG_I64 = 3, ARG_U32 = 4, ARG_U64 = 5,
                    ARG_F32 = 6, ARG_F64 = 7, ARG_BOOL = 8 };
/* Element kinds of a tensor argument: what the pointer parameter may point to. */
enum ElemKind : int { KIND_FLOAT = 0, KIND_INT = 1, KIND_BOOL = 2, KIND_BF16 = 3, KIND_BYTES = 4 };

struct Arg {
    int tag;
    unsigned long long bits;  /* scalars */
    void* ptr;                /* ARG_PTR */
    int kind, elem_size;      /* ARG_PTR: the tensor's dtype */
    const char* dtype;        /* its name, for messages */
};

struct BoundCall {
    virtual void run() = 0;
    virtual ~BoundCall() = default;
};

const char* tag_name(int tag);

template <typename T> struct ElemTraits {  /* kind, size; -1: any tensor may back it */
    static constexpr int kind = std::is_floating_point<T>::value ? KIND_FLOAT
                              : std::is_same<T, bool>::value     ? KIND_BOOL
                              : std::is_integral<T>::value       ? KIND_INT : -1;
    static constexpr int size = sizeof(T);
};
template <> struct ElemTraits<void> { static constexpr int kind = -1, size = 1; };
template <> struct ElemTraits<__half> { static constexpr int kind = KIND_FLOAT, size = 2; };
template <> struct ElemTraits<__half2> { static constexpr int kind = KIND_FLOAT, size = 2; };
template <> struct ElemTraits<__nv_bfloat16> { static constexpr int kind = KIND_BF16, size = 2; };
template <> struct ElemTraits<__nv_bfloat162> { static constexpr int kind = KIND_BF16, size = 2; };
template <> struct ElemTraits<float2> { static constexpr int kind = KIND_FLOAT, size = 4; };
template <> struct ElemTraits<float4> { static constexpr int kind = KIND_FLOAT, size = 4; };
template <> struct ElemTraits<uint2> { static constexpr int kind = KIND_INT, size = 4; };
template <> struct ElemTraits<uint4> { static constexpr int kind = KIND_INT, size = 4; };
template <> struct ElemTraits<int2> { static constexpr int kind = KIND_INT, size = 4; };
template <> struct ElemTraits<int4> { static constexpr int kind = KIND_INT, size = 4; };

std::string demangle(const char* mangled);
std::string type_mismatch(int index, const std::string& param, const Arg& a);

template <typename A>
A bind_arg(const Arg& a, int index, std::string& err) {
    if (!err.empty()) return A{};
    if constexpr (std::is_pointer<A>::value) {
        using E = std::remove_cv_t<std::remove_pointer_t<A>>;
        if (a.tag == ARG_NULL) return nullptr;
        if (a.tag != ARG_PTR) {
            err = type_mismatch(index, demangle(typeid(A).name()), a);
            return nullptr;
        }
        /* A tensor of another element type would be read with the wrong width on a GPU;
         * int64/uint64 (and int32/uint32) share bits, and a uint8 tensor is raw bytes. */
        constexpr int kind = ElemTraits<E>::kind, size = ElemTraits<E>::size;
        if (kind >= 0 && a.kind != KIND_BYTES && (a.kind != kind || a.elem_size != size))
            err = type_mismatch(index, demangle(typeid(A).name()), a);
        return static_cast<A>(a.ptr);
    } else {
        int want;
        if (std::is_same<A, bool>::value) want = ARG_BOOL;
        else if (std::is_same<A, float>::value) want = ARG_F32;
        else if (std::is_same<A, double>::value) want = ARG_F64;
        else if (std::is_integral<A>::value && sizeof(A) == 4) want = std::is_signed<A>::value ? ARG_I32 : ARG_U32;
        else if (std::is_integral<A>::value && sizeof(A) == 8) want = std::is_signed<A>::value ? ARG_I64 : ARG_U64;
        else want = -1;
        if (a.tag != want) {
            err = type_mismatch(index, demangle(typeid(A).name()), a);
            return A{};
        }
        A v;
        memcpy(&v, &a.bits, sizeof(A));
        return v;
    }
}

template <typename... P>
struct Call final : BoundCall {
    void (*fn)(P...);
    std::tuple<P...> args;
    void run() override { std::apply(fn, args); }
};

template <typename... P, size_t... I>
std::unique_ptr<BoundCall> bind_impl(void (*fn)(P...), const std::vector<Arg>& in, std::string& err,
                                     std::index_sequence<I...>) {
    auto c = std::make_unique<Call<P...>>();
    c->fn = fn;
    c->args = std::tuple<P...>{bind_arg<P>(in[I], (int)I, err)...};
    if (!err.empty()) return nullptr;
    return c;
}

template <typename... P>
std::unique_ptr<BoundCall> bind(void (*fn)(P...), const std::vector<Arg>& in, std::string& err) {
    if (in.size() != sizeof...(P)) {
        err = "takes " + std::to_string(sizeof...(P)) + " arguments, the launch passes " +
              std::to_string(in.size());
        return nullptr;
    }
    return bind_impl(fn, in, err, std::index_sequence_for<P...>{});
}

struct KernelEntry {
    const char* name;
    std::unique_ptr<BoundCall> (*bind)(const std::vector<Arg>&, std::string&);
};

}  // namespace cuda_emu

#define CUDA_EMU_KERNEL(NAME) \
    {#NAME, [](const std::vector<::cuda_emu::Arg>& a, std::string& e) { return ::cuda_emu::bind(&NAME, a, e); }}

/* Defined by the shim: the kernels of its source. */
extern "C" const ::cuda_emu::KernelEntry* cuda_emu_kernel_table(int* count);
/* Defined by the shim for a source with `extern __shared__` arrays (which alias it). */
extern "C" unsigned char cuda_emu_dynamic_shared[];
extern "C" const unsigned long long cuda_emu_dynamic_shared_capacity;
