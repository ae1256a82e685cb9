// Two 32x32 bf16 tiles transposed back to back with ATen's AVX-512 transpose_mxn<BFloat16>, as Inductor's CPU
// kernels do. Built as Inductor builds its kernels (-O3, STANDALONE_TORCH_HEADER), GCC 11.3 and 12.2 return
// scrambled tiles; clang 16, -O2, -fno-tree-slp-vectorize or -fno-ipa-cp-clone return the right ones.
//
//   TI=$(python -c "import torch, os; print(os.path.join(os.path.dirname(torch.__file__), 'include'))")
//   g++ -O3 -std=c++20 -DCPU_CAPABILITY_AVX512 -DSTANDALONE_TORCH_HEADER -mavx512f -mavx512dq -mavx512vl \
//       -mavx512bw -I$TI transpose_repro.cpp -o repro && ./repro
#include <ATen/cpu/vec/vec.h>
#include <cstdio>
#include <cstring>
using at::BFloat16;

__attribute__((noinline)) void two_tiles(const BFloat16* a, const BFloat16* b, BFloat16* ta, BFloat16* tb) {
  alignas(64) BFloat16 t0[32 * 32];
  alignas(64) BFloat16 t1[32 * 32];
  at::vec::transpose_mxn<BFloat16>(a, 64, t0, 32, 32, 32);
  at::vec::transpose_mxn<BFloat16>(b, 64, t1, 32, 32, 32);
  std::memcpy(ta, t0, sizeof t0);
  std::memcpy(tb, t1, sizeof t1);
}

int main() {
  static BFloat16 a[32 * 64], b[32 * 64], ta[32 * 32], tb[32 * 32];
  for (int i = 0; i < 32 * 64; i++) {
    a[i] = BFloat16(float(i % 251));
    b[i] = BFloat16(float((i * 7) % 253));
  }
  two_tiles(a, b, ta, tb);
  int wrong = 0;
  for (int i = 0; i < 32; i++)
    for (int j = 0; j < 32; j++) {
      wrong += float(ta[j * 32 + i]) != float(a[i * 64 + j]);
      wrong += float(tb[j * 32 + i]) != float(b[i * 64 + j]);
    }
  std::printf("%d of 2048 transposed elements wrong\n", wrong);
  return wrong != 0;
}
