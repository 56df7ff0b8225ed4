// CRC-32C (Castagnoli), as iSCSI, ext4 and leveldb use it: the checksum of the journal's step
// blocks and step rows. Uses the CPU's crc32 instruction (SSE 4.2) when it has one.
#pragma once

#include <cstdint>
#include <string_view>

namespace gradwatch::store {

// The CRC-32C of `bytes` following bytes whose CRC-32C is `crc_before` (0 for none), so that
// Crc32c(b, Crc32c(a)) == Crc32c(a + b).
uint32_t Crc32c(std::string_view bytes, uint32_t crc_before = 0);

}  // namespace gradwatch::store
