// Cache hints that the compiler keeps. GCC 12 at -O2 silently drops some __builtin_prefetch calls
// whose address is computed from loads (a chunk ring's slot, a chunk's words: PointLog), so the
// hints are written as asm, which it may not remove.
#pragma once

namespace gradwatch {

// Brings the line holding *p into the caches, for a read. p need not be dereferenceable (null, or
// one past a buffer): a prefetch never faults, and the address is passed in a register, so the
// C++ code dereferences nothing (sanitizers see no access).
inline void PrefetchRead(const void* p) {
#if defined(__x86_64__)
  asm volatile("prefetcht0 (%0)" : : "r"(p));
#else
  __builtin_prefetch(p);
#endif
}

}  // namespace gradwatch
