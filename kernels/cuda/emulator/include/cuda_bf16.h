/* recc CUDA emulator: cuda_emu.h (included first) provides __nv_bfloat16 and its conversions. */
#pragma once
