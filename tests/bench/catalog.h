// The parameter catalog the benches' trainers send: a decoder-only transformer's tensors as a
// Llama-style model names them. Per layer the attention's q, k, v and o projections and the MLP's
// gate, up and down projections (weight decay 0.1) and two RMSNorm gains (no weight decay: the
// series the incident is about, tracked at full resolution with change points and event slopes);
// the output layer first. Two in nine parameters are norm gains, as in such a model.
#pragma once

#include <array>
#include <cstddef>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "server/core/types.h"

namespace gradwatch::bench {

struct BenchParam {
  std::string name;
  ParamKind kind = ParamKind::kUnspecified;
  double weight_decay = 0;
};

inline std::vector<BenchParam> Catalog(size_t params) {
  static constexpr std::array<std::pair<std::string_view, ParamKind>, 9> kLayer = {{
      {"self_attn.q_proj", ParamKind::kAttention},
      {"self_attn.k_proj", ParamKind::kAttention},
      {"self_attn.v_proj", ParamKind::kAttention},
      {"self_attn.o_proj", ParamKind::kAttention},
      {"mlp.gate_proj", ParamKind::kMlp},
      {"mlp.up_proj", ParamKind::kMlp},
      {"mlp.down_proj", ParamKind::kMlp},
      {"input_layernorm", ParamKind::kNormGain},
      {"post_attention_layernorm", ParamKind::kNormGain},
  }};
  std::vector<BenchParam> out;
  out.reserve(params);
  for (size_t i = 0; i < params; ++i) {
    if (i == 0) {
      out.push_back({"lm_head.weight", ParamKind::kOutput, 0.1});
      continue;
    }
    const auto& [name, kind] = kLayer[(i - 1) % kLayer.size()];
    out.push_back({"model.layers." + std::to_string((i - 1) / kLayer.size()) + "." + std::string(name) + ".weight",
                   kind, kind == ParamKind::kNormGain ? 0.0 : 0.1});
  }
  return out;
}

}  // namespace gradwatch::bench
