// Names the calling thread, so that `top -H`, `perf` and /proc/PID/task/TID/comm tell the daemon's
// threads apart (the benchmark reports CPU per thread name). Linux keeps 15 characters.
#pragma once

#include <pthread.h>

#include <string>

namespace gradwatch {

inline void NameThisThread(const std::string& name) { pthread_setname_np(pthread_self(), name.substr(0, 15).c_str()); }

}  // namespace gradwatch
