// Test helper: a catalog parameter's fact, with no norm, share or fit yet.
#pragma once

#include <cstdint>
#include <string>

#include "alerts/facts.h"

namespace gradwatch::alerts::testing {

inline ParamFact Param(const std::string& name, ParamKind kind, double wd, uint64_t numel = 6144) {
  ParamFact p;
  p.info.name = name;
  p.info.kind = kind;
  p.info.weight_decay = wd;
  p.info.numel = numel;
  return p;
}

}  // namespace gradwatch::alerts::testing
