// A trainer loop that reports its steps with the installed gradwatch C++ client:
//   trainer ADDRESS RUN STEPS
// Exits 0 when every step is durable and the daemon recorded the run as finished.
#include <gradwatch/monitor.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <string>

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: %s ADDRESS RUN STEPS\n", argv[0]);
    return 2;
  }
  gradwatch::client::MonitorOptions options;
  options.address = argv[1];
  options.hello.set_run_id(argv[2]);
  options.hello.set_world_size(1);
  auto* param = options.hello.add_params();
  param->set_name("final_norm.weight");
  param->set_numel(4096);
  param->set_kind(gradwatch::v1::PARAM_KIND_NORM_GAIN);
  gradwatch::client::Monitor monitor(options);
  monitor.Start();

  const long steps = std::stol(argv[3]);
  for (long step = 1; step <= steps; ++step) {
    gradwatch::v1::StepStats stats;
    stats.set_step(step);
    stats.set_loss(2.0 - 0.001 * step);
    stats.mutable_total_grad()->set_norm(0.3 + 0.001 * step);
    auto* p = stats.add_params();
    p->set_index(0);
    p->mutable_grad()->set_norm(0.1);
    p->mutable_param()->set_norm(64.0 + 0.01 * step);
    if (!monitor.LogBlocking(std::move(stats), std::chrono::seconds(60))) {
      std::fprintf(stderr, "step %ld not taken: %s\n", step, monitor.Stats().last_error.c_str());
      return 1;
    }
  }
  if (!monitor.Finish(std::chrono::seconds(60))) {
    std::fprintf(stderr, "not finished: %s\n", monitor.Stats().last_error.c_str());
    return 1;
  }
  std::printf("%ld steps durable, acked through %llu\n", steps,
              static_cast<unsigned long long>(monitor.Stats().acked_through_step));
  return 0;
}
