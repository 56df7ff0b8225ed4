#include "server/store/crc32c.h"

#include <array>
#include <cstring>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace gradwatch::store {

namespace {

// Works on the inverted register (~crc), as both paths below do.
uint32_t TableCrc(const unsigned char* p, size_t n, uint32_t reg) {
  static const std::array<uint32_t, 256> kTable = [] {
    std::array<uint32_t, 256> table{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) != 0 ? 0x82F63B78u ^ (c >> 1) : c >> 1;
      table[i] = c;
    }
    return table;
  }();
  for (size_t i = 0; i < n; ++i) reg = kTable[(reg ^ p[i]) & 0xff] ^ (reg >> 8);
  return reg;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t HardwareCrc(const unsigned char* p, size_t n, uint32_t reg) {
  uint64_t r = reg;
  for (; n >= 8; p += 8, n -= 8) {
    uint64_t word = 0;
    std::memcpy(&word, p, 8);
    r = _mm_crc32_u64(r, word);
  }
  auto r32 = static_cast<uint32_t>(r);
  for (; n > 0; ++p, --n) r32 = _mm_crc32_u8(r32, *p);
  return r32;
}

const bool kHasCrcInstruction = __builtin_cpu_supports("sse4.2");
#endif

}  // namespace

uint32_t Crc32c(std::string_view bytes, uint32_t crc_before) {
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());
  const uint32_t reg = ~crc_before;
#if defined(__x86_64__)
  if (kHasCrcInstruction) return ~HardwareCrc(p, bytes.size(), reg);
#endif
  return ~TableCrc(p, bytes.size(), reg);
}

}  // namespace gradwatch::store
