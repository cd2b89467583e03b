/* bf16 <-> fp32 one value at a time, to nearest: for every C kernel that reads or writes bf16
 * (interaction.c, linear.c, the TBE kernels; vec.h's 16-lane forms round the same way).
 * A bf16 is the top half of an fp32: widening is a shift; narrowing rounds to nearest even, as
 * `tensor.to(torch.bfloat16)` does, bit for bit but for NaN: a NaN keeps its sign and the top of
 * its payload with the quiet bit set (fp32 0x7FC00000 -> 0x7FC0), where torch writes 0xFFFF.
 * native.py hashes this header with each source that includes it. */
#ifndef RECC_BF16_H
#define RECC_BF16_H

#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

#endif
