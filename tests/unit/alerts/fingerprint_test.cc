#include <catch2/catch.hpp>

#include "alerts/alert.h"

using gradwatch::alerts::Fingerprint;
using gradwatch::alerts::FingerprintHex;
using gradwatch::alerts::LabelSet;

TEST_CASE("fingerprint of the empty label set is the FNV-1a offset basis", "[alerts]") {
  CHECK(FingerprintHex({}) == "cbf29ce484222325");
}

TEST_CASE("fingerprint depends on every label name and value", "[alerts]") {
  const LabelSet base{{"alertname", "GradNormContingency"}, {"run", "r1"}};
  LabelSet other_value = base;
  other_value["run"] = "r2";
  LabelSet extra = base;
  extra["severity"] = "page";
  CHECK(Fingerprint(base) == Fingerprint(LabelSet(base)));
  CHECK(Fingerprint(base) != Fingerprint(other_value));
  CHECK(Fingerprint(base) != Fingerprint(extra));
}

TEST_CASE("fingerprint separates names from values", "[alerts]") {
  CHECK(Fingerprint({{"ab", "c"}}) != Fingerprint({{"a", "bc"}}));
}
