/* recc CUDA emulator: cuda_emu.h (included first) provides __half and its conversions. */
#pragma once
